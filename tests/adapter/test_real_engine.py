"""End to end over loopback with the real bundled model: each request shape, JSON Lines, chat."""

from __future__ import annotations

import json
from typing import Any

import pytest

from arbiter.engine import Engine
from arbiter.schema import DecisionRequest
from tests.fakes import decision_body

pytestmark = pytest.mark.asyncio(loop_scope="session")

TICKET = "The customer cannot log in after a password reset."


def ticket(id: str, question: str = "Which queue should handle this ticket?") -> dict[str, Any]:
    return {
        "id": id,
        "state": TICKET,
        "question": question,
        "options": [
            {"id": "access", "description": "Account access"},
            {"id": "billing", "description": "Billing and invoices"},
        ],
    }


async def test_single_decision_matches_the_engine(client: Any, engine: Engine) -> None:
    response = await client.post("/invocations", json={"decision": ticket("one")})
    assert response.status == 200
    result = (await response.json())["result"]
    direct = engine.score([DecisionRequest(**ticket("one"))])[0]
    assert result["choice"] == direct.choice
    assert result["option_logits"] == pytest.approx(direct.option_logits, abs=1e-3)
    assert result["model"]["file"] == engine.model_info.file


async def test_decisions_in_input_order_shared_state_reuses_prefix(client: Any) -> None:
    body = {
        "decisions": [
            ticket("q1"),
            decision_body("other", state={"printer": "on fire"}),
            ticket("q2", "Is this urgent?"),
        ]
    }
    response = await client.post("/invocations", json=body)
    assert response.status == 200
    out = await response.json()
    assert [r["id"] for r in out["results"]] == ["q1", "other", "q2"]
    assert (
        out["results"][0]["prompt"]["prefix_tokens"] == out["results"][2]["prompt"]["prefix_tokens"]
    )
    assert out["timing"]["decisions"] == 3 and out["timing"]["engine_s"] > 0


async def test_jsonlines_order_and_count_with_a_bad_line(client: Any) -> None:
    lines = [
        json.dumps(ticket("a")),
        '{"id": "broken", ',
        json.dumps(ticket("b", "Is this urgent?")),
    ]
    response = await client.post(
        "/invocations",
        data=("\n".join(lines) + "\n").encode(),
        headers={"Content-Type": "application/jsonlines"},
    )
    assert response.status == 200
    out = [json.loads(line) for line in (await response.text()).splitlines()]
    assert [(o["line"], o["id"]) for o in out] == [(1, "a"), (2, None), (3, "b")]
    assert out[0]["result"]["choice"] in {"access", "billing"}
    assert out[1]["error"]["code"] == "invalid_json"
    assert out[2]["result"]["id"] == "b"


async def test_chat_completion_real_model(client: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 6,
        "temperature": 0,
    }
    first = await (await client.post("/invocations", json=body)).json()
    second = await (await client.post("/v1/chat/completions", json=body)).json()
    choice = first["choices"][0]
    assert choice["finish_reason"] in {"stop", "length"}
    assert first["usage"]["completion_tokens"] <= 6
    assert choice["message"]["content"] == second["choices"][0]["message"]["content"]  # greedy


async def test_chat_stream_real_model(client: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "Count: one, two,"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200
    events = [e.removeprefix("data: ") for e in (await response.text()).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = await (await client.post("/v1/chat/completions", json={**body, "stream": False})).json()
    assert streamed == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


async def test_models_and_metrics_real(client: Any) -> None:
    await client.post("/invocations", json={"decision": ticket("m")})
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["meta"]["architecture"] == "gemma3"
    text = await (await client.get("/metrics")).text()
    assert 'arbiter_decisions_total{outcome="ok"}' in text
    assert 'arbiter_prefix_cache_total{result="' in text
