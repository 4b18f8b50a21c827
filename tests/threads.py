"""Threads per engine in the tests. `make test` runs two pytest-xdist workers on CI's two cores:
two engines of two threads each would wait at llama.cpp's per-operation barriers for a thread that
is not running, so under xdist each worker's engines (and the servers and workers its tests start,
through ARBITER_N_THREADS) take one thread; alone, pytest gives them two."""

from __future__ import annotations

import os

TEST_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
