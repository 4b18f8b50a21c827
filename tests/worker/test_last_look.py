"""A shard message past its tries is not proof that its last try died: SQS shows a message again
while it is in flight (a second delivery; a slow holder's visibility lapsing), and the holder may
still be scoring it. Fuzz seed 2048: the redelivered copy, one past the tries, failed the shard at
once, and the last try's records (one good line) lost to the failure it published first. Now the
first receive past the tries leaves the message to the holder it may have (no delete: that would
end the holder's lease and its work) and comes back later; the next receive past the tries finds
the holder's outcome, or fails the shard without running it."""

from __future__ import annotations

import json

import pytest

from tests.aws import aws_clients
from tests.fakes import FakeEngine
from tests.faults.scenarios import drop, fault_settings, numbered_body, versioned_stack
from worker.context import QueueInfo, WorkerContext
from worker.events import parse_message
from worker.fanout import FanOut
from worker.fanout.keys import job_folder
from worker.fanout.messages import shard_body
from worker.fanout.outcome import publish, read_outcome
from worker.fanout.plan import read_manifest
from worker.jobs import LastTryMayRun
from worker.tries import Receive, Tries


async def test_a_receive_past_the_tries_waits_for_the_last_try_it_may_overlap(
    endpoint: str,
) -> None:
    settings = fault_settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/overlap.jsonl", numbered_body(12))
        fanout = FanOut(
            WorkerContext(
                settings,
                s3,
                sqs,
                FakeEngine(),
                QueueInfo(stack["queue_url"], None, stack["dlq_url"]),
                Tries(2),
            )
        )
        message = json.dumps({"bucket": "jobs", "key": job.key})
        ref = parse_message(message, bucket="jobs", input_prefix="incoming/")[0]
        await fanout.run(ref)  # type: ignore[arg-type]
        folder = job_folder(settings, "jobs", job.key, job.etag)
        manifest = await read_manifest(s3, "jobs", folder)
        assert manifest is not None and manifest.count >= 2
        body = shard_body(manifest, 0)
        shard0 = parse_message(body, bucket="jobs", input_prefix="incoming/")[0]
        shard1 = parse_message(shard_body(manifest, 1), bucket="jobs", input_prefix="incoming/")[0]

        # Receive 3 of 2 tries, while receive 2 (the last try) still scores the shard elsewhere.
        with pytest.raises(LastTryMayRun, match="may still be running"):
            await fanout.run(shard0, Receive(3, message_id="second"))
        assert await read_outcome(s3, "jobs", folder, 0) is None  # nothing failed, nothing written

        # The last try finishes; the next receive finds its outcome and leaves it as it is.
        span = manifest.shards[0]
        scored = await fanout.work.score(folder, manifest, span, last_try=True)
        assert await publish(s3, "jobs", folder, scored) is not None
        await fanout.run(shard0, Receive(4, message_id="second"))
        kept = await read_outcome(s3, "jobs", folder, 0)
        assert kept is not None and kept.state == "done" and kept.failed == 0

        # Two past the tries without an outcome: the last try did die; it fails without running.
        await fanout.run(shard1, Receive(4, message_id="dead"))
        failed = await read_outcome(s3, "jobs", folder, 1)
        assert failed is not None and failed.state == "failed", failed
        assert failed.failed == failed.lines > 0


async def test_a_give_up_decided_for_the_shard_is_not_deferred(endpoint: str) -> None:
    """A receive that carries its own reason (the outage limit's give-up) fails the shard at once."""
    settings = fault_settings(endpoint)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        job = await drop(s3, settings, "incoming/given-up.jsonl", numbered_body(12))
        fanout = FanOut(
            WorkerContext(
                settings,
                s3,
                sqs,
                FakeEngine(),
                QueueInfo(stack["queue_url"], None, stack["dlq_url"]),
                Tries(2),
            )
        )
        message = json.dumps({"bucket": "jobs", "key": job.key})
        ref = parse_message(message, bucket="jobs", input_prefix="incoming/")[0]
        await fanout.run(ref)  # type: ignore[arg-type]
        folder = job_folder(settings, "jobs", job.key, job.etag)
        manifest = await read_manifest(s3, "jobs", folder)
        assert manifest is not None
        shard0 = parse_message(shard_body(manifest, 0), bucket="jobs", input_prefix="incoming/")[0]
        await fanout.run(shard0, Receive(3, reason="store unavailable for 90 s"))
        failed = await read_outcome(s3, "jobs", folder, 0)
        assert failed is not None and failed.state == "failed"  # no OutOfTries: no last look
