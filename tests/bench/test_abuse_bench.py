"""`arbiter bench abuse` expects the statuses the server answers today: its 5 MB chat and 5 MB state
are posted to the app (a fake engine; the refusals come from the bytes, before any engine call) and
must get what the bench's checks expect. It expected 422 for chat after /v1/* had moved to OpenAI's
400, and so exited 1 against a server that was right."""

from __future__ import annotations

import io
from typing import Any

import pytest

from adapter.app import create_app
from arbiter.settings import ServerSettings
from bench import abuse_bench
from tests.fakes import FakeEngine
from tests.live_server import ready

# The aiohttp_client fixture lives on the session loop (pyproject), so does the test.
pytestmark = pytest.mark.asyncio(loop_scope="session")
JSON = {"Content-Type": "application/json"}


async def test_the_abuse_bench_expects_what_the_server_answers(aiohttp_client: Any) -> None:
    engine = FakeEngine()
    client = await aiohttp_client(create_app(ServerSettings(), lambda: engine))
    await ready(client)

    async def status(path: str, body: bytes) -> int:
        # A large body streamed, as the bench's client sends it.
        async with client.post(path, data=io.BytesIO(body), headers=JSON) as response:
            await response.read()
            return int(response.status)

    assert await status("/v1/chat/completions", abuse_bench._chat_body()) == (
        abuse_bench.CHAT_REFUSED
    )
    assert await status("/invocations", abuse_bench._state_body()) == abuse_bench.STATE_REFUSED
    assert engine.calls == 0
