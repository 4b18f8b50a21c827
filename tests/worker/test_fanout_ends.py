"""How a split job ends (issue 27): exactly one dead-letter record per failed shard, made from the
summary; a status that is gone rebuilt from the outcomes; summaries true after any re-send."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.aws import aws_clients, list_keys, read_object, receive_all
from tests.fakes import FakeEngine
from tests.faults.proxy import Call
from tests.faults.scenarios import (
    Rule,
    drop,
    fault_settings,
    numbered_body,
    rules,
    run_fleet,
    versioned_stack,
)
from tests.worker.fanout_support import make_consumer, pending, stripped
from tests.worker.support import sample
from worker.context import QueueInfo, WorkerContext
from worker.events import JobRef, parse_message
from worker.fanout import FanOut, status
from worker.fanout.deadletters import RecordsInFlight, records_key
from worker.fanout.keys import job_folder
from worker.fanout.merge import Merger
from worker.fanout.messages import shard_body
from worker.fanout.plan import read_manifest
from worker.outputs import output_keys
from worker.s3io import put_json, put_new
from worker.tries import Tries

DEPS = ("store", "queue")


def _one_shard_failed(job: Any, error: str = "boom") -> dict[str, Any]:
    """The summary of an 8-line job in two shards whose second failed (lines 5-8, 5 receives)."""
    span = {"index": 1, "first_line": 5, "last_line": 8, "lines": 4, "receives": 5}
    return {
        "lines": 8,
        "failed": 4,
        "input": {"bucket": "jobs", "key": job.key, "etag": job.etag},
        "shards": {"plan": "ab" * 8, "count": 2, "failed": [{**span, "error": error}]},
    }


async def test_a_failed_shard_delivered_again_and_again_has_one_dlq_record(endpoint: str) -> None:
    """Shard 1's input is gone as its worker sees it (a 404), so it fails at its first receive;
    every shard message is sent twice and some deletes are faked, so the failed shard is received
    several times, by both workers. Before issue 27 each such receive sent a record."""
    settings = fault_settings(endpoint)

    def shard_input(call: Call) -> bool:
        return call.op == "GetObject" and call.key.endswith("/in/00001")

    def shard_sends(call: Call) -> bool:
        return call.op == "SendMessageBatch"

    def shard_deletes(call: Call) -> bool:
        return (
            call.op == "DeleteMessage"
            and call.held is not None
            and "arbiter_shard" in (call.held.body)
        )

    decide = rules(
        Rule(shard_input, "missing", times=10**6),
        Rule(shard_sends, "duplicate", times=10**6),
        Rule(shard_deletes, "fake_delete", times=3),
    )
    bodies = {"incoming/f.jsonl": numbered_body(12)}
    bad, jobs, fleet = await run_fleet(endpoint, settings, decide, bodies)
    keys = output_keys(settings, jobs[0].key, jobs[0].etag)
    async with aws_clients(endpoint) as (s3, _):
        marker = json.loads(await read_object(s3, "jobs", records_key(keys)))
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
    [record] = fleet.dead_letters
    assert bad == []  # every line once; nothing in the DLQ but failed shards' records, one each
    assert [f["index"] for f in summary["shards"]["failed"]] == [1]
    assert marker["state"] == "sent" and marker["records"] == [1]
    # The record names its source and why: the shard's message, with what the summary says.
    assert record["arbiter_shard"] == 2 and record["key"] == jobs[0].key and record["index"] == 1
    assert "is gone" in record["failed"]["error"] and record["summary_key"] == keys.summary


async def _drain(sqs: Any, url: str) -> None:
    """Receive and delete every visible message."""
    while got := await receive_all(sqs, url, wait=0):
        for message in got:
            await sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])


async def test_a_status_that_is_gone_is_rebuilt_from_the_outcomes(endpoint: str) -> None:
    """Shards 0 and 1 finish, the status object is deleted (by hand, a lifecycle rule), and the
    job's notification is re-sent: the repair writes a new status and counts the outcomes that
    exist into it, so shard 2's count completes it and sends the merge message. Before issue 27
    the new status started empty, and no count ever completed it."""
    settings = fault_settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/gone.jsonl", numbered_body(12))
        fanout = FanOut(
            WorkerContext(
                settings,
                s3,
                sqs,
                FakeEngine(),
                QueueInfo(stack["queue_url"], None, stack["dlq_url"]),
                Tries(5),
            )
        )
        ref = JobRef("jobs", job.key)
        await fanout.run(ref)  # the split: the status, three shard messages
        folder = job_folder(settings, "jobs", job.key, job.etag)
        manifest = await read_manifest(s3, "jobs", folder)
        assert manifest is not None and manifest.count == 3
        await _drain(sqs, stack["queue_url"])

        async def shard(index: int) -> None:
            [entry] = parse_message(
                shard_body(manifest, index), bucket="jobs", input_prefix="incoming/"
            )
            await fanout.run(entry)  # type: ignore[arg-type]

        await shard(0)
        await shard(1)
        keys = output_keys(settings, job.key, job.etag)
        await s3.delete_object(Bucket="jobs", Key=status.status_key(keys))
        await fanout.run(ref)  # the re-sent notification: a repair
        await _drain(sqs, stack["queue_url"])  # its copy of shard 2's message
        rebuilt = json.loads(
            await (await s3.get_object(Bucket="jobs", Key=status.status_key(keys)))["Body"].read()
        )
        await shard(2)
        messages = await receive_all(sqs, stack["queue_url"], wait=1)
    assert rebuilt["shards"] == {"total": 3, "done": 2, "failed": 0}
    assert rebuilt["lines"]["done"] == sum(s.items for s in manifest.shards[:2])
    assert ["arbiter_merge" in m["Body"] for m in messages] == [True]


class RaisesOn(FakeEngine):
    """Raises on any batch that holds decision ``bad``."""

    def __init__(self, bad: str) -> None:
        super().__init__()
        self.bad = bad

    def score(self, decisions: Any) -> Any:
        if any(d.id == self.bad for d in decisions):
            raise RuntimeError(f"cannot score {self.bad}")
        return super().score(decisions)


async def _handle_until(consumer: Any, s3: Any, sqs: Any, url: str, summary: str) -> None:
    """Hand the consumer each message in turn until the summary exists and the queue is empty."""
    for _ in range(200):
        for message in await receive_all(sqs, url, wait=1):
            await consumer.handle(message)
        if summary in await list_keys(s3, "jobs", summary) and not await pending(sqs, url):
            return
    raise AssertionError("the job did not finish")


def _notify(key: str) -> str:
    return json.dumps({"bucket": "jobs", "key": key})


async def test_a_resend_after_the_summary_alone_was_lost_describes_the_results_that_exist(
    endpoint: str,
) -> None:
    """The job ran (12 lines, all scored); its summary alone was lost and the notification re-sent;
    the re-run scores again, and this time d5 raises. The results object of the first run is
    kept (written once), so the summary must describe it: before issue 27 the merge reused it and
    wrote the re-run's counts beside it (11 ok, 1 error; the results held 12 ok)."""
    settings = fault_settings(endpoint, chunk_decisions=1)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/lost.jsonl", numbered_body(12))
        keys = output_keys(settings, job.key, job.etag)
        url = stack["queue_url"]
        first, _ = await make_consumer(settings, s3, sqs, FakeEngine())
        await _handle_until(first, s3, sqs, url, keys.summary)
        await s3.delete_object(Bucket="jobs", Key=keys.summary)
        await sqs.send_message(QueueUrl=url, MessageBody=_notify(job.key))
        again, _ = await make_consumer(settings, s3, sqs, RaisesOn("d5"))
        await _handle_until(again, s3, sqs, url, keys.summary)
        records = stripped(await read_object(s3, "jobs", keys.results))
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
    assert [("result" in r) for r in records] == [True] * 12  # the first run's results
    assert (summary["lines"], summary["ok"], summary["failed"]) == (12, 12, 0)
    assert summary["errors_by_code"] == {} and summary["shards"]["failed"] == []
    assert summary["shards"]["merge"]["results_match_outcomes"] is False


