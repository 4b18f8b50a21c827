"""The fan-out's own messages on the job queue: one per shard, and one merge trigger per job.

Both are plain ``SendMessage`` calls: a duplicate (a resend after a lost answer, two workers that
both saw the last outcome, a repair) costs a receive that finds its work done, never a wrong result.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from worker.events import PROTOCOL, MergeMessage, ShardMessage
from worker.fanout.plan import Manifest
from worker.faults import QueueRefused

log = structlog.get_logger("arbiter.worker")


def shard_body(manifest: Manifest, index: int) -> str:
    inp = manifest.input
    return ShardMessage(
        arbiter_shard=PROTOCOL,
        bucket=inp["bucket"],
        key=inp["key"],
        etag=inp["etag"],
        plan=manifest.plan,
        index=index,
        count=manifest.count,
    ).model_dump_json()


def merge_body(manifest: Manifest) -> str:
    inp = manifest.input
    return MergeMessage(
        arbiter_merge=PROTOCOL,
        bucket=inp["bucket"],
        key=inp["key"],
        etag=inp["etag"],
        plan=manifest.plan,
    ).model_dump_json()


async def send_all(sqs: Any, queue_url: str, bodies: list[str], tries: int = 5) -> None:
    """Send every body (batches of 10); entries SQS refuses are sent again, and one still refused
    after ``tries`` fails the receive that sends it (which is retried)."""
    for start in range(0, len(bodies), 10):
        entries = {
            str(n): {"Id": str(n), "MessageBody": body}
            for n, body in enumerate(bodies[start : start + 10], start)
        }
        for attempt in range(tries):
            answer = await sqs.send_message_batch(
                QueueUrl=queue_url, Entries=list(entries.values())
            )
            failed = {f["Id"] for f in answer.get("Failed", [])}
            for entry in answer.get("Failed", []):
                log.warning("fanout.send_failed", entry=entry["Id"], code=entry.get("Code"))
            entries = {k: v for k, v in entries.items() if k in failed}
            if not entries:
                break
            await asyncio.sleep(0.2 * 2**attempt)
        if entries:
            raise QueueRefused(f"SQS refused {len(entries)} fan-out messages")


async def send_shards(sqs: Any, queue_url: str, manifest: Manifest, indices: list[int]) -> None:
    await send_all(sqs, queue_url, [shard_body(manifest, i) for i in indices])


async def send_merge(sqs: Any, queue_url: str, manifest: Manifest) -> None:
    await sqs.send_message(QueueUrl=queue_url, MessageBody=merge_body(manifest))
    log.info("fanout.merge_sent", shards=manifest.count)
