"""Work bounded before admission and stopped when its client goes away, over real HTTP.

A fake engine whose compute stops at 10 ms boundaries (like the engine's decodes) covers every route's
shape; the real engine covers the issue's case: a disconnected 256-decision request frees the
engine within one decision's time, and the next request's numbers are unchanged.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import llama_cpp
import pytest

from adapter.state import STATE
from arbiter.engine import Engine
from arbiter.engine import llama as llama_module
from tests.adapter.conftest import error_of
from tests.fakes import FakeEngine, decision_body

pytestmark = pytest.mark.asyncio(loop_scope="session")

MB = 1024 * 1024
JSONL = {"Content-Type": "application/jsonlines"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SYSTEMONE = {"model": "default", "state": "s", "questions": {"q": {"type": "noul"}}}
ROUTES: dict[str, tuple[str, Any, dict[str, str] | None]] = {
    "decision": ("/invocations", {"decision": decision_body()}, None),
    "decisions": ("/invocations", {"decisions": [decision_body(f"d{i}") for i in range(3)]}, None),
    "systemone": ("/v1/systemone", SYSTEMONE, None),
    "chat": ("/v1/chat/completions", CHAT, None),
    "chat-sse": ("/v1/chat/completions", {**CHAT, "stream": True}, None),
    "completion": ("/v1/completions", {"prompt": "hi"}, None),
    "jsonlines": ("/invocations", json.dumps(decision_body()) + "\n", JSONL),
}


def _sample(app: Any, name: str, **labels: str) -> float:
    value = app[STATE].metrics.registry.get_sample_value(name, labels)
    return float(value or 0.0)


async def _until(condition: Callable[[], bool], limit_s: float, what: str) -> float:
    """Seconds until ``condition`` holds, polled every 5 ms (fails past ``limit_s``)."""
    started = time.perf_counter()
    for _ in range(int(limit_s / 0.005) + 1):
        if condition():
            return time.perf_counter() - started
        await asyncio.sleep(0.005)
    raise AssertionError(f"{what} within {limit_s} s")


async def _freed(app: Any, limit_s: float) -> float:
    """Seconds until no request holds a slot."""
    admission = app[STATE].admission
    return await _until(lambda: admission.in_flight == 0, limit_s, "the slot was not freed")


async def _send(client: Any, route: str) -> Any:
    path, body, headers = ROUTES[route]
    if isinstance(body, str):
        return await client.post(path, data=body.encode(), headers=headers)
    return await client.post(path, json=body)


@pytest.mark.parametrize("route", ROUTES)
async def test_a_disconnected_request_stops_its_work_and_frees_its_slot(
    make: Any, route: str
) -> None:
    engine = FakeEngine(delay_s=60)
    client = await make(engine)
    app = client.server.app
    request = asyncio.ensure_future(_send(client, route))
    await asyncio.to_thread(engine.started.wait, 10)
    if route == "chat-sse":  # the stream has started: the client reads a little, then leaves
        response = await request
        await response.content.readline()
        response.close()
    else:
        request.cancel()  # the client goes away: aiohttp closes its connection
    await _freed(app, limit_s=5)  # at the fake's next boundary, not after its 60 s
    assert _sample(app, "arbiter_cancelled_total", stage="computing") == 1
    engine.delay_s = 0
    response = await _send(client, route)
    assert response.status == 200, await response.text()


async def test_a_request_that_leaves_the_queue_is_counted(make: Any) -> None:
    engine = FakeEngine(delay_s=60)
    client = await make(engine, max_queue=1)
    app = client.server.app
    running = asyncio.ensure_future(_send(client, "decision"))
    await asyncio.to_thread(engine.started.wait, 10)
    waiting = asyncio.ensure_future(_send(client, "decision"))
    await _until(lambda: app[STATE].admission.queued == 1, 5, "never queued")
    waiting.cancel()
    counted = lambda: _sample(app, "arbiter_cancelled_total", stage="queued") == 1  # noqa: E731
    await _until(counted, 5, "the queued request was not counted")
    running.cancel()
    await _freed(app, limit_s=5)


async def test_what_cannot_fit_is_refused_before_admission(make: Any) -> None:
    """With the one slot busy and no queue, a 5 MB message or state is still its 422 (it never
    waits for a slot to be refused), not a 503."""
    engine = FakeEngine(delay_s=60)
    client = await make(engine, max_queue=0)
    busy = asyncio.ensure_future(_send(client, "decision"))
    await asyncio.to_thread(engine.started.wait, 10)
    huge = "The printer is on fire. " * (5 * MB // 24)

    async def post(path: str, body: dict[str, Any]) -> Any:
        data = io.BytesIO(json.dumps(body).encode())  # a large body, streamed
        return await client.post(path, data=data, headers={"Content-Type": "application/json"})

    chat = {"messages": [{"role": "user", "content": huge}]}
    error = await error_of(await post("/v1/chat/completions", chat), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "at least" in error["message"]
    error = await error_of(await post("/v1/completions", {"prompt": huge}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "at least" in error["message"]
    single = {"decision": decision_body(state=huge)}
    error = await error_of(await post("/invocations", single), 422)
    assert error["code"] == "context_length_exceeded" and error["param"] == "decision.state"
    # Each of these fits the fake's 512-token context; together they are over 16 contexts.
    states = [f"{i} " + "x" * 7000 for i in range(24)]
    many = {"decisions": [decision_body(f"d{i}", state=s) for i, s in enumerate(states)]}
    error = await error_of(await post("/invocations", many), 413)
    assert error["code"] == "request_token_budget_exceeded"
    detail = await (await post("/v1/systemone", {**SYSTEMONE, "state": huge})).json()
    assert detail["detail"][0]["loc"] == ["body", "state"]
    assert engine.calls == 1  # only the request that holds the slot
    busy.cancel()


async def test_a_request_over_its_token_budget_is_413_before_the_engine(make: Any) -> None:
    engine = FakeEngine()
    client = await make(engine, max_request_tokens=100)
    body = {
        "decisions": [decision_body(f"d{i}", state=f"State {i}: " + "x" * 400) for i in range(8)]
    }
    error = await error_of(await client.post("/invocations", json=body), 413)
    assert error["code"] == "request_token_budget_exceeded"
    assert "ARBITER_MAX_REQUEST_TOKENS" in error["message"] and "100" in error["message"]
    assert engine.calls == 0
    assert (await _send(client, "decisions")).status == 200


# -- the real engine: a 256-decision request, disconnected ---------------------------------------


def _decisions(n: int, salt: str) -> list[dict[str, Any]]:
    return [
        decision_body(f"d{i}", f"Ticket {salt}-{i}: " + "the parcel arrived late and damaged, " * 6)
        for i in range(n)
    ]


async def _score(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/invocations", json={"decision": body})
    assert response.status == 200, await response.text()
    return dict((await response.json())["result"])


async def test_a_disconnected_256_decision_request_frees_the_engine_within_one_decision(
    client: Any, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = client.server.app
    probe = decision_body("probe", "A state that only the probe uses: the coffee machine leaks.")
    engine.cache.clear()
    before = await _score(client, probe)
    started = time.perf_counter()
    await _score(client, _decisions(1, "alone")[0])  # one decision like the request's, cold
    one_decision = time.perf_counter() - started

    decodes = 0
    real = llama_cpp.llama_decode

    def counted(ctx: Any, batch: Any) -> int:
        nonlocal decodes
        decodes += 1
        return int(real(ctx, batch))

    monkeypatch.setattr(llama_module.llama_cpp, "llama_decode", counted)
    request = asyncio.ensure_future(
        client.post("/invocations", json={"decisions": _decisions(256, "big")})
    )
    await _until(lambda: decodes >= 6, 60, "never started")  # three decisions in
    request.cancel()
    freed = await _freed(app, limit_s=60)
    assert _sample(app, "arbiter_cancelled_total", stage="computing") == 1
    assert decodes < 20  # stopped, not run to its 512 decodes
    # The decode in flight cannot be interrupted; nothing starts after it.
    assert freed < max(2 * one_decision, 0.3), (freed, one_decision)
    engine.cache.clear()
    after = await _score(client, probe)
    assert after["option_logits"] == before["option_logits"]
    assert after["probabilities"] == before["probabilities"]


@pytest.mark.parametrize("route", ["chat", "completion"])
async def test_a_prompt_is_tokenized_in_its_slot_not_while_it_waits(make: Any, route: str) -> None:
    """Chat prompts were rendered and tokenized before admission, outside ARBITER_MAX_IN_FLIGHT
    and ARBITER_MAX_QUEUE: any number of them could hold the tokenizer at once (text
    completions, written beside that fix, did it too)."""
    engine = FakeEngine(delay_s=60)
    tokenized: list[int] = []
    encode = engine.encode_segments

    def spy(segments: Any) -> Any:
        tokenized.append(app[STATE].admission.in_flight)
        return encode(segments)

    engine.encode_segments = spy  # type: ignore[method-assign]
    client = await make(engine, max_queue=1)
    app = client.server.app
    busy = asyncio.ensure_future(_send(client, "decision"))
    await asyncio.to_thread(engine.started.wait, 10)
    chat = asyncio.ensure_future(_send(client, route))
    await _until(lambda: app[STATE].admission.queued == 1, 5, "the prompt never queued")
    assert tokenized == []  # waiting: nothing tokenized
    busy.cancel()
    engine.delay_s = 0
    response = await chat
    assert response.status == 200, await response.text()
    assert tokenized == [1]  # in its own slot


async def test_a_client_that_leaves_a_stream_is_499_not_an_internal_error() -> None:
    """Without handler cancellation (or when the write comes first), the next write into the
    stream fails: that is the client gone (499), not a fault of ours logged with a trace."""
    from adapter.app import create_app
    from tests.adapter.conftest import settings
    from tests.live_server import serve

    engine = FakeEngine(delay_s=0.2)
    app = create_app(settings(), lambda: engine)
    registry = app[STATE].metrics.registry
    labels = {"route": "/v1/chat/completions", "kind": "messages"}

    def count(status: str) -> float | None:
        return registry.get_sample_value("arbiter_requests_total", {**labels, "status": status})

    with serve(app) as base:  # an AppRunner without handler cancellation
        async with aiohttp.ClientSession() as session:
            body = {**CHAT, "stream": True}
            async with session.post(f"{base}/v1/chat/completions", json=body) as response:
                await response.content.readline()  # the role chunk; then the client goes
        await _until(lambda: count("499") == 1, 10, "the departure was not counted as 499")
        await _freed(app, limit_s=10)  # its generation ends before the server does
    assert count("200") is None
