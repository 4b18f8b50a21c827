"""Queue semantics on moto (server mode) with a fake engine: DLQ redrive, heartbeat, drain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

import pytest

from tests.aws import aws_clients, list_keys, queue_counts, receive_all, s3_notification, wait_for
from tests.fakes import FakeEngine, decision_line
from tests.worker.support import make_consumer, sample, settings_for
from worker import events
from worker.stack import ensure_stack


async def test_test_event_and_outside_prefix_are_deleted(endpoint: str) -> None:
    settings = settings_for(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await s3.put_object(Bucket="jobs", Key="incoming/notes.txt", Body=b"hello")
        await s3.put_object(Bucket="jobs", Key="elsewhere/a.jsonl", Body=b"{}")  # not notified
        await sqs.send_message(  # a hand-made event outside the prefix
            QueueUrl=stack["queue_url"],
            MessageBody=json.dumps({"bucket": "jobs", "key": "other/a.jsonl"}),
        )
        engine = FakeEngine()
        consumer, registry = await make_consumer(settings, s3, sqs, engine)
        task = asyncio.create_task(consumer.run())
        await wait_for(lambda: _empty(sqs, stack["queue_url"]))
        consumer.stop()
        await asyncio.wait_for(task, 10)
        assert await list_keys(s3, "jobs", "results/") == []
    assert engine.calls == 0
    # s3:TestEvent, the .txt object and the direct message outside the prefix
    assert sample(registry, "arbiter_worker_jobs_total", outcome="ignored") == 3


async def _empty(sqs: Any, url: str) -> bool:
    return await queue_counts(sqs, url) == (0, 0)


async def test_failing_job_backs_off_then_lands_in_the_dlq(endpoint: str) -> None:
    settings = settings_for(endpoint, max_receive_count=2, visibility_timeout_s=5)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await s3.put_object(Bucket="jobs", Key="incoming/bad.jsonl", Body=decision_line(1).encode())
        consumer, registry = await make_consumer(settings, s3, sqs, FakeEngine(fail=True))
        task = asyncio.create_task(consumer.run())
        dead = await wait_for(lambda: receive_all(sqs, stack["dlq_url"], wait=1), within_s=40)
        consumer.stop()
        await asyncio.wait_for(task, 10)
        assert await queue_counts(sqs, stack["queue_url"]) == (0, 0)
        assert await list_keys(s3, "jobs", "results/") == []
    [message] = dead
    assert "incoming%2Fbad.jsonl" in message["Body"] or "incoming/bad.jsonl" in message["Body"]
    assert sample(registry, "arbiter_worker_jobs_total", outcome="failed") == 2
    assert sample(registry, "arbiter_worker_dlq_moves_total", reason="max_receives") == 1


async def test_unreadable_message_goes_straight_to_the_dlq(endpoint: str) -> None:
    settings = settings_for(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await sqs.send_message(QueueUrl=stack["queue_url"], MessageBody="not json at all")
        consumer, registry = await make_consumer(settings, s3, sqs, FakeEngine())
        task = asyncio.create_task(consumer.run())
        dead = await wait_for(lambda: receive_all(sqs, stack["dlq_url"], wait=1))
        consumer.stop()
        await asyncio.wait_for(task, 10)
    assert [m["Body"] for m in dead] == ["not json at all"]
    assert sample(registry, "arbiter_worker_dlq_moves_total", reason="unreadable") == 1


async def test_heartbeat_keeps_a_slow_job_invisible_until_it_is_done(endpoint: str) -> None:
    settings = settings_for(endpoint, visibility_timeout_s=2, heartbeat_s=0.5)
    engine = FakeEngine(delay_s=6.0)  # three times the visibility timeout
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await receive_all(sqs, stack["queue_url"])  # drop S3's test event (it comes back later)
        await sqs.purge_queue(QueueUrl=stack["queue_url"])
        await s3.put_object(
            Bucket="jobs", Key="incoming/slow.jsonl", Body=decision_line(1).encode()
        )
        consumer, registry = await make_consumer(settings, s3, sqs, engine)
        task = asyncio.create_task(consumer.run())
        await asyncio.to_thread(engine.started.wait, 10)
        stolen = []
        while not engine.scored:  # a second worker polls all along and must get nothing
            stolen += await receive_all(sqs, stack["queue_url"], wait=1)
        await wait_for(lambda: _empty(sqs, stack["queue_url"]))
        consumer.stop()
        await asyncio.wait_for(task, 10)
        assert len(await list_keys(s3, "jobs", "results/")) == 2
    assert stolen == []
    assert sample(registry, "arbiter_worker_visibility_extensions_total") >= 6
    assert sample(registry, "arbiter_worker_jobs_total", outcome="ok") == 1


async def test_stop_finishes_the_job_in_hand_within_the_deadline(endpoint: str) -> None:
    settings = settings_for(endpoint, drain_deadline_s=20)
    engine = FakeEngine(delay_s=2.0)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await s3.put_object(Bucket="jobs", Key="incoming/d.jsonl", Body=decision_line(1).encode())
        consumer, _ = await make_consumer(settings, s3, sqs, engine)
        task = asyncio.create_task(consumer.run())
        await asyncio.to_thread(engine.started.wait, 10)
        consumer.stop()
        await asyncio.wait_for(task, 15)
        assert len(await list_keys(s3, "jobs", "results/")) == 2
        assert await queue_counts(sqs, stack["queue_url"]) == (0, 0)


async def test_drain_deadline_releases_the_message_at_once(endpoint: str) -> None:
    settings = settings_for(endpoint, drain_deadline_s=0.5, visibility_timeout_s=600)
    engine = FakeEngine(delay_s=5.0)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        await receive_all(sqs, stack["queue_url"])
        await sqs.purge_queue(QueueUrl=stack["queue_url"])
        await s3.put_object(Bucket="jobs", Key="incoming/r.jsonl", Body=decision_line(1).encode())
        consumer, _ = await make_consumer(settings, s3, sqs, engine)
        task = asyncio.create_task(consumer.run())
        await asyncio.to_thread(engine.started.wait, 10)
        consumer.stop()
        await asyncio.wait_for(task, 5)
        # Released, not left invisible for the 600 s timeout: another worker gets it now, as a
        # fresh message (a release is not a failed receive).
        [again] = await receive_all(sqs, stack["queue_url"], wait=1)
        assert again["Attributes"]["ApproximateReceiveCount"] == "1"
        assert await list_keys(s3, "jobs", "results/") == []


async def test_a_cancelled_worker_leaves_no_long_poll_behind(endpoint: str) -> None:
    """A worker task cancelled during its long poll (the fleet harness's kill, a supervisor's
    cancel) left the receive running: it could take a message no one would handle (invisible for
    its visibility timeout) and failed on the closed client as 'Task exception was never
    retrieved'."""
    settings = settings_for(endpoint, wait_time_s=5)
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        consumer, _ = await make_consumer(settings, s3, sqs, FakeEngine())
        task = asyncio.create_task(consumer.run())
        await asyncio.sleep(0.5)  # in the long poll
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # let the cancellations be delivered
        polls = [
            t
            for t in asyncio.all_tasks()
            if not t.done() and getattr(t.get_coro(), "__name__", "") == "_receive"
        ]
        assert polls == []


