"""A model's load stops when its server stops: each step of it ends within a fraction of a second
of the cancel (the checksum between blocks, the weights through llama.cpp's progress callback,
the read check's decodes through its abort callback), and an engine whose load finished is never
stopped by it: a request's decode is not aborted half-way."""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path
from typing import Any

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
