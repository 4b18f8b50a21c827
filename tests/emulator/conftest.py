"""Fixtures of the emulator's tests (the helpers are in ``tests.emulator.support``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.emulator.support import OPEN_CLIENTS


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """boto3 clients keep their connections pooled; a test's are closed when it ends."""
    yield
    while OPEN_CLIENTS:
        OPEN_CLIENTS.pop().close()
