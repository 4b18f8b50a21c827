"""Queue-level faults on moto (server mode) with a fake engine: a lease that cannot be kept, drain
releases, permanent failures, poison bodies, and a poisonous line inside a good job."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import ValidationError

from tests.aws import (
    aws_clients,
    list_keys,
    queue_counts,
    read_object,
    receive_all,
    s3_notification,
    wait_for,
)
from tests.fakes import FakeEngine, decision_line
from tests.worker.support import make_consumer, sample, settings_for
from worker.events import JobRef, UnreadableMessage, parse_message
from worker.jobs import run_job
from worker.outputs import output_keys
from worker.settings import WorkerSettings
from worker.stack import ensure_stack

DEEP = "[" * 50_000 + "]" * 50_000


async def _job_message(s3: Any, sqs: Any, url: str, key: str, body: bytes) -> dict[str, Any]:
    """Put a job and receive its S3 notification (S3's test event is dropped)."""
    await s3.put_object(Bucket="jobs", Key=key, Body=body)
    return await s3_notification(sqs, url)


# -- settings and message bodies -------------------------------------------------------------------


def test_a_heartbeat_that_cannot_keep_up_with_the_visibility_timeout_is_refused() -> None:
    with pytest.raises(ValidationError, match="heartbeat_s"):
        WorkerSettings(visibility_timeout_s=30, heartbeat_s=30)
    with pytest.raises(ValidationError, match="heartbeat_s"):
        WorkerSettings(visibility_timeout_s=10, heartbeat_s=6)
    assert WorkerSettings(visibility_timeout_s=10, heartbeat_s=5).heartbeat_interval_s == 5


@pytest.mark.parametrize(
    "body",
    [
        '{"Records": ' + DEEP + "}",
        DEEP,
        '{"bucket": "jobs", "key": "incoming/a.jsonl", "etag": ' + "9" * 5000 + "}",
    ],
)
def test_a_deeply_nested_or_unreadable_number_body_is_unreadable(body: str) -> None:
    with pytest.raises(UnreadableMessage):
        parse_message(body, bucket="jobs", input_prefix="incoming/")


async def test_a_deeply_nested_message_goes_to_the_dlq_at_its_first_receive(endpoint: str) -> None:
    settings = settings_for(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await sqs.purge_queue(QueueUrl=stack["queue_url"])
        await sqs.send_message(QueueUrl=stack["queue_url"], MessageBody=DEEP)
        [message] = await receive_all(sqs, stack["queue_url"], wait=1)
        consumer, registry = await make_consumer(settings, s3, sqs, FakeEngine())
        await consumer.handle(message)
        assert await queue_counts(sqs, stack["queue_url"]) == (0, 0)
        dead = await receive_all(sqs, stack["dlq_url"], wait=1)
    assert [m["Body"] for m in dead] == [DEEP]
    assert sample(registry, "arbiter_worker_dlq_moves_total", reason="unreadable") == 1


# -- lines -----------------------------------------------------------------------------------------


async def test_a_deeply_nested_line_is_one_error_line_in_a_successful_job(endpoint: str) -> None:
    settings = settings_for(endpoint, chunk_decisions=2)
    lines = [
        decision_line(1),
        '{"id": "deep", "state": ' + DEEP + "}",
        decision_line(3),
        '{"id": "n", "state": ' + "1" * 9000 + "}",
        decision_line(5),
    ]
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        message = await _job_message(
            s3, sqs, stack["queue_url"], "incoming/deep.jsonl", "\n".join(lines).encode()
        )
        consumer, registry = await make_consumer(settings, s3, sqs, FakeEngine())
        await consumer.handle(message)
        [results, _summary] = await list_keys(s3, "jobs", "results/")
        records = [json.loads(x) for x in (await read_object(s3, "jobs", results)).splitlines()]
        assert await queue_counts(sqs, stack["queue_url"]) == (0, 0)
    assert [(r["line"], "result" in r) for r in records] == [
        (1, True),
        (2, False),
        (3, True),
        (4, False),
        (5, True),
    ]
    assert (
        records[1]["error"]["code"] == "invalid_json" and "nested" in records[1]["error"]["message"]
    )
    assert sample(registry, "arbiter_worker_jobs_total", outcome="ok") == 1


# -- the lease -------------------------------------------------------------------------------------


async def test_a_refused_heartbeat_stops_the_job(endpoint: str) -> None:
    settings = settings_for(endpoint, visibility_timeout_s=2, heartbeat_s=0.5, chunk_decisions=1)
    engine = FakeEngine(delay_s=1.0)
    body = "\n".join(decision_line(i) for i in range(10)).encode()  # ~10 s of work
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        message = await _job_message(s3, sqs, stack["queue_url"], "incoming/gone.jsonl", body)
        consumer, registry = await make_consumer(settings, s3, sqs, engine)
        task = asyncio.create_task(consumer.handle(message))
        await asyncio.to_thread(engine.started.wait, 10)
        # Someone else (an operator, a second worker after a lost lease) deleted the message.
        await sqs.delete_message(
            QueueUrl=stack["queue_url"], ReceiptHandle=message["ReceiptHandle"]
        )
        await asyncio.wait_for(task, 5)  # well before the job's ~10 s
        assert await list_keys(s3, "jobs", "results/") == []
        # No longer this worker's message: not given back (that would undo the delete).
        assert await receive_all(sqs, stack["queue_url"], wait=1) == []
    assert engine.calls < 6
    assert sample(registry, "arbiter_worker_jobs_total", outcome="lease_lost") == 1
    assert sample(registry, "arbiter_worker_jobs_total", outcome="failed") == 0


async def test_a_job_at_the_visibility_limit_stops_before_its_message_reappears(
    endpoint: str,
) -> None:
    # SQS never extends a message past 12 h from its receive; here the limit is 4 s. The failed
    # receive backs off 2 s, so a poll racing the job's end cannot catch the message either.
    settings = settings_for(
        endpoint, visibility_timeout_s=2, heartbeat_s=0.5, chunk_decisions=1, backoff_base_s=2
    )
    engine = FakeEngine(delay_s=1.0)
    body = "\n".join(decision_line(i) for i in range(10)).encode()
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        message = await _job_message(s3, sqs, stack["queue_url"], "incoming/long.jsonl", body)
        consumer, registry = await make_consumer(settings, s3, sqs, engine, visibility_limit_s=4)
        task = asyncio.create_task(consumer.handle(message))
        stolen: list[dict[str, Any]] = []
        while not task.done():  # a second worker polls all along
            stolen += await receive_all(sqs, stack["queue_url"], wait=1)
        await task
        assert stolen == [], "the message reappeared while its job was still running"
        again = await wait_for(lambda: receive_all(sqs, stack["queue_url"], wait=1), within_s=10)
        assert await list_keys(s3, "jobs", "results/") == []
    assert again[0]["Attributes"]["ApproximateReceiveCount"] == "2"  # a failed receive
    assert sample(registry, "arbiter_worker_jobs_total", outcome="failed") == 1


async def test_drain_releases_do_not_count_as_failed_receives(endpoint: str) -> None:
    settings = settings_for(endpoint, max_receive_count=2, drain_deadline_s=0.2)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await receive_all(sqs, stack["queue_url"])
        await sqs.purge_queue(QueueUrl=stack["queue_url"])
        await s3.put_object(
            Bucket="jobs", Key="incoming/deploys.jsonl", Body=decision_line(1).encode()
        )
        for _ in range(3):  # three deploys, each interrupting the job
            engine = FakeEngine(delay_s=3.0)
            consumer, _ = await make_consumer(settings, s3, sqs, engine)
            task = asyncio.create_task(consumer.run())
            await asyncio.to_thread(engine.started.wait, 10)
            consumer.stop()
            await asyncio.wait_for(task, 10)
        consumer, registry = await make_consumer(settings, s3, sqs, FakeEngine())
        task = asyncio.create_task(consumer.run())
        await wait_for(lambda: list_keys(s3, "jobs", "results/"), within_s=15)
        await wait_for(lambda: _empty(sqs, stack["queue_url"]))
        consumer.stop()
        await asyncio.wait_for(task, 10)
        assert await receive_all(sqs, stack["dlq_url"], wait=0) == []
    assert sample(registry, "arbiter_worker_jobs_total", outcome="ok") == 1


async def _empty(sqs: Any, url: str) -> bool:
    return await queue_counts(sqs, url) == (0, 0)


# -- permanent failures ----------------------------------------------------------------------------


async def test_a_deleted_input_goes_to_the_dlq_at_its_first_receive(endpoint: str) -> None:
    settings = settings_for(endpoint, max_receive_count=5)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        message = await _job_message(
            s3, sqs, stack["queue_url"], "incoming/deleted.jsonl", decision_line(1).encode()
        )
        await s3.delete_object(Bucket="jobs", Key="incoming/deleted.jsonl")
        consumer, registry = await make_consumer(settings, s3, sqs, FakeEngine())
        await consumer.handle(message)
        assert await queue_counts(sqs, stack["queue_url"]) == (0, 0)
        dead = await receive_all(sqs, stack["dlq_url"], wait=1)
    assert [m["Body"] for m in dead] == [message["Body"]]
    assert sample(registry, "arbiter_worker_dlq_moves_total", reason="permanent") == 1
    assert sample(registry, "arbiter_worker_jobs_total", outcome="failed") == 0


def test_output_keys_stay_within_s3s_1024_bytes() -> None:
    settings = WorkerSettings()
    etag = "0123456789abcdef0123456789abcdef-12"
    for name in ("é" * 500, "a/" * 500, "x" * 1009):
        key = f"incoming/{name}.jsonl"
        assert len(key.encode()) <= 1024
        keys = output_keys(settings, key, etag)
        for out in (keys.results, keys.summary):
            assert len(out.encode()) <= 1024 and out.startswith("results/")
            out.encode("utf-8")  # never a cut character
        assert keys != output_keys(settings, key.replace(".jsonl", "2.jsonl"), etag)
    short = output_keys(settings, "incoming/a.jsonl", etag)
    assert short.results == f"results/a.jsonl.{etag}.results.jsonl"


async def test_a_job_with_the_longest_key_completes(endpoint: str) -> None:
    settings = settings_for(endpoint)
    key = "incoming/" + "k" * 1000 + ".jsonl"
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        await s3.put_object(Bucket="jobs", Key=key, Body=decision_line(1).encode())
        report = await run_job(s3, FakeEngine(), JobRef("jobs", key), settings)
        assert report.keys and report.summary
        assert await list_keys(s3, "jobs", "results/") == sorted(
            [report.keys.results, report.keys.summary]
        )
    assert report.summary["results_key"] == report.keys.results
    assert len(report.keys.summary.encode()) <= 1024
