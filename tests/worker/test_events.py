"""Unit tests of the worker's pure parts: event parsing, policies, settings, streaming readers."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from arbiter.errors import ArbiterError
from arbiter.schema import DecisionRequest
from tests.fakes import decision_line
from worker.events import Ignored, JobRef, UnreadableMessage, parse_message
from worker.formats import items_for
from worker.outputs import output_keys
from worker.policies import DrainDeadline, ExponentialBackoff
from worker.settings import WorkerSettings
from worker.tries import Receive, Tries

BUCKET = "jobs"


def s3_event(key: str, etag: str = "abc", name: str = "ObjectCreated:Put", bucket: str = BUCKET):
    """The body moto (and S3) sends, key URL-encoded as S3 does."""
    return json.dumps(
        {
            "Records": [
                {
                    "eventVersion": "2.1",
                    "eventSource": "aws:s3",
                    "awsRegion": "us-east-1",
                    "eventName": name,
                    "s3": {
                        "s3SchemaVersion": "1.0",
                        "bucket": {"name": bucket, "arn": f"arn:aws:s3:::{bucket}"},
                        "object": {"key": key, "size": 8, "eTag": etag},
                    },
                }
            ]
        }
    )


def parse(body: str) -> list[JobRef | Ignored]:
    return parse_message(body, bucket=BUCKET, input_prefix="incoming/")


def test_url_encoded_key_is_decoded_plus_is_space() -> None:
    # "incoming/my file+x.jsonl" as moto encodes it (quote_plus: '/' too); S3 keeps '/'.
    for encoded in ("incoming%2Fmy+file%2Bx.jsonl", "incoming/my+file%2Bx.jsonl"):
        [ref] = parse(s3_event(encoded, etag="4588ff"))
        assert ref == JobRef(BUCKET, "incoming/my file+x.jsonl", "4588ff", None, 8)


def test_quoted_etag_is_normalized() -> None:
    [ref] = parse(s3_event("incoming/a.jsonl", etag='"abc"'))
    assert isinstance(ref, JobRef) and ref.etag == "abc"


def test_s3_test_event_is_ignored() -> None:
    body = json.dumps(
        {"Service": "Amazon S3", "Event": "s3:TestEvent", "Time": "x", "Bucket": BUCKET}
    )
    [entry] = parse(body)
    assert isinstance(entry, Ignored) and entry.reason == "s3:TestEvent"


@pytest.mark.parametrize(
    ("key", "bucket", "name", "why"),
    [
        ("other/a.jsonl", BUCKET, "ObjectCreated:Put", "outside the input prefix"),
        ("incomingx/a.jsonl", BUCKET, "ObjectCreated:Put", "outside the input prefix"),
        ("incoming/a.csv", BUCKET, "ObjectCreated:Put", "not a job file"),
        ("incoming/a.jsonl", "elsewhere", "ObjectCreated:Put", "not the job bucket"),
        ("incoming/a.jsonl", BUCKET, "ObjectRemoved:Delete", "not an object creation"),
    ],
)
def test_events_outside_the_job_space_are_ignored(key, bucket, name, why) -> None:
    [entry] = parse(s3_event(key, name=name, bucket=bucket))
    assert isinstance(entry, Ignored) and why in entry.reason


def test_direct_message_is_accepted_literally() -> None:
    [ref] = parse(json.dumps({"bucket": BUCKET, "key": "incoming/a+b.json.gz"}))
    assert ref == JobRef(BUCKET, "incoming/a+b.json.gz")


@pytest.mark.parametrize(
    "body", ["not json", "[1, 2]", json.dumps({"Records": []}), json.dumps({"bucket": BUCKET})]
)
def test_unreadable_messages_raise(body: str) -> None:
    with pytest.raises(UnreadableMessage):
        parse(body)


def test_backoff_doubles_from_the_receive_count_and_is_capped() -> None:
    policy = ExponentialBackoff(base_s=2, maximum_s=20)
    assert [policy.delay(n) for n in (0, 1, 2, 3, 4, 5, 50)] == [2, 2, 4, 8, 16, 20, 20]


def test_drain_deadline_counts_down_from_the_first_stop() -> None:
    drain = DrainDeadline(10)
    assert not drain.draining and drain.remaining() == float("inf")
    drain.start(now=100.0)
    drain.start(now=105.0)  # a second SIGTERM does not extend it
    assert drain.draining and drain.remaining(now=104.0) == 6.0
    assert drain.remaining(now=200.0) == 0.0


def test_the_last_try_and_past_it_follow_the_redrive_margin() -> None:
    tries = Tries(own=5, redrive=8)
    assert tries.limit == 5 and not tries.too_tight
    assert tries.last(5) and tries.last(6) and not tries.last(4)
    assert tries.past(6) and not tries.past(5)
    tight = Tries(own=5, redrive=4)  # a queue whose redrive would beat the worker's last look
    assert tight.limit == 1 and tight.too_tight
    assert Tries(own=3).limit == 3


def test_a_released_receive_is_not_counted_and_an_outage_is_carried() -> None:
    tries = Tries(own=5, backoff=ExponentialBackoff(2, 300), max_outage_s=100, lag_s=10)
    message = {"Attributes": {"ApproximateReceiveCount": "3"}, "MessageAttributes": {}}
    first = Receive.of(message)
    assert first == Receive(count=3, raw=3)
    carried = tries.carried(first, outage=True, now=1000.0)
    again = Receive.of(
        {"Attributes": {"ApproximateReceiveCount": "1"}, "MessageAttributes": carried}
    )
    assert again.count == 3 and again.outages == 1 and again.outage_last == 1000.0
    assert tries.outage_delay(again) == 4 and tries.retry_delay(again) == 8
    # given back after 2 s, met the outage again 5 s later: 5 s of outage
    assert tries.outage_s(again, now=1005.0) == 5.0
    look = tries.carried(again, last_look=True)
    assert Receive.of({"MessageAttributes": look}).last_look
    assert Receive.of(
        {"MessageAttributes": tries.carried(Receive.of({"MessageAttributes": look}))}
    ).last_look
    # a drain release carries the count alone
    assert set(tries.carried(first)) == {"ArbiterFailedReceives"}


def _carried(tries: Tries, receive: Receive, now: float) -> Receive:
    return Receive.of({"MessageAttributes": tries.carried(receive, outage=True, now=now)})


def test_the_outage_clock_measures_the_outage_not_the_wait() -> None:
    """Issue 36: a message that met one 503 burst, then waited in a backlog longer than the outage
    limit, was given up at the next burst on a healthy store. Each gap between two faults counts
    up to the delay the message was given back with plus the lag of a free worker."""
    tries = Tries(own=5, backoff=ExponentialBackoff(2, 300), max_outage_s=20, lag_s=3)
    burst = _carried(tries, Receive(count=1), now=0.0)  # a 503 burst, given back for 2 s
    assert not tries.outage_over(burst, now=25.0)  # 25 s later, after a backlog: 5 s of outage
    assert tries.outage_s(burst, now=25.0) == 5.0
    steady, now = burst, 0.0
    for _ in range(3):  # a partial outage that goes on: each fault soon after its delay
        now += tries.outage_delay(steady) / 2 + 1
        steady = _carried(tries, steady, now)
    assert steady.outage_s == now == 17.0 and not tries.outage_over(steady, now=now)
    assert tries.outage_over(steady, now=now + 4)  # the next fault makes it 21 s: given up
    old = Receive.of({"MessageAttributes": {"ArbiterOutageSince": {"StringValue": "100"}}})
    assert old.outage_last == 100.0  # a copy given back before issue 36: its clock restarts


def test_overlapping_prefixes_are_refused() -> None:
    with pytest.raises(ValidationError, match="overlap"):
        WorkerSettings(input_prefix="jobs/", output_prefix="jobs/results/")
    with pytest.raises(ValidationError, match="overlap"):
        WorkerSettings(input_prefix="", output_prefix="results/")


def test_output_keys_are_derived_from_key_and_etag() -> None:
    settings = WorkerSettings(input_prefix="incoming/", output_prefix="results/")
    keys = output_keys(settings, "incoming/team a/job.jsonl.gz", "e7-2")
    assert keys.results == "results/team a/job.jsonl.gz.e7-2.results.jsonl"
    assert keys.summary == "results/team a/job.jsonl.gz.e7-2.summary.json"


# -- streaming readers -----------------------------------------------------------------------------


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _collect(key: str, data: bytes, size: int) -> list[tuple[int, object, object]]:
    return [(item.line, item.value, item.id) async for item in items_for(key, _pieces(data, size))]


def _kinds(items: list[tuple[int, object, object]]) -> list[tuple[int, str]]:
    out = []
    for line, item, _ in items:
        kind = item.code if isinstance(item, ArbiterError) else "ok"
        assert kind == "ok" or isinstance(item, ArbiterError)
        assert kind != "ok" or isinstance(item, DecisionRequest)
        out.append((line, kind))
    return out


@pytest.mark.parametrize("size", [1, 7, 1 << 20])
async def test_jsonl_lines_survive_any_chunking(size: int) -> None:
    data = (
        (decision_line(1) + "\n\n{broken\n" + decision_line(3) + "\n" + '{"id": "x"}\n').encode()
        + b"\xff\xfe\n"
        + decision_line(6).encode()
    )  # no final newline
    items = await _collect("incoming/a.jsonl", data, size)
    assert _kinds(items) == [
        (1, "ok"),
        (3, "invalid_json"),
        (4, "ok"),
        (5, "invalid_field"),
        (6, "invalid_json"),
        (7, "ok"),
    ]
    assert items[3][2] == "x"  # the id of an invalid decision is kept


@pytest.mark.parametrize("size", [1, 5, 1 << 20])
async def test_json_document_is_read_element_by_element(size: int) -> None:
    doc = {
        "meta": {"owner": "ops", "n": 12345},
        "decisions": [json.loads(decision_line(1)), {"id": "bad"}, 7, json.loads(decision_line(4))],
    }
    items = await _collect("incoming/a.json", json.dumps(doc, indent=1).encode(), size)
    assert _kinds(items) == [(1, "ok"), (2, "invalid_field"), (3, "invalid_type"), (4, "ok")]


@pytest.mark.parametrize("tail", [", {oops", " oops", ""])
async def test_broken_json_document_ends_with_one_error(tail: str) -> None:
    data = ('{"decisions": [' + decision_line(1) + tail).encode()
    items = await _collect("incoming/a.json", data, 3)
    assert _kinds(items) == [(1, "ok"), (2, "invalid_json")]


async def test_gzip_members_are_concatenated_and_truncation_is_an_error_line() -> None:
    data = gzip.compress((decision_line(1) + "\n").encode()) + gzip.compress(
        (decision_line(2) + "\n").encode()
    )
    assert _kinds(await _collect("incoming/a.jsonl.gz", data, 10)) == [(1, "ok"), (2, "ok")]
    truncated = await _collect("incoming/a.jsonl.gz", data[:-12], 10)
    assert _kinds(truncated) == [(1, "ok"), (2, "invalid_gzip")]
    assert "truncated" in truncated[1][1].message  # type: ignore[attr-defined]
    plain = await _collect("incoming/a.jsonl.gz", b"plain text, not gzip\n", 10)
    assert _kinds(plain) == [(1, "invalid_gzip")]
    assert "not valid gzip" in plain[0][1].message  # type: ignore[attr-defined]


def test_a_log_line_to_a_closed_stderr_is_dropped_not_raised() -> None:
    # The pool must drain and exit even when whoever started it has gone (its pipe closed).
    import io

    import structlog

    from arbiter.logging import configure

    stream = io.StringIO()
    stream.close()
    before = structlog.get_config()
    configure(json=True, stream=stream)
    try:
        structlog.get_logger("arbiter.pool").error("pool.draining")
    finally:
        structlog.configure(**before)


def test_lease_extensions_stop_short_of_sqs_12_hour_limit() -> None:
    from worker.policies import SQS_MAX_VISIBILITY_S, lease_extension

    assert lease_extension(20, 60, 20) == 60
    assert lease_extension(SQS_MAX_VISIBILITY_S - 100, 60, 20) == 60
    assert lease_extension(SQS_MAX_VISIBILITY_S - 70, 60, 20) == 50  # never past the limit
    assert lease_extension(SQS_MAX_VISIBILITY_S - 40, 60, 20) is None  # would not outlast a beat
    assert lease_extension(3.0, 2, 0.5, limit_s=4) is None


def test_restarts_double_then_give_up_and_a_long_life_resets_the_count() -> None:
    from worker.policies import RestartPolicy

    policy = RestartPolicy(base_s=1, maximum_s=5, max_restarts=4, reset_s=60)
    crashes, delays = 0, []
    for _ in range(5):
        crashes = policy.crashes(crashes, lived_s=2)
        delays.append(policy.delay(crashes))
    assert delays == [1, 2, 4, 5, None]
    assert policy.crashes(4, lived_s=3600) == 1  # it ran for an hour: not a crash loop
    assert RestartPolicy(max_restarts=0).delay(1) is None
