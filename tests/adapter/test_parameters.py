"""The generation parameters over HTTP, on the fake engine: what is refused is refused by name
before any work, on every route that generates; shapes of several choices and of logprobs: null."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.adapter.conftest import error_of
from tests.fakes import FakeEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

MESSAGES = [{"role": "user", "content": "hi"}]
ROUTES = [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/invocations", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "hi"}),
]
REFUSED = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"mirostat": 2}, "mirostat"),
    ({"store": True}, "store"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"modalities": ["text", "audio"]}, "modalities"),
]


@pytest.mark.parametrize(("route", "base"), ROUTES)
@pytest.mark.parametrize(("extra", "param"), REFUSED)
async def test_an_unsupported_parameter_is_refused_by_name_before_any_work(
    make: Any, route: str, base: dict[str, Any], extra: dict[str, Any], param: str
) -> None:
    engine = FakeEngine()
    client = await make(engine)
    # 400 on OpenAI's own routes (as OpenAI and llama.cpp's server answer), 422 on /invocations.
    status = 422 if route == "/invocations" else 400
    error = await error_of(await client.post(route, json={**base, **extra}), status)
    assert error["code"] == "unsupported_parameter" and error["param"] == param
    assert param in error["message"]
    assert not engine.started.is_set()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"5000": 1}}, "logit_bias.5000"),  # outside the vocabulary
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"n": 17}, "n"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
        ({"json_schema": {"type": "number", "minimum": 1}}, "json_schema"),
    ],
)
async def test_a_bad_generation_field_is_a_400_naming_it(
    make: Any, extra: dict[str, Any], param: str
) -> None:
    client = await make()
    body = {"messages": MESSAGES, **extra}
    error = await error_of(await client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param


async def test_n_choices_and_null_logprobs_in_the_answer_and_the_stream(make: Any) -> None:
    client = await make()
    body = {"messages": MESSAGES, "n": 2, "user": "u1", "store": False, "tool_choice": "none"}
    answer = await (await client.post("/v1/chat/completions", json=body)).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in answer["choices"])
    assert answer["system_fingerprint"].startswith("arbiter-")
    streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    events = [e.removeprefix("data: ") for e in (await streamed.text()).split("\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finishes) == [0, 1]
    texts = ["", ""]
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert texts == ["Hello there!", "Hello there!"]
