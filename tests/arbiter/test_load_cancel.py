"""A model's load stops when its server stops: each step of it ends within a fraction of a second
of the cancel (the checksum between blocks, the weights through llama.cpp's progress callback,
the read check's decodes through its abort callback), and an engine whose load finished is never
stopped by it: a request's decode is not aborted half-way."""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from arbiter.engine import open_engine
from arbiter.engine.llama import Llama
from arbiter.errors import LoadCancelled
from arbiter.schema import DecisionResult
from arbiter.settings import EngineSettings
from tests.fakes import decision
from tests.threads import TEST_THREADS


def _settings(gguf: Path, **extra: Any) -> EngineSettings:
    return EngineSettings(
        model=gguf, model_dir=Path("/nonexistent"), n_threads=TEST_THREADS, **extra
    )


def test_a_cancel_before_the_weights_stops_llama_cpps_load(default_gguf: Path) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(LoadCancelled):
        Llama(default_gguf, _settings(default_gguf), cancel=cancel)


def _cancelled_at(gguf: Path, step: str) -> tuple[LoadCancelled, float]:
    """The load's error when its cancel is set as ``step`` starts, and how long it took then."""
    cancel = threading.Event()
    at: list[float] = []

    def progress(event: str, fields: dict[str, Any]) -> None:
        if event == step:
            at.append(time.monotonic())
            cancel.set()

    with pytest.raises(LoadCancelled) as cancelled:
        open_engine(_settings(gguf), progress=progress, cancel=cancel)
    return cancelled.value, time.monotonic() - at[0]


def test_a_cancel_during_the_checksum_stops_it_between_two_blocks(default_gguf: Path) -> None:
    cancelled, _ = _cancelled_at(default_gguf, "model_loading")
    frames = [frame.name for frame in traceback.extract_tb(cancelled.__traceback__)]
    assert "sha256_file" in frames, frames  # not the weights' load after a whole checksum


def test_a_cancel_during_the_read_check_aborts_its_decode(default_gguf: Path) -> None:
    """The read check takes 2-13 s here on 2 cores; checked only between its decodes, the cancel
    took 1.9 s: llama.cpp's abort callback stops the decode itself."""
    _, took = _cancelled_at(default_gguf, "read_check_started")
    assert took < 1.0, f"{took:.2f} s after the cancel"


def test_a_cancel_after_the_load_stops_nothing(default_gguf: Path) -> None:
    cancel = threading.Event()
    engine = open_engine(_settings(default_gguf, read_check="off"), cancel=cancel)
    try:
        cancel.set()  # a server stopping now drains its requests: none is aborted
        (result,) = engine.score([decision("after-the-load")])
        assert isinstance(result, DecisionResult), result
    finally:
        engine.close()


def _decode_seconds(gguf: Path, cancel_after_s: float | None) -> float:
    """One long decode (a single slice of 1,024 tokens) on a context opened with a load's
    cancel, set ``cancel_after_s`` into it (None: never)."""
    cancel = threading.Event()
    settings = _settings(gguf, n_ctx=2048, n_batch=1024)
    llama = Llama(gguf, settings, cancel=cancel)
    try:
        llama.open_context(settings, 2)
        n = 1024
        tokens = np.full(n, llama.vocab.tokenize("ok", special=False)[0], dtype=np.int32)
        want = np.zeros(n, dtype=bool)
        want[-1] = True
        timer = None
        if cancel_after_s is not None:
            timer = threading.Timer(cancel_after_s, cancel.set)
            timer.start()
        started = time.monotonic()
        with contextlib.suppress(LoadCancelled):
            llama.decode(tokens, np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32), want)
        took = time.monotonic() - started
        if timer is not None:
            timer.cancel()
        return took
    finally:
        llama.close()


def test_a_cancel_aborts_a_decode_inside_it_not_after(default_gguf: Path) -> None:
    """The abort callback stops a decode between its graph's nodes: a cancel a tenth into a
    long decode ends it well before the decode would have ended (a check after each decode
    alone would wait for all of it). A ratio of the same run, not a time: machines differ."""
    whole = _decode_seconds(default_gguf, None)
    cut = _decode_seconds(default_gguf, whole / 10)
    assert cut < whole / 2, f"cancelled decode {cut:.2f} s, a whole one {whole:.2f} s"
