"""A shard's one outcome: done (its records, as one attempt wrote them) or failed (why, and a
``shard_failed`` record per line), written once with ``If-None-Match: *``.

One object per shard, not a done marker and a failed marker, so a shard can never be both. Every
outcome names the records object that counts, failed ones too, so the merge only joins objects and
the summary only adds tallies: both are functions of the outcomes, which never change.

The first outcome wins. A write that meets one reads it: if it names this attempt's own output, it is
this write's first copy (a resend after a lost answer) and counts as written; otherwise another
attempt got there first, and this attempt's output is deleted.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from worker.fanout.keys import JobFolder, outcome_index
from worker.fanout.plan import Manifest
from worker.jobs import JobFailed
from worker.s3io import delete_quietly, get_json, put_new


class ShardOutcome(BaseModel):
    """What became of one shard (see the module doc)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    index: int
    state: Literal["done", "failed"]
    attempt: str
    output: str  # the records object that counts
    bytes: int
    lines: int
    ok: int
    failed: int
    errors_by_code: dict[str, int] = {}
    abstained: int = 0  # results under their error budget or minimum confidence
    prompt_tokens: int = 0
    engine_s: float = 0.0
    seconds: float = 0.0
    decisions: int = 0
    runs: int = 0
    first_state: str | None = None
    last_state: str | None = None
    model: dict[str, Any] | None = None  # None for a failed shard: nothing scored it
    worker: dict[str, Any] | None = None
    error: str | None = None  # failed: why
    receives: int | None = None  # failed: after how many receives
    at: str = ""


async def read_outcome(s3: Any, bucket: str, folder: JobFolder, index: int) -> ShardOutcome | None:
    got = await get_json(s3, bucket, folder.outcome(index))
    return None if got is None else ShardOutcome.model_validate(got[0])


async def publish(
    s3: Any, bucket: str, folder: JobFolder, outcome: ShardOutcome
) -> tuple[ShardOutcome, bool] | None:
    """Write the shard's outcome unless it has one; the outcome that counts, and whether it is this
    attempt's (see the module doc). None when the job ended meanwhile: the outcome that counted
    was there and its folder is gone, so this attempt's outcome is nobody's (a failed one taken
    for the shard's sent a DLQ record for a shard the results hold as done: campaign seed 1005)."""
    key = folder.outcome(outcome.index)
    if await put_new(s3, bucket, key, outcome.model_dump(mode="json")):
        return outcome, True
    existing = await read_outcome(s3, bucket, folder, outcome.index)
    if existing is None:  # the job finished and its folder went meanwhile
        await delete_quietly(s3, bucket, outcome.output)
        return None
    if existing.attempt == outcome.attempt:
        return existing, True
    await delete_quietly(s3, bucket, outcome.output)
    return existing, False


async def finished(s3: Any, bucket: str, folder: JobFolder) -> set[int]:
    """The shards that have an outcome (one listing: S3's listings are strongly consistent, so an
    outcome written before this call is always in it)."""
    indices: set[int] = set()
    paginator = s3.get_paginator("list_objects_v2")
    async for page in paginator.paginate(Bucket=bucket, Prefix=folder.outcome_prefix):
        for obj in page.get("Contents", []):
            if (index := outcome_index(obj["Key"])) is not None:
                indices.add(index)
    return indices


READ_CONCURRENCY = 16  # outcome reads in flight at once


async def read_some(
    s3: Any, bucket: str, folder: JobFolder, indices: list[int]
) -> list[ShardOutcome]:
    """The outcomes of ``indices``, in that order (:data:`READ_CONCURRENCY` reads at a time)."""
    gate = asyncio.Semaphore(READ_CONCURRENCY)

    async def one(index: int) -> ShardOutcome:
        async with gate:
            found = await read_outcome(s3, bucket, folder, index)
        if found is None:
            raise JobFailed(f"shard {index} has no outcome (yet)")
        return found

    return list(await asyncio.gather(*(one(i) for i in indices)))


async def read_all(
    s3: Any, bucket: str, folder: JobFolder, manifest: Manifest
) -> list[ShardOutcome]:
    """Every shard's outcome, in shard order."""
    return await read_some(s3, bucket, folder, [s.index for s in manifest.shards])
