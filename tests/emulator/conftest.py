"""Fixtures of the emulator's tests (the helpers are in ``tests.emulator.support``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.emulator.support import OPEN_CLIENTS, make_bucket


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """boto3 clients keep their connections pooled; a test's are closed when it ends."""
    yield
    while OPEN_CLIENTS:
        OPEN_CLIENTS.pop().close()


@pytest.fixture
def local_s3(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The test's moto S3 with the bucket made, and ``arbiter transform`` pointed at it."""
    monkeypatch.setenv("ARBITER_AWS_ENDPOINT_URL", endpoint)
    return make_bucket(endpoint)
