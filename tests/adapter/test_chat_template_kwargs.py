"""Chat completions keep the caller's thinking choice (issue 20): ``chat_template_kwargs``,
``reasoning_effort`` and ``enable_thinking`` reach the model's template as llama.cpp's server passes
them; the renderer's own inputs cannot be set."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from adapter.app import create_app
from arbiter.engine import Engine
from arbiter.settings import ServerSettings
from tests.adapter.conftest import error_of
from tests.fakes import FakeEngine
from tests.gguf_models import template_text
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


class _Recording(FakeEngine):
    """A fake with a chat template that keeps the segments of the last prompt it encoded."""

    def __init__(self, template: str) -> None:
        super().__init__()
        self.chat_template = template
        self.segments: list[tuple[str, bool]] = []

    def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> np.ndarray:
        self.segments = list(segments)
        return super().encode_segments(segments)


PATTERN = {"type": "string", "pattern": "^[a-z]+(<[0-9]>|\\[x\\])$"}


async def test_a_kwarg_written_through_tojson_reaches_the_prompt_as_the_callers_value(
    make: Any,
) -> None:
    """DeepSeek-V4 writes ``response_format | tojson``: a schema's ``pattern`` (``<>[]|``) reached
    the prompt as the literal mark ``"\\u0000ARBITER_MESSAGE_1\\u0000"`` (issue 44)."""
    engine = _Recording(template_text("deepseek-ai-DeepSeek-V4"))
    client = await make(engine)
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": PATTERN}}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"response_format": response_format},
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    prompt = "".join(text for text, _ in engine.segments)
    assert json.dumps(response_format) in prompt
    assert (json.dumps(PATTERN["pattern"])[1:-1], False) in engine.segments  # placed as text
    assert "\\u0000" not in prompt and "\u0000" not in prompt


async def test_a_kwarg_the_template_changes_is_a_400_naming_the_field(make: Any) -> None:
    template = "{{ controls.length | lower }}" + template_text("Qwen3.5-4B")
    client = await make(_Recording(template))
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"controls": {"length": "short|<long>"}},
    }
    response = await client.post("/v1/chat/completions", json=body)
    error = await error_of(response, 400)
    assert error["param"] == "chat_template_kwargs.controls.length"
    assert error["code"] == "chat_template_error"
