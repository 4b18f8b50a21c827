"""The same settings everywhere: `arbiter decide`, `prompt` and `eval` read the environment as
`arbiter serve` does, SageMaker's ``SM_LLAMA_CPP_*`` included. `arbiter decide` used to build
its engine from ``ARBITER_*`` alone, so a SageMaker configuration tried locally
(``SM_LLAMA_CPP_LORA=...``) silently gave the base model's numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from arbiter.settings import engine_from_environment, from_environment
from bench.lora_adapter import write_lora
from tests import EXAMPLES
from tests.environ import environ_without
from tests.ports import free_port

pytestmark = pytest.mark.real_model


def _env(**extra: str) -> dict[str, str]:
    env = environ_without("ARBITER_", "SM_")
    # A random-weight adapter moves the label mass off the labels: the read check at load would
    # refuse it, and this test is about which settings are read, not about the adapter's quality.
    return {**env, "ARBITER_N_THREADS": "2", "ARBITER_READ_CHECK": "off", **extra}


def _decide(decisions: Path, env: dict[str, str]) -> list[float]:
    done = subprocess.run(
        [sys.executable, "-m", "arbiter", "decide", str(decisions), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    probabilities: list[float] = json.loads(done.stdout)["result"]["probabilities"]
    return probabilities


def _serve(decision: dict[str, Any], env: dict[str, str]) -> list[float]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "arbiter", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, "arbiter serve exited"
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=5) as ping:
                    if ping.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "arbiter serve did not load its model"
                time.sleep(0.5)
        request = urllib.request.Request(
            f"{url}/invocations",
            data=json.dumps({"decision": decision}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as answer:
            probabilities: list[float] = json.loads(answer.read())["result"]["probabilities"]
            return probabilities
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_sm_llama_cpp_lora_changes_decides_numbers_as_it_changes_serves(
    default_gguf: Path, tmp_path: Path
) -> None:
    adapter = write_lora(default_gguf, tmp_path / "adapter.gguf", seed=7, std=0.2)
    line = (EXAMPLES / "decisions.jsonl").read_text().splitlines()[0]
    decisions = tmp_path / "one.jsonl"
    decisions.write_text(line + "\n")
    model = {"ARBITER_MODEL": str(default_gguf)}
    base = _decide(decisions, _env(**model))
    sagemaker = _env(**model, SM_LLAMA_CPP_LORA=str(adapter))
    adapted = _decide(decisions, sagemaker)
    served = _serve(json.loads(line), sagemaker)
    assert max(abs(a - b) for a, b in zip(adapted, base, strict=True)) > 1e-3, (adapted, base)
    assert max(abs(a - b) for a, b in zip(adapted, served, strict=True)) < 1e-4, (adapted, served)


def test_every_command_reads_the_engines_settings_as_serve_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in [k for k in os.environ if k not in environ_without("ARBITER_", "SM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SM_LLAMA_CPP_CTX_SIZE", "2048")
    monkeypatch.setenv("SM_LLAMA_CPP_LORA", "adapter.gguf")
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("SM_LLAMA_CPP_MODEL", "model.gguf")
    served = from_environment()[0]
    assert engine_from_environment() == served
    assert (served.n_ctx, served.lora, served.model) == (
        2048,
        "adapter.gguf",
        tmp_path / "model.gguf",
    )
