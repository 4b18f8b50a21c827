"""SM_LLAMA_CPP_* (the stock llama.cpp SageMaker image's variables) mapped to Arbiter's settings."""

from __future__ import annotations

import os

import pytest

from adapter.middleware import request_id
from arbiter.errors import UnsupportedSetting
from arbiter.settings import from_environment


def test_sm_llama_cpp_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SM_LLAMA_CPP_", "ARBITER_", "SAGEMAKER_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SM_LLAMA_CPP_CTX_SIZE", "2048")
    monkeypatch.setenv("SM_LLAMA_CPP_THREADS", "3")
    monkeypatch.setenv("SM_LLAMA_CPP_N_GPU_LAYERS", "all")
    monkeypatch.setenv("SM_LLAMA_CPP_BATCH_SIZE", "256")
    monkeypatch.setenv("SM_LLAMA_CPP_MODEL", "sub/model.gguf")
    monkeypatch.setenv("SM_LLAMA_CPP_PARALLEL", "2")
    monkeypatch.setenv("SM_LLAMA_CPP_FLASH_ATTN", "true")
    monkeypatch.setenv("SM_LLAMA_CPP_CONT_BATCHING", "true")
    monkeypatch.setenv("ARBITER_N_CTX", "4096")  # Arbiter's own setting wins
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "9090")
    engine_settings, server, unknown = from_environment()
    assert engine_settings.n_ctx == 4096
    assert engine_settings.n_threads == 3
    assert engine_settings.n_gpu_layers == -1
    assert engine_settings.n_batch == 256
    assert str(engine_settings.model) == "/opt/ml/model/sub/model.gguf"
    assert server.max_in_flight == 2 and server.port == 9090
    assert server.host == "0.0.0.0"  # an inference pipeline's container: reached from outside
    assert unknown == ["SM_LLAMA_CPP_CONT_BATCHING", "SM_LLAMA_CPP_FLASH_ATTN"]
    monkeypatch.setenv("SM_LLAMA_CPP_HF_REPO", "ggml-org/gemma-3-270m-GGUF")
    with pytest.raises(UnsupportedSetting, match="never downloads"):
        from_environment()


def test_the_server_listens_on_loopback_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapter.serve import listening

    for name in list(os.environ):
        if name.startswith(("SM_LLAMA_CPP_", "ARBITER_", "SAGEMAKER_")):
            monkeypatch.delenv(name)
    _, server, _ = from_environment()
    assert server.host == "127.0.0.1"
    where, guard = listening(server)
    assert where.startswith("loopback") and guard.startswith("no API key")
    monkeypatch.setenv("ARBITER_HOST", "0.0.0.0")
    monkeypatch.setenv("ARBITER_API_KEY", "k")
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "9090")
    _, server, _ = from_environment()
    where, guard = listening(server)
    assert where.startswith("every interface") and "ARBITER_API_KEY guards" in guard
    monkeypatch.setenv("ARBITER_HOST", "127.0.0.1")  # named: SAGEMAKER_BIND_TO_PORT does not win
    assert from_environment()[1].host == "127.0.0.1"


def test_request_id_from_custom_attributes() -> None:
    assert request_id("request_id=abc, x=1") == "abc"
    assert request_id("trace_id=t;y=2") == "t"
    assert request_id("single-token") == "single-token"
    assert request_id("a=1,b=2", "inference-7") == "inference-7"
    assert len(request_id(None)) == 32


def test_the_allocator_is_tuned_unless_the_environment_says() -> None:
    """glibc's dynamic mmap threshold kept freed 5 MB buffers in the process (bench/soak.py)."""
    import subprocess
    import sys

    from tests import ROOT

    code = "from arbiter import memory; print(sorted(memory.tune()))"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert plain.stdout.strip() == "['MALLOC_ARENA_MAX', 'MALLOC_MMAP_THRESHOLD_']", plain.stderr
    env["MALLOC_ARENA_MAX"] = "4"
    told = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert told.stdout.strip() == "['MALLOC_MMAP_THRESHOLD_']", told.stderr
