"""SQS outages never spend a try (issue 36): a lease lost to the queue, a release that cannot be
sent; and the outage clock that measures the outage, not the wait. Fleets behind the fault proxy,
with one try allowed, so that any receive wrongly counted fails a shard."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable

from structlog.testing import capture_logs

from tests.aws import aws_clients, list_keys, read_object, wait_for
from tests.fakes import FakeEngine, decision_line
from tests.faults.fleet import Fleet
from tests.faults.proxy import Call, FaultProxy
from tests.faults.scenarios import (
    Rule,
    drop,
    fault_settings,
    numbered_body,
    rules,
    run_fleet,
    versioned_stack,
)
from tests.worker.test_pool import WORK, Proc, spawn, stack_settings, worker_env
from worker.outputs import output_keys
from worker.settings import WorkerSettings
from worker.stack import ensure_stack
from worker.tries import Receive
from worker.uncounted import Uncounted

__all__ = ["spawn"]  # the process fixture, shared with test_pool


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


def first_shard(call: Call) -> bool:
    return shard_input(call) and call.key.endswith("/in/00000")


class ThenSqsDown:
    """An input (shard 0's by default) answered 503 (its 3 sends), and from its last every SQS
    request for ``length_s``: the receive fails on the store, and SQS takes neither its copy nor
    a change of its visibility."""

    def __init__(self, length_s: float, reads: Callable[[Call], bool] = first_shard) -> None:
        self.reads = Rule(reads, "fail_503", 3)
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


async def test_a_job_run_whole_leaves_no_record_of_its_uncounted_receives(endpoint: str) -> None:
    """The same for a job small enough to run whole: its uncounted receive is recorded in a job
    folder that no end deletes (only a split job's end does), so the receive that finishes the
    job clears it; the campaign found one left behind."""
    settings = one_try(endpoint, visibility_timeout_s=8, heartbeat_s=4, shard_lines=0)
    plan = ThenSqsDown(7.0, lambda c: c.op == "GetObject" and c.key == "incoming/whole.jsonl")
    bad, _, _ = await run_fleet(
        endpoint, settings, plan, {"incoming/whole.jsonl": numbered_body(3)}
    )
    assert plan.reads.hits == 3 and bad == []  # nothing left under the shard prefix


class SlowRenewal:
    """The first extension of a shard's lease answered only after 2.5 s (a renewal botocore is
    still sending through a short outage), longer than the lease's visibility."""

    def __init__(self) -> None:
        self.slowed = 0

    def __call__(self, call: Call) -> str:
        shard = call.held is not None and "arbiter_shard" in call.held.body
        if call.op == "ChangeMessageVisibility" and shard and not self.slowed:
            self.slowed += 1
            return "delay"
        return "forward"


async def test_a_renewal_that_answers_after_the_visibility_ran_out_spends_no_try(
    endpoint: str,
) -> None:
    """One try: a shard's extension still in flight when its visibility ran out (botocore sends
    it again and again through an outage) recorded nothing until it answered, and by then a free
    worker had received the message again, past its tries, and failed the shard. The lease is now
    reported lost half a beat before its visibility ends, whatever the call is doing."""
    settings = one_try(endpoint)
    plan = SlowRenewal()
    engine = lambda n: FakeEngine(delay_s=1.0)  # noqa: E731  4 lines: a shard takes 4 s
    bad, jobs, _ = await run_fleet(
        endpoint,
        settings,
        plan,
        {"incoming/slow.jsonl": numbered_body(8)},
        workers=3,
        engine=engine,
    )
    assert await _failed_shards(endpoint, settings, jobs[0].key, jobs[0].etag) == []
    assert plan.slowed == 1 and bad == []


async def test_a_try_that_fails_on_its_own_counts_even_if_its_lease_was_lost(
    endpoint: str,
) -> None:
    """A receive whose lease was lost to the queue is recorded as uncounted; if its work then
    fails on its own (here an input the role may not read), it is a try after all. Without that,
    a job whose every receive lost its lease (slow extensions on a loaded machine: the campaign's
    seed 1004) was never rejected and hung."""
    settings = one_try(endpoint, max_receive_count=2, shard_lines=0)
    sealed = "incoming/sealed.jsonl"

    def decide(call: Call) -> str:
        if call.key == sealed and call.op == "HeadObject":
            return "delay"  # 2.5 s: the lease's extension (delayed too) outlives its visibility
        if call.key == sealed and call.op == "GetObject":
            return "deny"
        return "delay" if call.op == "ChangeMessageVisibility" else "forward"

    async with aws_clients(endpoint) as (s3, sqs):
        await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, sealed, numbered_body(3))
        keys = output_keys(settings, job.key, job.etag)
        with capture_logs() as logs:
            async with Fleet(endpoint, settings, decide, 1):

                async def told() -> bool:
                    return keys.rejected in await list_keys(s3, "jobs", keys.rejected)

                await wait_for(told, within_s=40)
    assert "receive.uncounted" in [e["event"] for e in logs]


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


