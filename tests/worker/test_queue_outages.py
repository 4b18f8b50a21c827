"""SQS outages never spend a try (issue 36): a lease lost to the queue, a release that cannot be
sent; and the outage clock that measures the outage, not the wait. Fleets behind the fault proxy,
with one try allowed, so that any receive wrongly counted fails a shard."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from structlog.testing import capture_logs

from tests.aws import aws_clients, read_object
from tests.fakes import FakeEngine
from tests.faults.proxy import Call
from tests.worker.scenarios import Rule, fault_settings, numbered_body, rules, run_fleet
from worker.jobs import output_keys
from worker.settings import WorkerSettings


class Window:
    """Every call that ``hits`` answered 503 for ``length_s`` from the first call that
    ``starts`` it (an outage that begins while the work is in hand)."""

    def __init__(
        self, starts: Callable[[Call], bool], hits: Callable[[Call], bool], length_s: float
    ) -> None:
        self.starts, self.hits, self.length_s = starts, hits, length_s
        self.began: float | None = None
        self.refused = 0

    def __call__(self, call: Call) -> str:
        if self.began is None and self.starts(call):
            self.began = time.monotonic()
        within = self.began is not None and time.monotonic() - self.began < self.length_s
        if within and self.hits(call):
            self.refused += 1
            return "fail_503"
        return "forward"


def shard_input(call: Call) -> bool:
    return call.op == "GetObject" and "/in/" in call.key


def sqs(call: Call) -> bool:
    return call.service == "sqs"


def one_try(endpoint: str, **kw: float) -> WorkerSettings:
    base = {"max_receive_count": 1, "visibility_timeout_s": 2, "heartbeat_s": 0.5}
    probes = {"circuit_probe_s": 0.25, "circuit_probe_max_s": 1.0, "chunk_decisions": 1}
    return fault_settings(endpoint, **{**base, **probes, **kw})


async def _failed_shards(endpoint: str, settings: WorkerSettings, key: str, etag: str) -> list[int]:
    async with aws_clients(endpoint) as (s3, _):
        summary = json.loads(
            await read_object(s3, "jobs", output_keys(settings, key, etag).summary)
        )
    return [f["index"] for f in summary["shards"]["failed"]]


async def test_a_lease_lost_to_an_sqs_outage_spends_no_try_and_its_job_goes_on(
    endpoint: str,
) -> None:
    """Issue 36: SQS down for 4 s while shards that outlive it (6 s each) are in hand, one try
    allowed. Before, the lease gave up, its work was cancelled, its copy could not be sent, and
    the receive after it was past the tries: the shard failed without running (8 of 12 good
    lines). Now the holder goes on, its receive is recorded as uncounted, and the free worker that
    receives the message again once SQS is back (its visibility ran out) scores it too: the first
    outcome wins."""
    settings = one_try(endpoint)
    outage = Window(shard_input, sqs, length_s=4.0)
    engine = lambda n: FakeEngine(delay_s=1.5)  # noqa: E731  4 lines: a shard takes 6 s
    with capture_logs() as logs:
        bad, jobs, _ = await run_fleet(
            endpoint,
            settings,
            outage,
            {"incoming/q.jsonl": numbered_body(8)},
            workers=3,
            engine=engine,
        )
    assert await _failed_shards(endpoint, settings, jobs[0].key, jobs[0].etag) == []
    assert bad == []  # every line scored once, an empty DLQ
    events = [e["event"] for e in logs]
    assert outage.refused > 0 and "visibility.lost" in events and "receive.uncounted" in events


class ThenSqsDown:
    """Shard 0's input answered 503 (its 3 sends), and from its last every SQS request for
    ``length_s``: the receive fails on the store, and SQS takes neither its copy nor a change
    of its visibility."""

    def __init__(self, length_s: float) -> None:
        self.reads = Rule(lambda c: shard_input(c) and c.key.endswith("/in/00000"), "fail_503", 3)
        self.length_s, self.began = length_s, 0.0

    def __call__(self, call: Call) -> str:
        if self.reads(call) == "fail_503":
            self.began = time.monotonic()
            return "fail_503"
        if sqs(call) and self.reads.hits == 3 and time.monotonic() - self.began < self.length_s:
            return "fail_503"
        return "forward"


async def test_a_receive_given_back_while_sqs_is_down_spends_no_try(endpoint: str) -> None:
    """A shard's input answered 503, and SQS down when the receive is given back, one try
    allowed: the receive is a store fault, not a try, but SQS takes no copy and no visibility
    change, so the message comes back when its visibility runs out with SQS's count one higher.
    Before, that receive was past the tries and the shard failed without running. (A visibility
    of 8 s: no renewal falls in the failed reads, so the release alone records the receive.)"""
    settings = one_try(endpoint, visibility_timeout_s=8, heartbeat_s=4)
    plan = ThenSqsDown(length_s=7.0)
    with capture_logs() as logs:
        bad, jobs, _ = await run_fleet(
            endpoint, settings, plan, {"incoming/r.jsonl": numbered_body(8)}
        )
    assert await _failed_shards(endpoint, settings, jobs[0].key, jobs[0].etag) == []
    assert bad == []
    events = [e["event"] for e in logs]
    assert plan.reads.hits == 3 and "release.resend_failed" in events
    assert "receive.uncounted" in events and "visibility.lost" not in events


async def test_a_wait_in_the_backlog_is_not_an_outage(endpoint: str) -> None:
    """Issue 36: a shard whose input met one 503 burst, then waited behind the others longer
    than ARBITER_MAX_OUTAGE_S, was given up at its next burst ("store unavailable for 4 s") on a
    healthy store. The outage clock now counts each gap only up to the delay the message was
    given back with (and a free worker's lag), so the wait is not the outage's."""
    settings = one_try(
        endpoint, max_outage_s=4, backoff_base_s=0.25, wait_time_s=1, visibility_timeout_s=6
    )
    # two receives' reads of shard 0, each sent 3 times by botocore
    first = Rule(lambda c: shard_input(c) and c.key.endswith("/in/00000"), "fail_503", 2 * 3)
    engine = lambda n: FakeEngine(delay_s=0.5)  # noqa: E731  a shard takes 2 s; one worker
    bad, jobs, _ = await run_fleet(
        endpoint,
        settings,
        rules(first),
        {"incoming/w.jsonl": numbered_body(16)},
        workers=1,
        engine=engine,
    )
    assert first.hits == 6 and bad == []
    assert await _failed_shards(endpoint, settings, jobs[0].key, jobs[0].etag) == []