async def test_a_reruns_summary_has_its_own_times(endpoint: str) -> None:
    """One worker runs a job, its outputs are deleted and its notification re-sent: the worker
    has the first run's manifest in its cache (same input, same plan), but the summary's start and
    seconds are the re-run's own."""
    settings = fault_settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/again.jsonl", numbered_body(12))
        keys = output_keys(settings, job.key, job.etag)
        url = stack["queue_url"]
        consumer, _ = await make_consumer(settings, s3, sqs, FakeEngine())
        await _handle_until(consumer, s3, sqs, url, keys.summary)
        first = json.loads(await read_object(s3, "jobs", keys.summary))
        for key in (keys.results, keys.summary, status.status_key(keys)):
            await s3.delete_object(Bucket="jobs", Key=key)
        await asyncio.sleep(1.5)  # a re-run some time later
        await sqs.send_message(QueueUrl=url, MessageBody=_notify(job.key))
        [message] = await receive_all(sqs, url, wait=1)
        await consumer.handle(message)  # the re-split, by the same worker
        folder = job_folder(settings, "jobs", job.key, job.etag)
        manifest = await read_manifest(s3, "jobs", folder)
        assert manifest is not None
        await _handle_until(consumer, s3, sqs, url, keys.summary)
        second = json.loads(await read_object(s3, "jobs", keys.summary))
    assert second["started_at"] == manifest.created_at != first["started_at"]
    assert second["seconds"]["total"] < 1.5 + first["seconds"]["total"]


