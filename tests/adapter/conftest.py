"""The adapter's tests build apps on the session's event loop through ``make``."""

from __future__ import annotations

from typing import Any

import pytest

from adapter.app import create_app
from arbiter.settings import ServerSettings
from tests.fakes import FakeEngine
from tests.live_server import ready


def settings(**kw: Any) -> ServerSettings:
    """Server settings for a test: one request computing, one waiting, unless ``kw`` says."""
    return ServerSettings(**{"max_in_flight": 1, "max_queue": 1, **kw})


async def error_of(response: Any, status: int) -> dict[str, Any]:
    """The ``{"error": ...}`` body of a response that must have ``status``."""
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body["error"]) >= {"type", "code", "message", "param"}
    return dict(body["error"])


@pytest.fixture
async def make(aiohttp_client: Any) -> Any:
    """``await make(engine=None, **server_settings)``: a test client of a ready app."""

    async def build(engine: FakeEngine | None = None, **kw: Any) -> Any:
        eng = engine or FakeEngine()
        client = await aiohttp_client(create_app(settings(**kw), lambda: eng))
        await ready(client)
        return client

    return build
