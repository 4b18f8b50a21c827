"""The HTTP adapter under hostile clients: broken streams, bombs, stalls, missing keys and headers.

A fake engine keeps these fast; the real engine's side is in test_engine_faults.py and the generated
suites (test_properties.py, test_schemathesis.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from adapter import chat
from adapter.state import STATE
from arbiter.errors import ArbiterError
from arbiter.schema import DecisionRequest, DecisionResult
from tests.adapter.conftest import error_of
from tests.fakes import FakeEngine, decision_body

pytestmark = pytest.mark.asyncio(loop_scope="session")

JSONL = {"Content-Type": "application/jsonlines"}
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class FailingEngine(FakeEngine):
    """Raises an unexpected exception on the ``fail_on``-th call to score or generate."""

    def __init__(self, fail_on: int = 2, **kw: Any) -> None:
        super().__init__(**kw)
        self.fail_on = fail_on

    def score(
        self, decisions: Sequence[DecisionRequest], budget: Any = None
    ) -> list[DecisionResult | ArbiterError]:
        if self.calls + 1 == self.fail_on:
            self.calls += 1
            raise RuntimeError("simulated fault inside the engine")
        return super().score(decisions, budget)

    def generate(self, tokens: Any, *, max_tokens: int, on_delta: Any = None, **kw: Any) -> Any:
        if on_delta is not None:
            on_delta(0, "Hello", None)
        raise RuntimeError("simulated fault while generating")


def jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


# A stream whose end is never written would hang until pytest's timeout: every read of a streamed
# body is bounded, so a broken in-band path fails in seconds and says so.
STREAM_S = 20


async def text_of(response: Any) -> str:
    """The whole body of a streamed response, which must end (cleanly) within ``STREAM_S``."""
    try:
        async with asyncio.timeout(STREAM_S):
            return str(await response.text())
    except TimeoutError:
        pytest.fail(f"the stream did not end within {STREAM_S} s (no clean end was written)")


async def records(response: Any) -> list[dict[str, Any]]:
    assert response.status == 200, await text_of(response)
    return [json.loads(line) for line in (await text_of(response)).splitlines()]


# -- 9: an error after a stream started is written in-band, and the stream ends cleanly -----------


async def test_a_fault_mid_stream_is_an_error_line_per_input_line(make: Any) -> None:
    client = await make(FailingEngine(fail_on=2), jsonl_chunk=2)
    lines = [json.dumps(decision_body(f"d{i}")) for i in range(6)]
    out = await records(await client.post("/invocations", data=jsonl(lines), headers=JSONL))
    assert [o["line"] for o in out] == [1, 2, 3, 4, 5, 6]
    assert ["result" in o for o in out] == [True, True, False, False, True, True]
    assert out[2]["error"]["code"] == "engine_failure" and out[2]["id"] == "d2"


async def test_a_fault_outside_any_decision_makes_each_line_of_its_chunk_an_error(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault that escapes the scoring of a chunk (here: its metrics) fails that chunk's lines
    one by one, and the stream goes on (``jsonlines.score_chunk``)."""
    client = await make(jsonl_chunk=2)
    metrics = client.server.app[STATE].metrics
    observe = metrics.observe_decision
    seen = 0

    def flaky(outcome: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == 3:
            raise RuntimeError("simulated fault outside the engine")
        observe(outcome)

    monkeypatch.setattr(metrics, "observe_decision", flaky)
    lines = [json.dumps(decision_body(f"d{i}")) for i in range(6)]
    out = await records(await client.post("/invocations", data=jsonl(lines), headers=JSONL))
    assert [o["line"] for o in out] == [1, 2, 3, 4, 5, 6]
    assert ["result" in o for o in out] == [True, True, False, False, True, True]
    assert {o["error"]["code"] for o in out[2:4]} == {"engine_failure"}


async def test_a_fault_after_a_jsonl_stream_started_ends_it_with_one_error_record(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anything that escapes the handler once lines were sent is written in-band: each line of the
    chunk in hand gets its error record (they were read; they used to be lost), then the error
    middleware writes one last record for the next line and a clean end (no second status
    line)."""
    from adapter import jsonlines

    client = await make(jsonl_chunk=2)
    score_chunk = jsonlines.score_chunk
    calls = 0

    def failing(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("simulated fault between chunks")
        return score_chunk(*args)

    monkeypatch.setattr(jsonlines, "score_chunk", failing)
    lines = [json.dumps(decision_body(f"d{i}")) for i in range(6)]
    response = await client.post("/invocations", data=jsonl(lines), headers=JSONL)
    text = await text_of(response)
    assert "HTTP/1.1" not in text
    out = [json.loads(line) for line in text.splitlines()]
    assert [o["line"] for o in out] == [1, 2, 3, 4, 5]
    assert "result" in out[0] and "result" in out[1]
    assert all(o["id"] is None and o["error"]["code"] == "internal_error" for o in out[2:])


async def test_a_client_that_stalls_mid_stream_gets_its_lines_then_the_timeout(make: Any) -> None:
    """Lines read before a stall are answered first, then one ``body_read_timeout`` record
    (``LinesResponse``'s own in-band path: without it the lines were lost in a bare 408)."""
    client = await make(jsonl_chunk=100, body_read_timeout_s=0.5)
    release = asyncio.Event()
    lines = jsonl([json.dumps(decision_body(f"d{i}")) for i in range(3)])

    async def stalled() -> Any:
        yield lines
        await release.wait()

    response = await client.post("/invocations", data=stalled(), headers=JSONL)
    out = await records(response)
    release.set()
    assert [o["line"] for o in out] == [1, 2, 3, 4]
    assert all("result" in o for o in out[:3])
    assert out[3]["error"]["code"] == "body_read_timeout"


async def test_sixteen_good_lines_then_a_bracket_bomb(make: Any) -> None:
    """The issue's reproduction: a line of 5,000 '[' raised RecursionError mid-stream."""
    client = await make(jsonl_chunk=4)
    lines = [json.dumps(decision_body(f"d{i}")) for i in range(16)] + ["[" * 5000]
    out = await records(await client.post("/invocations", data=jsonl(lines), headers=JSONL))
    assert len(out) == 17 and all("result" in o for o in out[:16])
    assert out[16]["line"] == 17 and out[16]["error"]["code"] == "invalid_json"
    assert "nested too deeply" in out[16]["error"]["message"]


async def test_a_fault_mid_sse_stream_is_an_error_event_then_done(make: Any) -> None:
    client = await make(FailingEngine())
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert response.status == 200
    events = [e.removeprefix("data: ") for e in (await text_of(response)).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[1]["choices"][0]["delta"]["content"] == "Hello"
    assert payloads[-1]["error"]["code"] == "internal_error"
    assert all(not e.startswith("HTTP/1.1") for e in events)


# -- 10: deep nesting and huge numbers are malformed JSON, everywhere -----------------------------

BOMBS = {
    "deep array": b"[" * 100_000,
    "deep object": b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    "huge integer": b'{"decision": {"id": "x", "temperature": ' + b"9" * 5_000 + b"}}",
    "NaN": b'{"decision": {"id": "x", "temperature": NaN}}',
    "not UTF-8": b'{"decision": "\xff\xfe"}',
}


@pytest.mark.parametrize("body", BOMBS.values(), ids=BOMBS.keys())
async def test_json_bombs_are_400_on_every_json_route(make: Any, body: bytes) -> None:
    client = await make()
    json_headers = {"Content-Type": "application/json"}
    for path in ("/invocations", "/v1/chat/completions"):
        error = await error_of(await client.post(path, data=body, headers=json_headers), 400)
        assert error["code"] == "invalid_json"
    systemone = await client.post("/v1/systemone", data=body, headers=json_headers)
    assert systemone.status == 422  # the System One API's (FastAPI's) status for bad JSON
    assert (await systemone.json())["detail"][0]["type"] == "json_invalid"
    out = await records(await client.post("/invocations", data=body + b"\n", headers=JSONL))
    assert len(out) == 1 and out[0]["error"]["code"] == "invalid_json"
    assert (await client.get("/ping")).status == 200


async def test_hostile_ids_are_echoed_safely_or_not_at_all(make: Any) -> None:
    client = await make()
    lines = [
        json.dumps({"id": "\ud800", "state": "s"}),  # a lone surrogate, escaped by json.dumps
        json.dumps({"id": [[[[1]]]], "state": "s"}),
        json.dumps({**decision_body("ok"), "question": "x\udfffy"}),
    ]
    out = await records(await client.post("/invocations", data=jsonl(lines), headers=JSONL))
    assert [o["line"] for o in out] == [1, 2, 3]
    assert out[0]["id"] == "\ud800" and out[1]["id"] is None and out[2]["id"] == "ok"
    assert out[2]["error"]["param"] == "question"
    assert "unicode" in out[2]["error"]["message"].lower()


# -- 11: a slow uploader never holds the compute slot ---------------------------------------------


async def test_a_stalled_jsonlines_upload_does_not_block_other_requests(make: Any) -> None:
    client = await make(max_in_flight=1, max_queue=0, queue_timeout_s=1, body_read_timeout_s=1.0)
    release = asyncio.Event()

    async def stalled() -> Any:
        yield b'{"id":'  # 7 bytes, then nothing
        await release.wait()

    upload = asyncio.ensure_future(client.post("/invocations", data=stalled(), headers=JSONL))
    await asyncio.sleep(0.3)
    other = await client.post("/invocations", json={"decision": decision_body()})
    assert other.status == 200, await other.text()
    response = await upload
    release.set()
    error = await error_of(response, 408)
    assert error["code"] == "body_read_timeout"
    admission = client.server.app[STATE].admission
    assert admission.in_flight == 0


async def test_a_stalled_json_body_times_out(make: Any) -> None:
    client = await make(body_read_timeout_s=0.5)
    release = asyncio.Event()

    async def stalled() -> Any:
        yield b'{"decision": '
        await release.wait()

    response = await client.post(
        "/invocations", data=stalled(), headers={"Content-Type": "application/json"}
    )
    release.set()
    assert (await error_of(response, 408))["code"] == "body_read_timeout"


# -- 12: chat rendering stays off the event loop, and is capped ----------------------------------


async def test_chat_rendering_runs_off_the_event_loop(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = FakeEngine()
    engine.chat_template = CHATML  # type: ignore[misc]
    client = await make(engine)
    threads: list[str] = []
    render = chat.render

    def spy(*args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return render(*args, **kw)

    monkeypatch.setattr(chat, "render", spy)
    messages = [{"role": "user", "content": f"m{i}"} for i in range(100)]
    response = await client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status == 200, await response.text()
    assert threads and threading.main_thread().name not in threads


async def test_too_many_chat_messages_are_refused(make: Any) -> None:
    client = await make()
    messages = [{"role": "user", "content": "x"}] * (chat.MAX_MESSAGES + 1)
    response = await client.post("/invocations", json={"messages": messages})
    error = await error_of(response, 422)
    assert error["param"] == "messages" and str(chat.MAX_MESSAGES) in error["message"]


@pytest.mark.asyncio(loop_scope="session")
async def test_chat_template_placement_is_checked_for_every_message() -> None:
    messages = [
        chat.ChatMessage(role="user", content=f"text {i}") for i in range(chat.MAX_MESSAGES)
    ]
    segments = chat.render(messages, CHATML, "<s>", "</s>")
    user_text = [t for t, template in segments if not template]
    assert user_text == [f"text {i}" for i in range(chat.MAX_MESSAGES)]
    dropping = "{% for message in messages[1:] %}{{ message['content'] }}{% endfor %}"
    with pytest.raises(ArbiterError, match="exactly once"):
        chat.render(messages[:3], dropping, "<s>", "</s>")
    doubling = "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ArbiterError, match="exactly once"):
        chat.render(messages[:3], doubling, "<s>", "</s>")


# -- 13, 14: the API key guards every compute route; any token is compared safely ---------------

KEY = "s3cret"


async def test_the_api_key_guards_invocations_too(make: Any) -> None:
    client = await make(api_key=KEY)
    systemone_body = {"model": "default", "state": "s", "questions": {"q": {"type": "noul"}}}
    chat_body = {"messages": [{"role": "user", "content": "hi"}]}
    for body in ({"decision": decision_body()}, chat_body, systemone_body):
        bare = await client.post("/invocations", json=body)
        error = await error_of(bare, 401)
        assert error["code"] == "invalid_api_key" and bare.headers["WWW-Authenticate"] == "Bearer"
    lines = await client.post(
        "/invocations", data=jsonl([json.dumps(decision_body())]), headers=JSONL
    )
    assert lines.status == 401
    assert (await client.post("/v1/chat/completions", json=chat_body)).status == 401
    assert (await client.post("/v1/systemone", json=systemone_body)).status == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = await client.post("/invocations", json={"decision": decision_body()}, headers=auth)
    assert ok.status == 200
    assert (await client.get("/ping")).status == 200  # health stays open


async def test_sagemaker_opt_out_leaves_invocations_to_iam(make: Any) -> None:
    client = await make(api_key=KEY, api_key_exempt_invocations=True)
    assert (await client.post("/invocations", json={"decision": decision_body()})).status == 200
    chat_body = {"messages": [{"role": "user", "content": "hi"}]}
    assert (await client.post("/v1/chat/completions", json=chat_body)).status == 401


@pytest.mark.parametrize("token", ["café", "ключ", "\u00ff" * 40, KEY + "é"])
async def test_a_non_ascii_bearer_token_is_401_not_500(make: Any, token: str) -> None:
    client = await make(api_key=KEY)
    response = await client.post(
        "/invocations",
        json={"decision": decision_body()},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status == 401


async def test_a_non_ascii_key_matches_itself(make: Any) -> None:
    client = await make(api_key="clé")
    response = await client.post(
        "/invocations", json={"decision": decision_body()}, headers={"Authorization": "Bearer clé"}
    )
    assert response.status == 200, await response.text()


# -- 15: the body's type must be declared --------------------------------------------------------


async def test_a_post_without_content_type_is_415(make: Any) -> None:
    client = await make()
    body = json.dumps({"decision": decision_body()}).encode()
    for path in ("/invocations", "/v1/chat/completions", "/v1/systemone"):
        response = await client.post(path, data=body, skip_auto_headers=["Content-Type"])
        error = await error_of(response, 415)
        assert error["param"] == "Content-Type"
    for simple in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        response = await client.post("/invocations", data=body, headers={"Content-Type": simple})
        assert response.status == 415


# -- 16: the JSON Lines body limit: every line read gets its output line first -------------------


async def test_lines_read_before_the_body_limit_still_get_their_output(make: Any) -> None:
    client = await make(jsonl_chunk=100, max_jsonl_mb=2000 / 2**20)
    short = {"state": "The printer is on fire.", "question": "What now?", "options": 2}
    lines = [json.dumps(decision_body(f"d{i}", **short)) for i in range(40)]  # ~150 bytes each
    payload = jsonl(lines)

    async def chunks() -> Any:
        for start in range(0, len(payload), 100):
            yield payload[start : start + 100]

    out = await records(await client.post("/invocations", data=chunks(), headers=JSONL))
    assert len(out) >= 10
    assert [o["line"] for o in out] == list(range(1, len(out) + 1))
    assert all("result" in o for o in out[:-1])
    assert out[-1]["error"]["code"] == "payload_too_large"


# -- Batch Transform: the advertised payload fits the invocation timeout --------------------------


async def test_execution_parameters_size_the_payload_to_the_timeout(make: Any) -> None:
    slow = await make(FakeEngine(delay_s=0.2), batch_invocation_timeout_s=600)
    params = await (await slow.get("/execution-parameters")).json()
    assert params["BatchStrategy"] == "MULTI_RECORD"
    # One ~1 kB probe line per 0.2 s engine call: ~200 s per MB, so 600 s x 0.5 fits 1 MB.
    assert params["MaxPayloadInMB"] == 1
    # An instant engine is bounded by the protocol's 100 MB (not by a measurement a loaded machine
    # can slow down): at 0.01 s per probe line it would still offer far more than 1 MB.
    fast = await make(FakeEngine(delay_s=0.01))
    fast_mb = (await (await fast.get("/execution-parameters")).json())["MaxPayloadInMB"]
    assert 1 < fast_mb <= 100
    configured = await make(FakeEngine(delay_s=0.2), batch_max_payload_mb=6)
    assert (await (await configured.get("/execution-parameters")).json())["MaxPayloadInMB"] == 6


async def test_execution_parameters_size_the_payload_to_the_timeout_asked_for(make: Any) -> None:
    """``?InvocationsTimeoutInSeconds=`` (what `arbiter transform` sends for its job) sizes the
    payload to that timeout, from the one measurement; a bad value is a 400 naming it."""
    slow = await make(FakeEngine(delay_s=0.2), batch_invocation_timeout_s=600)
    path = "/execution-parameters?InvocationsTimeoutInSeconds="
    job_1h = (await (await slow.get(path + "3600")).json())["MaxPayloadInMB"]
    default = (await (await slow.get("/execution-parameters")).json())["MaxPayloadInMB"]
    job_10m = (await (await slow.get(path + "600")).json())["MaxPayloadInMB"]
    # ~200 s per MB: 1 MB fits 600 s x 0.5, about 9 MB 3,600 s x 0.5 (more than 1 unless the
    # probe ran over 4 times slower than its sleeps).
    assert default == job_10m == 1 and job_1h > 1, (default, job_10m, job_1h)
    for bad in ("0", "3601", "1.5", "x"):
        refused = await slow.get(path + bad)
        assert refused.status == 400
        assert (await refused.json())["error"]["param"] == "InvocationsTimeoutInSeconds"
