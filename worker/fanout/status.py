"""The progress of a split job: one small JSON object beside its results, updated as shards finish.

``<output_prefix><name>.<etag>.status.json`` holds the state (``running``, then ``done`` or
``failed``), shards done and failed of the total, lines done and failed of the total, when the job
started, when the object was last updated, and an ETA.

The first status is written with ``If-None-Match: *``; each shard's count is a compare-and-swap
(PutObject with ``If-Match`` on the ETag read) that leaves a final state alone, so concurrent workers
never lose one another's counts, a bitmap of the shards already counted makes a redelivered shard
count once, and no count can come after the final state. Because the swaps are serial, exactly one
count completes the bitmap: that worker sends the merge message (:mod:`worker.fanout.runner`), not
every worker that finished near the end. The final status is a plain overwrite made from the summary
alone, by whoever finds the summary (:meth:`worker.fanout.merge.Merger.finalize`); repeating it
writes the same state. Whether a job is complete is decided by its summary and the shards' outcomes,
never from here: a status that is gone only means the outcomes are listed instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import structlog

from worker.fanout.plan import Manifest
from worker.jobs import JobFailed, OutputKeys
from worker.s3io import PreconditionFailed, get_json, put_json, put_new

log = structlog.get_logger("arbiter.worker")

FINAL = ("done", "failed")


def status_key(keys: OutputKeys) -> str:
    return keys.summary.removesuffix("summary.json") + "status.json"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def initial(manifest: Manifest, keys: OutputKeys) -> dict[str, Any]:
    return {
        "state": "running",
        "input": manifest.input,
        "results_key": keys.results,
        "summary_key": keys.summary,
        "shards": {"total": manifest.count, "done": 0, "failed": 0},
        "lines": {"total": manifest.items, "done": 0, "failed": 0},
        "started_at": manifest.created_at,
        "started_ts": manifest.created_ts,
        "updated_at": manifest.created_at,
        "eta_s": None,
        "counted": "00" * (-(-manifest.count // 8)),
    }


def count_shard(
    doc: dict[str, Any],
    index: int,
    lines: int,
    failed_lines: int,
    shard_failed: bool,
    now: float | None = None,
) -> dict[str, Any] | None:
    """``doc`` with shard ``index`` counted; None if it was counted already or the job is over."""
    counted = bytearray.fromhex(doc["counted"])
    byte, bit = divmod(index, 8)
    if doc["state"] in FINAL or byte >= len(counted) or counted[byte] & (1 << bit):
        return None
    counted[byte] |= 1 << bit
    now = time.time() if now is None else now
    shards = dict(doc["shards"])
    shards["failed" if shard_failed else "done"] += 1
    done_lines = doc["lines"]["done"] + lines
    elapsed = max(1e-3, now - float(doc["started_ts"]))
    left = doc["lines"]["total"] - done_lines
    return {
        **doc,
        "shards": shards,
        "lines": {
            **doc["lines"],
            "done": done_lines,
            "failed": doc["lines"]["failed"] + failed_lines,
        },
        "updated_at": _iso(now),
        "eta_s": round(left * elapsed / done_lines, 1) if done_lines else None,
        "counted": counted.hex(),
    }


def complete(doc: dict[str, Any]) -> bool | None:
    """Whether every shard is counted; None for a final status (nothing is counted any more)."""
    if doc["state"] in FINAL:
        return None
    counted = bytearray.fromhex(doc["counted"])
    total = int(doc["shards"]["total"])
    return all(counted[i // 8] & (1 << (i % 8)) for i in range(total))


def final(summary: dict[str, Any], keys: OutputKeys, now: float | None = None) -> dict[str, Any]:
    """The status of a finished job, from its summary alone."""
    shards = summary.get("shards", {})
    failed = shards.get("failed", [])
    count = int(shards.get("count", 0))
    return {
        "state": "failed" if failed else "done",
        "input": summary.get("input"),
        "results_key": keys.results,
        "summary_key": keys.summary,
        "shards": {"total": count, "done": count - len(failed), "failed": len(failed)},
        "lines": {
            "total": summary["lines"],
            "done": summary["lines"],
            "failed": summary["failed"],
        },
        "started_at": summary.get("started_at"),
        "updated_at": _iso(time.time() if now is None else now),
        "eta_s": 0,
        "counted": "ff" * (-(-count // 8)),
    }


async def finish(s3: Any, bucket: str, keys: OutputKeys, summary: dict[str, Any]) -> None:
    """Write the final status (raises, so that the step that finishes the job is retried)."""
    await put_json(s3, bucket, status_key(keys), final(summary, keys))


async def start(s3: Any, bucket: str, key: str, doc: dict[str, Any]) -> None:
    """Write the first status unless one exists (a redelivered split leaves it as it is). A status
    found here of another run of the same input (final, or started by another manifest: the input's
    outputs were deleted and it was sent again) is replaced. The caller then checks for the summary
    and, if the job is in fact finished, writes the final status again, so the last status written
    is always the true one."""
    if await put_new(s3, bucket, key, doc):
        return
    got = await get_json(s3, bucket, key)
    if got is None:
        return
    found, etag = got
    if found["state"] in FINAL or found.get("started_ts") != doc["started_ts"]:
        with contextlib.suppress(PreconditionFailed):
            await put_json(s3, bucket, key, doc, IfMatch=etag)


async def update(
    s3: Any,
    bucket: str,
    key: str,
    change: Callable[[dict[str, Any]], dict[str, Any] | None],
    tries: int = 25,
) -> dict[str, Any] | None:
    """Read, change, write back if unchanged meanwhile (else again); the status as it is after
    this call (changed by it, or already as wanted), None if there is none. Raises
    :class:`~worker.jobs.JobFailed` when it cannot be written: a shard's count decides who sends
    the merge message (:mod:`worker.fanout.runner`), so its message is retried rather than
    deleted uncounted."""
    for _ in range(tries):
        got = await get_json(s3, bucket, key)
        if got is None:
            return None
        doc, etag = got
        new = change(doc)
        if new is None:
            return doc  # type: ignore[no-any-return]
        try:
            await put_json(s3, bucket, key, new, IfMatch=etag)
        except PreconditionFailed:
            await asyncio.sleep(random.uniform(0.01, 0.1))
            continue
        return new
    log.warning("status.contended", key=key, tries=tries)
    raise JobFailed(f"the status {key} stayed contended for {tries} tries")
