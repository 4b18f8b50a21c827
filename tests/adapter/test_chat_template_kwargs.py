"""Chat completions keep the caller's thinking choice (issue 20): ``chat_template_kwargs``,
``reasoning_effort`` and ``enable_thinking`` reach the model's template as llama.cpp's server passes
them; the renderer's own inputs cannot be set."""

from __future__ import annotations

from typing import Any

import pytest

from adapter.app import create_app
from arbiter.engine import Engine
from arbiter.settings import ServerSettings
from tests.live_server import ready

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
async def qwen_client(aiohttp_client: Any, qwen_style: Engine) -> Any:
    app = create_app(ServerSettings(max_in_flight=1), lambda: qwen_style, close_engine=False)
    client = await aiohttp_client(app)
    await ready(client)
    return client


async def _prompt_tokens(client: Any, **fields: Any) -> int:
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 1, **fields}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    return int((await response.json())["usage"]["prompt_tokens"])


async def test_thinking_stays_the_templates_default_unless_the_request_turns_it_off(
    qwen_client: Any, qwen_style: Engine
) -> None:
    default = await _prompt_tokens(qwen_client)
    # Qwen3.5's template opens "<think>\n" by default; off, it writes "<think>\n\n</think>\n\n".
    closed = len(qwen_style.encode_segments([("\n</think>\n\n", True)])) - len(
        qwen_style.encode_segments([("", True)])
    )
    assert closed > 0
    for fields in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
        {"enable_thinking": False},
    ):
        assert await _prompt_tokens(qwen_client, **fields) == default + closed, fields
    assert await _prompt_tokens(qwen_client, enable_thinking=True) == default


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": []}, "chat_template_kwargs"),
        ({"add_generation_prompt": False}, "chat_template_kwargs"),
        ({"enable_thinking": "false"}, "chat_template_kwargs"),
    ],
)
async def test_the_renderers_own_inputs_are_a_400_naming_the_field(
    client: Any, kwargs: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == param
    assert next(iter(kwargs)) in error["message"]