async def test_a_received_message_is_parsed_once(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job message's second receive, its last try: the tries look for its uncounted receives,
    the handler runs its job, and its records are cleared after; each reads the one Receive the
    message was read as, so its body is parsed once (every worker module's parse is counted)."""
    settings = settings_for(endpoint, max_receive_count=2)
    real = events.parse_message
    bodies: list[str] = []

    def counting(body: str, **kw: Any) -> Any:
        bodies.append(body)
        return real(body, **kw)

    for module in list(sys.modules.values()):
        if module.__name__.startswith("worker") and getattr(module, "parse_message", None) is real:
            monkeypatch.setattr(module, "parse_message", counting)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, settings)
        url = stack["queue_url"]
        await s3.put_object(
            Bucket="jobs", Key="incoming/once.jsonl", Body=decision_line(1).encode()
        )
        first = await s3_notification(sqs, url)
        handle = first["ReceiptHandle"]
        await sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=handle, VisibilityTimeout=0)
        [message] = [m for m in await receive_all(sqs, url, wait=1) if "Records" in m["Body"]]
        assert message["Attributes"]["ApproximateReceiveCount"] == "2"
        consumer, _ = await make_consumer(settings, s3, sqs, FakeEngine())
        await consumer.handle(message)
        assert await queue_counts(sqs, url) == (0, 0)
        assert len(await list_keys(s3, "jobs", "results/")) == 2  # results and summary
    assert bodies == [message["Body"]]
