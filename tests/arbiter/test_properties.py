"""Generated hostile input against the wire models, the engine and the JSON Lines stream.

The properties: any JSON (or any bytes) is either a valid request or a typed 4xx error, never an
exception of another kind; a valid decision is always scored or refused with its own typed error,
never raises, and its probabilities are finite and sum to 1; a JSON Lines body gets exactly one
output record per non-blank input line, in order, whatever a line holds and however the body is
split on the wire. ``make fuzz`` runs the same properties with many more examples.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from adapter import chat
from adapter.app import create_app
from arbiter import jsonio, systemone
from arbiter import prompt as prompts
from arbiter.engine import Engine, open_engine
from arbiter.errors import ArbiterError
from arbiter.lines import parse_decision_line
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.settings import ServerSettings
from tests.fakes import FakeEngine
from tests.live_server import serve
from tests.strategies import (
    anything,
    bombs,
    decision_like,
    encode,
    examples,
    json_values,
    jsonl_line,
    text,
    valid_decision,
)
from tests.threads import TEST_THREADS

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def budget(n: int) -> settings:
    """``n`` examples (times ARBITER_FUZZ_SCALE), no per-example deadline: the machine is shared."""
    return settings(
        max_examples=examples(n),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def _all_text_encodes(request: DecisionRequest) -> None:
    for value in (request.id, request.question, *(o.id for o in request.options)):
        value.encode("utf-8")
    for o in request.options:
        o.description.encode("utf-8")
    prompts.state_text(request.state).encode("utf-8")


# -- the wire models -----------------------------------------------------------------------------


@budget(300)
@given(st.one_of(decision_like.map(encode), anything.map(encode), bombs))
def test_any_json_is_a_decision_or_a_typed_4xx(line: bytes) -> None:
    try:
        request = parse_decision_line(line)
    except ArbiterError as exc:
        assert 400 <= exc.status < 500, exc
        exc.to_dict()  # serializable
        return
    _all_text_encodes(request)
    if request.temperature is not None:
        assert 0.01 <= request.temperature <= 100


@budget(200)
@given(st.binary(max_size=200))
def test_any_bytes_are_json_or_a_typed_400(data: bytes) -> None:
    try:
        jsonio.loads(data)
    except ArbiterError as exc:
        assert exc.status == 400 and exc.code == "invalid_json"


@budget(200)
@given(anything)
def test_any_json_is_written_back_as_utf8_json(value: Any) -> None:
    data = jsonio.dumps({"id": value})
    assert len(data.decode("utf-8").splitlines()) == 1  # one line for any line splitter
    assert isinstance(json.loads(data), dict)


chat_like = st.fixed_dictionaries(
    {
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.one_of(st.sampled_from(["user", "system", "assistant"]), text),
                        "content": st.one_of(
                            text,
                            st.lists(
                                st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                max_size=3,
                            ),
                            anything,
                        ),
                    }
                ),
                max_size=6,
            ),
            anything,
        )
    },
    optional={
        "temperature": anything,
        "top_p": anything,
        "seed": st.one_of(st.integers(), anything),
        "stop": st.one_of(text, st.lists(text, max_size=5), anything),
        "max_tokens": anything,
        "n": anything,
    },
)


@budget(200)
@given(chat_like)
def test_any_chat_body_is_a_request_or_a_validation_error(value: dict[str, Any]) -> None:
    try:
        request = chat.ChatCompletionRequest.model_validate(value)
    except ValidationError:
        return
    for template in (CHATML, None):
        try:
            segments = chat.render(request.messages, template, "<s>", "</s>")
        except ArbiterError as exc:
            assert exc.status == 422
            continue
        for piece, _ in segments:
            piece.encode("utf-8")
    if request.seed is not None:
        assert -(2**63) <= request.seed < 2**64


systemone_like = st.fixed_dictionaries(
    {
        "model": st.one_of(st.sampled_from(["default", "jev-latest"]), text, anything),
        "state": st.one_of(text, json_values, anything),
        "questions": st.one_of(
            st.dictionaries(
                text,
                st.one_of(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["noul", "choice", "score"])},
                        optional={"instructions": anything, "criteria": anything},
                    ),
                    anything,
                ),
                max_size=4,
            ),
            anything,
        ),
    }
)


@budget(200)
@given(systemone_like)
def test_any_system_one_body_is_decisions_or_a_422(value: dict[str, Any]) -> None:
    try:
        request = systemone.parse_request(value)
        decisions = systemone.to_decisions(request)
    except systemone.SystemOneInvalid as exc:
        assert exc.status == 422 and exc.detail
        return
    for d in decisions:
        _all_text_encodes(d)


# -- the real engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_engine(default_gguf: Any) -> Iterator[Engine]:
    from arbiter.settings import EngineSettings

    eng = open_engine(EngineSettings(model=default_gguf, n_ctx=512, n_threads=TEST_THREADS))
    yield eng
    eng.close()


@budget(8)
@given(st.lists(valid_decision, min_size=1, max_size=2))
def test_valid_decisions_are_scored_or_refused_one_by_one(
    small_engine: Engine, raw: list[dict[str, Any]]
) -> None:
    requests = []
    for i, item in enumerate(raw):
        with contextlib.suppress(ValidationError):
            requests.append(DecisionRequest.model_validate({**item, "id": f"{i}-{item['id']}"}))
    if not requests:
        return
    outcomes = small_engine.score(requests)
    assert len(outcomes) == len(requests)
    for request, outcome in zip(requests, outcomes, strict=True):
        if isinstance(outcome, ArbiterError):
            assert outcome.status == 422, outcome  # too long for the context, too many options
            continue
        assert isinstance(outcome, DecisionResult) and outcome.id == request.id
        assert all(math.isfinite(p) for p in outcome.probabilities)
        assert math.isclose(sum(outcome.probabilities), 1.0, abs_tol=1e-6)
        assert outcome.choice in {o.id for o in request.options}


# -- JSON Lines stream integrity over HTTP ---------------------------------------------------------


@pytest.fixture(scope="module")
def lines_server() -> Iterator[str]:
    settings_ = ServerSettings(
        max_in_flight=1, max_queue=4, jsonl_chunk=3, max_body_mb=0.002, body_read_timeout_s=10
    )
    with serve(create_app(settings_, lambda: FakeEngine())) as base:  # type: ignore[arg-type,return-value]
        yield base


def _post_chunked(base: str, body: bytes, cuts: list[int]) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    pieces = [body[a:b] for a, b in itertools.pairwise(points) if b > a]
    try:
        conn.request(
            "POST",
            "/invocations",
            body=iter(pieces),
            headers={"Content-Type": "application/jsonlines"},
            encode_chunked=True,
        )
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@budget(40)
@given(
    st.lists(jsonl_line, max_size=12),
    st.lists(st.integers(min_value=0, max_value=10**6), max_size=6),
    st.sampled_from([b"\n", b"\r\n"]),
    st.booleans(),
)
def test_every_jsonlines_input_line_gets_one_record_in_order(
    lines_server: str, lines: list[bytes], cuts: list[int], newline: bytes, trailing: bool
) -> None:
    body = newline.join(lines) + (newline if trailing else b"")
    status, data = _post_chunked(lines_server, body, cuts)
    assert status == 200, data[:500]
    records = [json.loads(line) for line in data.decode("utf-8").splitlines()]
    nonblank = [i + 1 for i, line in enumerate(body.split(b"\n")) if line.strip()]
    assert [r["line"] for r in records] == nonblank
    for record in records:
        assert ("result" in record) != ("error" in record)
        if "error" in record:
            assert 400 <= _status_of(record["error"]["code"]) < 500, record
    health = http.client.HTTPConnection(*lines_server.removeprefix("http://").split(":"))
    health.request("GET", "/ping")
    assert health.getresponse().status == 200
    health.close()


def _status_of(code: str) -> int:
    """The HTTP status class of an error code a JSON Lines record may carry."""
    return {"engine_failure": 500, "internal_error": 500}.get(code, 422)