async def test_an_end_that_finds_another_sending_the_records_keeps_the_job_until_they_are_sent(
    endpoint: str,
) -> None:
    """A worker claimed the job's dead-letter records and died before sending them. An end that
    runs while that claim is fresh must not delete the job's folder (its message would then be
    deleted, and nobody would ever send the records): it raises a store-class fault, its message
    comes back, and once the claim is stale the end takes it over and sends each record once."""
    settings = fault_settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/held.jsonl", numbered_body(8))
        keys = output_keys(settings, job.key, job.etag)
        folder = job_folder(settings, "jobs", job.key, job.etag)
        await s3.put_object(Bucket="jobs", Key=f"{folder.base}marker", Body=b"x")
        summary = _one_shard_failed(job)
        merger = Merger(s3, settings, None, sqs, stack["dlq_url"])
        claim = {"state": "sending", "by": "dead", "at": time.time()}
        await put_new(s3, "jobs", records_key(keys), claim)
        with pytest.raises(RecordsInFlight) as held:
            await merger.finalize(keys, folder, summary)
        kept = await list_keys(s3, "jobs", folder.base)
        stale = {**claim, "at": time.time() - settings.visibility_timeout_s - 1}
        await put_json(s3, "jobs", records_key(keys), stale)
        await merger.finalize(keys, folder, summary)
        await merger.finalize(keys, folder, summary)  # a second end sends nothing more
        records = await receive_all(sqs, stack["dlq_url"], wait=1)
        gone = await list_keys(s3, "jobs", folder.base)
    assert held.value.fault.counts is False  # spends no try
    assert kept == [f"{folder.base}marker"] and gone == []
    [record] = [json.loads(m["Body"]) for m in records]
    assert record["index"] == 1 and record["failed"]["error"] == "boom"


async def test_an_end_of_job_race_opens_no_breaker_and_logs_no_error(endpoint: str) -> None:
    """Issue 36: an end that meets another end sending the records (``RecordsInFlight``) or a
    status key that stays contended (``Contended``) is an ordinary race on a healthy store: its
    message comes back after a backoff, spending no try, but it opened the store breaker, logged
    an ERROR and moved the breaker metric, and an alarm on that metric fired."""
    settings = fault_settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/race.jsonl", numbered_body(8))
        keys = output_keys(settings, job.key, job.etag)
        summary = _one_shard_failed(job)
        await put_new(s3, "jobs", keys.summary, summary)
        claim = {"state": "sending", "by": "another", "at": time.time()}
        await put_new(s3, "jobs", records_key(keys), claim)
        merge = {"arbiter_merge": 2, "bucket": "jobs", "key": job.key, "etag": job.etag}
        await sqs.send_message(
            QueueUrl=stack["queue_url"], MessageBody=json.dumps({**merge, "plan": "ab" * 8})
        )
        got = await receive_all(sqs, stack["queue_url"], wait=1)
        for note in [m for m in got if "arbiter_merge" not in m["Body"]]:  # the drop's own
            await sqs.delete_message(
                QueueUrl=stack["queue_url"], ReceiptHandle=note["ReceiptHandle"]
            )
        [message] = [m for m in got if "arbiter_merge" in m["Body"]]
        consumer, registry = await make_consumer(settings, s3, sqs, FakeEngine())
        with capture_logs() as logs:
            await consumer.handle(message)
        back = await receive_all(sqs, stack["queue_url"], wait=2)
    errors = [e["event"] for e in logs if e["log_level"] in ("error", "critical")]
    assert errors == [] and "message.busy" in [e["event"] for e in logs]
    assert not consumer.store.open and not consumer.queue_breaker.open
    opened = [sample(registry, "arbiter_worker_circuit_opens_total", dependency=d) for d in DEPS]
    retries = [sample(registry, "arbiter_worker_outage_retries_total", dependency=d) for d in DEPS]
    assert opened == [0, 0] and retries == [0, 0]
    assert len(back) == 1 and back[0]["Body"] == message["Body"]  # given back, not counted


async def test_a_reruns_failed_shard_gets_its_own_dlq_record(endpoint: str) -> None:
    """Issue 36: a re-run of an input (its outputs deleted, its notification sent again) whose
    shard fails again got no DLQ record: the first run's ``dead-letters.json``, marked sent,
    outlived it. The claim names its run (the summary's ``finished_at``), so the re-run's end
    takes the old mark over and sends its own record, once."""
    settings = fault_settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/twice.jsonl", numbered_body(8))
        keys = output_keys(settings, job.key, job.etag)
        folder = job_folder(settings, "jobs", job.key, job.etag)
        merger = Merger(s3, settings, None, sqs, stack["dlq_url"])
        records = []
        for run in ("2026-01-01T00:00:00+00:00", "2026-01-02T00:00:00+00:00"):
            summary = {**_one_shard_failed(job, error=run), "finished_at": run}
            await merger.finalize(keys, folder, summary)
            await merger.finalize(keys, folder, summary)  # a second end sends nothing more
            records += await receive_all(sqs, stack["dlq_url"], wait=1)
    assert [json.loads(m["Body"])["failed"]["error"] for m in records] == [
        "2026-01-01T00:00:00+00:00",
        "2026-01-02T00:00:00+00:00",
    ]
