"""HTTP shape of the adapter over loopback, with a fake engine: routes, errors, backpressure, ping."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from typing import Any

import pytest
from aiohttp import ClientTimeout
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from adapter.app import create_app
from adapter.state import STATE
from tests.adapter.conftest import error_of, ready, settings
from tests.fakes import FakeEngine, decision_body

# Fixtures live on the session loop (pyproject: asyncio_default_fixture_loop_scope); so do tests.
pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_ping_503_until_the_model_is_loaded(aiohttp_client: Any) -> None:
    release = threading.Event()

    def slow_factory() -> FakeEngine:
        release.wait(10)
        return FakeEngine()

    client = await aiohttp_client(create_app(settings(), slow_factory))
    response = await client.get("/ping")
    error = await error_of(response, 503)
    assert error["code"] == "model_not_ready" and error["retryable"] is True
    assert response.headers["Retry-After"] == "1"
    inv = await client.post("/invocations", json={"decision": decision_body()})
    assert (await error_of(inv, 503))["code"] == "model_not_ready"
    release.set()
    await ready(client)


async def test_ping_answers_fast_during_a_long_decision(make: Any) -> None:
    engine = FakeEngine(delay_s=1.5)
    client = await make(engine)
    task = asyncio.ensure_future(client.post("/invocations", json={"decision": decision_body()}))
    await asyncio.to_thread(engine.started.wait, 5)
    latencies = []
    for _ in range(10):
        started = time.perf_counter()
        assert (await client.get("/ping")).status == 200
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.02)
    assert not task.done()
    assert max(latencies) < 0.1, latencies
    assert (await task).status == 200


async def test_single_and_many_shapes(make: Any) -> None:
    client = await make()
    single = await client.post("/invocations", json={"decision": decision_body()})
    assert single.status == 200
    assert (await single.json())["result"]["id"] == "d1"
    many = await client.post(
        "/invocations",
        json={"decisions": [decision_body("a"), decision_body("b", options=5), decision_body("c")]},
    )
    body = await many.json()
    assert [r["id"] for r in body["results"]] == ["a", "b", "c"]
    assert body["results"][1]["error"]["param"] == "decisions.1.options"
    assert body["timing"]["decisions"] == 3 and body["timing"]["failed"] == 1
    # Every decision failed: the request fails with the first error, its field named.
    failed = await client.post("/invocations", json={"decision": decision_body(options=5)})
    assert (await error_of(failed, 422))["param"] == "decision.options"


def _decision_counts(text: str) -> dict[str, str]:
    """``arbiter_decisions_total`` by outcome, from a /metrics page."""
    prefix = "arbiter_decisions_total{"
    return dict(line.split(" ", 1) for line in text.splitlines() if line.startswith(prefix))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (decision_body("a"), None),
        (decision_body("b", options=5), "options"),  # the engine's error
        ({**decision_body("c"), "options": []}, "options"),  # the schema's
        (decision_body("d", state="x" * 20_000), "state"),  # refused before admission
        (5, ""),  # not an object
    ],
    ids=["result", "engine-error", "schema-error", "refused-before-admission", "not-an-object"],
)
async def test_a_decision_is_the_one_item_case_of_decisions(
    make: Any, body: Any, field: str | None
) -> None:
    """Same status, same result or error (its field under ``decision`` or ``decisions.0``), the
    same decisions counted: one path validates, admits, counts and answers both."""
    answers = []
    for key in ("decision", "decisions"):
        client = await make()
        response = await client.post(
            "/invocations", json={key: body if key == "decision" else [body]}
        )
        payload = await response.json()
        metrics = _decision_counts(await (await client.get("/metrics")).text())
        answers.append((response.status, payload, metrics))
    (status, single, counted), (many_status, many, many_counted) = answers
    assert status == many_status and counted == many_counted
    if field is None:
        assert status == 200
        assert single["result"] == many["results"][0]
        assert many["timing"]["decisions"] == 1 and many["timing"]["failed"] == 0
    else:
        error, many_error = single["error"], many["error"]
        assert error["param"] == "decision" + (f".{field}" if field else "")
        assert many_error["param"] == "decisions.0" + (f".{field}" if field else "")
        assert error["code"] == many_error["code"]
        # The message names the field where the schema names it, and says the same otherwise.
        named = error["message"].replace("decision", "decisions.0", 1)
        assert many_error["message"] in (error["message"], named)


async def test_error_statuses_and_bodies(make: Any) -> None:
    client = await make(max_body_mb=0.01)
    bad = await client.post(
        "/invocations", data=b"{nope", headers={"Content-Type": "application/json"}
    )
    assert (await error_of(bad, 400))["code"] == "invalid_json"
    media = await client.post("/invocations", data=b"x", headers={"Content-Type": "text/csv"})
    assert (await error_of(media, 415))["param"] == "Content-Type"
    big = await client.post("/invocations", json={"decision": decision_body(state="x" * 20000)})
    assert (await error_of(big, 413))["code"] == "payload_too_large"
    field = await client.post("/invocations", json={"decision": {**decision_body(), "options": []}})
    assert (await error_of(field, 422))["param"] == "decision.options"
    dup = await client.post(
        "/invocations", json={"decisions": [decision_body("a"), decision_body("a")]}
    )
    assert (await error_of(dup, 422))["param"] == "decisions.1.id"
    empty = await client.post("/invocations", json={"decisions": []})
    assert (await error_of(empty, 422))["param"] == "decisions"
    shape = await client.post("/invocations", json={"hello": 1})
    assert (await error_of(shape, 422))["code"] == "unknown_request_shape"
    array = await client.post("/invocations", json=[1])
    assert (await error_of(array, 422))["code"] == "invalid_type"
    assert (await error_of(await client.get("/nope"), 404))["code"] == "not_found"
    assert (await error_of(await client.get("/invocations"), 405))["code"] == "method_not_allowed"
    chat = await client.post("/v1/chat/completions", json={"messages": [], "n": 2})
    assert (await error_of(chat, 400))["param"] == "messages"  # OpenAI's route: OpenAI's 400


async def test_six_megabyte_json_body_is_accepted(make: Any) -> None:
    client = await make()
    body = json.dumps({"decision": decision_body(), "padding": "x" * (6 * 1024 * 1024 - 500)})
    response = await client.post(
        "/invocations", data=io.BytesIO(body.encode()), headers={"Content-Type": "application/json"}
    )
    assert response.status == 200, await response.text()


async def test_internal_fault_is_a_500_with_a_logged_trace(make: Any) -> None:
    engine = FakeEngine()
    engine.score = None  # type: ignore[assignment,method-assign]
    client = await make(engine)
    with capture_logs() as logs:
        response = await client.post("/invocations", json={"decision": decision_body()})
    assert (await error_of(response, 500))["code"] == "internal_error"
    fault = next(e for e in logs if e["event"] == "internal_error")
    assert "Traceback" in fault["trace"]


async def test_busy_is_503_with_retry_after_and_slots_free_up(make: Any) -> None:
    engine = FakeEngine(delay_s=0.6)
    client = await make(engine, max_in_flight=1, max_queue=1, retry_after_s=2)
    requests = [
        asyncio.ensure_future(client.post("/invocations", json={"decision": decision_body(str(i))}))
        for i in range(3)
    ]
    responses = await asyncio.gather(*requests)
    statuses = sorted(r.status for r in responses)
    assert statuses == [200, 200, 503]
    busy = next(r for r in responses if r.status == 503)
    assert busy.headers["Retry-After"] == "2"
    error = await busy.json()
    assert error["error"]["code"] == "server_busy" and error["error"]["retryable"] is True
    admission = client.server.app[STATE].admission
    assert admission.in_flight == 0 and admission.queued == 0
    metrics = await (await client.get("/metrics")).text()
    assert 'arbiter_rejected_total{reason="queue_full"} 1.0' in metrics


async def test_a_cancelled_waiting_client_leaves_the_queue(make: Any) -> None:
    engine = FakeEngine(delay_s=0.8)
    client = await make(engine, max_in_flight=1, max_queue=1)
    first = asyncio.ensure_future(
        client.post("/invocations", json={"decision": decision_body("a")})
    )
    await asyncio.to_thread(engine.started.wait, 5)
    with pytest.raises(asyncio.TimeoutError):
        await client.post(
            "/invocations", json={"decision": decision_body("b")}, timeout=ClientTimeout(total=0.2)
        )
    admission = client.server.app[STATE].admission
    for _ in range(50):
        if admission.queued == 0:
            break
        await asyncio.sleep(0.01)
    assert admission.queued == 0
    # The queue has room again: this one waits and is served instead of getting a 503.
    third = await client.post("/invocations", json={"decision": decision_body("c")})
    assert third.status == 200
    assert (await first).status == 200
    assert engine.calls == 2  # the cancelled one never reached the engine


async def test_custom_attributes_echo_and_request_id_in_logs(make: Any) -> None:
    client = await make()
    with capture_logs(processors=[merge_contextvars]) as logs:
        response = await client.post(
            "/invocations",
            json={"decision": decision_body()},
            headers={"X-Amzn-SageMaker-Custom-Attributes": "trace=9,request_id=req-42"},
        )
    assert response.headers["X-Amzn-SageMaker-Custom-Attributes"] == "trace=9,request_id=req-42"
    assert response.headers["X-Request-Id"] == "req-42"
    line = next(e for e in logs if e["event"] == "request")
    assert line["request_id"] == "req-42" and line["route"] == "/invocations"
    assert line["status"] == 200 and line["decisions"] == 1 and line["tokens"] == 10
    assert "state" not in json.dumps(line)  # no state text or prompts in logs
    plain = await client.get("/ping")
    assert "X-Amzn-SageMaker-Custom-Attributes" not in plain.headers
    assert len(plain.headers["X-Request-Id"]) == 32


async def test_every_error_answer_passes_the_one_error_middleware(make: Any) -> None:
    """System One's own 401 and 422 bodies (FastAPI's shape) are answered, counted and logged with
    their code by the same middleware as every other error: none is written by a handler."""
    client = await make(api_key="k")
    with capture_logs() as logs:
        missing_key = await client.post("/v1/systemone", json={})
        invalid = await client.post(
            "/v1/systemone", json={"state": "s"}, headers={"Authorization": "Bearer k"}
        )
        not_json = await client.post(
            "/v1/systemone",
            data=b"{",
            headers={"Authorization": "Bearer k", "Content-Type": "application/json"},
        )
        other_401 = await client.post("/invocations", json={"decision": decision_body()})
    assert missing_key.status == 401 and missing_key.headers["WWW-Authenticate"] == "Bearer"
    assert "API key" in (await missing_key.json())["detail"]
    assert invalid.status == 422 and (await invalid.json())["detail"][0]["loc"][0] == "body"
    assert not_json.status == 422
    assert (await not_json.json())["detail"][0]["type"] == "json_invalid"
    assert (await error_of(other_401, 401))["code"] == "invalid_api_key"
    lines = [e for e in logs if e["event"] == "request"]
    assert [(e["status"], e.get("error")) for e in lines] == [
        (401, "invalid_api_key"),
        (422, "validation_error"),
        (422, "validation_error"),
        (401, "invalid_api_key"),
    ]


async def test_execution_parameters_models_and_openapi(make: Any) -> None:
    client = await make(max_in_flight=2, batch_max_payload_mb=6)
    params = await (await client.get("/execution-parameters")).json()
    assert params == {
        "MaxConcurrentTransforms": 2,
        "BatchStrategy": "MULTI_RECORD",
        "MaxPayloadInMB": 6,
    }
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "fake.gguf"
    doc = await (await client.get("/openapi.json")).json()
    routes = {
        (r.method.lower(), r.resource.canonical)
        for r in client.server.app.router.routes()
        if r.method != "HEAD"
    }
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented


async def test_jsonlines_streamed_in_chunks_one_line_out_per_line_in(make: Any) -> None:
    client = await make(jsonl_chunk=2, max_body_mb=0.001)
    lines = [
        json.dumps(decision_body("a")),
        "{not json",
        "",
        json.dumps(decision_body("b", options=5)),
        json.dumps({**decision_body("c"), "state": "y" * 2000}),  # over the 1 kB line limit here
        json.dumps(decision_body("d")),
    ]
    payload = ("\n".join(lines)).encode()

    async def chunks() -> Any:
        for start in range(0, len(payload), 37):  # record boundaries fall mid-chunk
            yield payload[start : start + 37]

    response = await client.post(
        "/invocations", data=chunks(), headers={"Content-Type": "application/jsonlines"}
    )
    assert response.status == 200
    assert response.headers["Content-Type"] == "application/jsonlines"
    out = [json.loads(line) for line in (await response.text()).splitlines()]
    assert [o["line"] for o in out] == [1, 2, 4, 5, 6]
    assert [o["id"] for o in out] == ["a", None, "b", None, "d"]
    assert "result" in out[0] and out[1]["error"]["code"] == "invalid_json"
    assert out[2]["error"]["code"] == "too_many_options"
    assert out[3]["error"]["code"] == "payload_too_large"


async def test_chat_completion_and_stream_shapes(make: Any) -> None:
    client = await make()
    messages = [{"role": "user", "content": "hi"}]
    plain = await (
        await client.post("/invocations", json={"messages": messages, "max_tokens": 2})
    ).json()
    assert plain["object"] == "chat.completion"
    assert plain["choices"][0]["message"]["content"] == "Hello there"
    assert plain["choices"][0]["finish_reason"] == "length"
    streamed = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    events = [e[len("data: ") :] for e in (await streamed.text()).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello there!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_metrics_after_requests(make: Any) -> None:
    client = await make()
    await client.post("/invocations", json={"decisions": [decision_body("a"), decision_body("b")]})
    await client.post("/invocations", data=b"{", headers={"Content-Type": "application/json"})
    text = await (await client.get("/metrics")).text()
    for needle in (
        'arbiter_requests_total{kind="decisions",route="/invocations",status="200"} 1.0',
        'arbiter_requests_total{kind="-",route="/invocations",status="400"} 1.0',
        'arbiter_decisions_total{outcome="ok"} 2.0',
        "arbiter_decision_seconds_count 2.0",
        "arbiter_prefill_seconds_count 2.0",
        "arbiter_prompt_tokens_sum 20.0",
        "arbiter_prefix_tokens_total 8.0",
        "arbiter_in_flight 0.0",
        "arbiter_queued 0.0",
        "arbiter_model_ready 1.0",
        'arbiter_model_info{architecture="fake"',
        'arbiter_request_seconds_bucket{kind="decisions"',
    ):
        assert needle in text, needle
