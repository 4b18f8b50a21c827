"""The progress of a split job: one small JSON object beside its results, updated as shards finish.

``<output_prefix><name>.<etag>.status.json`` holds the state (``running``, then ``done`` or
``failed``), shards done and failed of the total, lines done and failed of the total, when the job
started, when the object was last updated, and an ETA. Each update is a compare-and-swap (PutObject
with ``If-Match`` on the ETag read), so concurrent workers never lose one another's counts; a bitmap
of the shards already counted makes a redelivered shard count once; and a final state is never
overwritten. The object is advisory: whether a job is complete is decided from the shard markers
(:mod:`worker.merge`), never from here.
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

from worker.jobs import OutputKeys
from worker.shards import Manifest, PreconditionFailed, get_json, put_json

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


def finish(doc: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any] | None:
    if doc["state"] in FINAL:
        return None
    failed = summary.get("shards", {}).get("failed", [])
    return {
        **doc,
        "state": "failed" if failed else "done",
        "shards": {
            **doc["shards"],
            "done": doc["shards"]["total"] - len(failed),
            "failed": len(failed),
        },
        "lines": {**doc["lines"], "done": summary["lines"], "failed": summary["failed"]},
        "updated_at": _iso(time.time()),
        "eta_s": 0,
    }


async def start(s3: Any, bucket: str, key: str, doc: dict[str, Any]) -> None:
    """Write the first status unless one exists (a redelivered split leaves it as it is)."""
    with contextlib.suppress(PreconditionFailed):
        await put_json(s3, bucket, key, doc, IfNoneMatch="*")


async def update(
    s3: Any,
    bucket: str,
    key: str,
    change: Callable[[dict[str, Any]], dict[str, Any] | None],
    tries: int = 25,
) -> dict[str, Any] | None:
    """Read, change, write back if unchanged meanwhile (else again). Never raises: progress is
    advisory, and a job must not fail because its status could not be written."""
    try:
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
    except Exception as exc:
        log.warning("status.update_failed", key=key, error=f"{type(exc).__name__}: {exc}")
    return None