async def test_a_worker_restarted_during_an_sqs_outage_waits_and_the_pool_lives(
    endpoint: str, spawn: Callable[..., Proc]
) -> None:
    """Issue 36: a worker killed while SQS is down was restarted into a failing ``GetQueueUrl``
    before any breaker existed; past its restarts (5 by default, 1 here) the pool exited 1. Now
    the restarted worker waits behind its queue breaker and takes work once SQS answers."""
    down = False
    proxy = FaultProxy(endpoint, lambda call: "fail_503" if down and sqs(call) else "forward")
    await proxy.start()
    try:
        async with aws_clients(endpoint) as (s3, client):
            settings = stack_settings(endpoint)
            await ensure_stack(s3, client, settings)
            env = worker_env(
                await proxy.endpoint(0),
                ARBITER_WORKER_PROCESSES=2,
                ARBITER_MAX_RESTARTS=1,
                ARBITER_CIRCUIT_PROBE_S=0.25,
                ARBITER_CIRCUIT_PROBE_MAX_S=1,
            )
            pool = spawn(WORK, env)
            ready = await asyncio.to_thread(pool.wait_event, "worker.ready", 2)
            down = True
            os.kill(int(ready[0]["pid"]), signal.SIGKILL)
            await asyncio.to_thread(pool.wait_event, "queue.unavailable", 2, 30)
            await asyncio.sleep(5)  # the old code had exited 1 by now
            assert pool.popen.poll() is None, "\n".join(pool.lines[-30:])
            down = False
            await asyncio.to_thread(pool.wait_event, "worker.ready", 3, 30)
            body = "\n".join(decision_line(i) for i in range(3)).encode()
            put = await s3.put_object(Bucket="jobs", Key="incoming/after.jsonl", Body=body)
            keys = output_keys(settings, "incoming/after.jsonl", put["ETag"].strip('"'))

            async def summarized() -> bool:
                return keys.summary in await list_keys(s3, "jobs", keys.summary)

            await wait_for(summarized, within_s=60)
            pool.popen.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(pool.popen.wait, 60) == 0
    finally:
        await proxy.close()
    assert not pool.events("pool.crash_loop")


async def test_a_receive_recorded_after_its_jobs_end_leaves_nothing(endpoint: str) -> None:
    """A lease lost (or a release refused) as the job ends elsewhere writes its record into a
    folder the end has already deleted (the campaign's seeds 1003 and 1009 left one): a record
    written once the summary exists is deleted at once; one written before goes with the
    folder."""
    settings = one_try(endpoint)
    shard = {"bucket": "jobs", "key": "incoming/e.jsonl", "etag": "e1", "plan": "ab" * 8}
    body = json.dumps({"arbiter_shard": 2, **shard, "index": 0, "count": 2})
    message = {"MessageId": "m-1", "Body": body, "Attributes": {"ApproximateReceiveCount": "1"}}
    async with aws_clients(endpoint) as (s3, sqs):
        await versioned_stack(s3, sqs, settings)
        uncounted = Uncounted(s3, settings)
        prefix = settings.input_prefix
        read = Receive.read(message, bucket="jobs", input_prefix=prefix)
        await uncounted.record(read, "a lease lost as the job ended")
        before = await list_keys(s3, "jobs", settings.shard_prefix)
        summary = output_keys(settings, "incoming/e.jsonl", "e1").summary
        await s3.put_object(Bucket="jobs", Key=summary, Body=b"{}")
        later = Receive.read({**message, "MessageId": "m-2"}, bucket="jobs", input_prefix=prefix)
        await uncounted.record(later, "a lease lost after the end")
        after = await list_keys(s3, "jobs", settings.shard_prefix)
    assert len(before) == 1 and before[0].endswith("/uncounted/m-1.1")
    assert after == before  # the second, written after the end, is gone


async def test_a_record_still_being_written_when_its_job_ends_is_not_left_behind(
    endpoint: str,
) -> None:
    """A lease lost to slow extensions while a job runs whole: its receive's record is still
    being written (its PUT held 2.5 s) when the job ends and the keeper is stopped. Before, the
    stop cut the record between its PUT and its look at the job's end, and the receive's clear
    ran before the PUT landed: the record was left behind (the campaign's seed 1, on a loaded
    machine). The handler now waits for the record before it answers and clears."""
    settings = one_try(endpoint, max_receive_count=3, shard_lines=0)

    def decide(call: Call) -> str:
        record = call.op == "PutObject" and "/uncounted/" in call.key
        return "delay" if record or call.op == "ChangeMessageVisibility" else "forward"

    engine = lambda n: FakeEngine(delay_s=1.0)  # noqa: E731  3 lines, one a chunk: 3 s
    with capture_logs() as logs:
        bad, _, _ = await run_fleet(
            endpoint, settings, decide, {"incoming/held.jsonl": numbered_body(3)}, engine=engine
        )
    events = [e["event"] for e in logs]
    assert "visibility.lost" in events and "receive.uncounted" in events
    assert bad == []  # nothing left under the shard prefix
