"""The progress of a split job: one small JSON object beside its results, fed by striped counts.

``<output_prefix><name>.<etag>.status.json`` holds the state (``running``, then ``done`` or
``failed``), shards done and failed of the total, lines done and failed of the total, when the job
started, when the object was last updated, and an ETA.

**Striped counting.** One status object counted by every shard (a GET and an ``If-Match`` PUT
of one key, serial whatever the fleet) would be the fleet's limit: 2.5 shards/s at 32 workers and
50 ms, against 70 for the outcome alone. So shard ``i`` is counted in stripe ``i mod
K`` (``K = min(shards, STRIPES)``, :data:`worker.fanout.plan.STRIPES`, fixed in the manifest), a
small object in the job's folder (:meth:`~worker.fanout.keys.JobFolder.stripe`) holding a bitmap
of its shards and their sums, by compare-and-swap: a redelivered shard counts once, and one count
completes each stripe. The status keeps a snapshot of each stripe, ``[shards counted, shards
failed, lines, lines failed]``, and totals that are their sums; every count folds its stripe's
snapshot in with one try at each quarter of the stripe (progress for ``arbiter submit``: a snapshot
that loses to another write is carried by its stripe's next, and the last ones by the final
status).

**Who sends the merge message.** The count that completes a stripe (or finds it complete: a count
repeated after its worker died) lists the outcomes: the last stripe completed is completed after
every shard was counted, so after every outcome was written, and its listing sees them all (S3's
listings are strongly consistent). One that sees every outcome claims the merge
(``merge-claim.json`` in the folder, ``If-None-Match: *``, naming its shard): the claimer sends the
merge message, and so does its own shard's message come back (it may have died before sending);
others do not. So one merge message in the race of the last stripes, duplicates only after a
death (harmless).

The final status is a plain overwrite made from the summary alone, by whoever finds the summary
(:meth:`worker.fanout.merge.Merger.finalize`); repeating it writes the same state, and no fold
changes a final status. Whether a job is complete is decided by its summary and the shards'
outcomes, never from the status.
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

from worker.fanout.keys import JobFolder
from worker.fanout.outcome import ShardOutcome, finished
from worker.fanout.plan import Manifest
from worker.faults import Busy
from worker.outputs import OutputKeys
from worker.s3io import PreconditionFailed, WriteConflict, get_json, put_json, put_new

log = structlog.get_logger("arbiter.worker")

FINAL = ("done", "failed")
REPORTS = 4  # progress reports per stripe (see reports())
Snapshot = list[int]  # [shards counted, shards failed, lines, lines failed]


class Contended(Busy):
    """The status kept changing under this worker's writes (a hot key, not an outage): retried
    without spending a try."""


def status_key(keys: OutputKeys) -> str:
    return keys.status


def stripe_size(shards: int, stripes: int, k: int) -> int:
    """How many of ``shards`` fall in stripe ``k`` of ``stripes`` (shard i is in stripe i mod K)."""
    return len(range(k, shards, stripes))


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
        "stripes": [[0, 0, 0, 0] for _ in range(manifest.stripe_count)],
    }


def initial_stripe(manifest: Manifest, k: int) -> dict[str, Any]:
    size = stripe_size(manifest.count, manifest.stripe_count, k)
    return {
        "stripe": k,
        "of": manifest.stripe_count,
        "size": size,
        "counted": "00" * (-(-size // 8)),
    }


def count_in_stripe(
    doc: dict[str, Any], index: int, lines: int, failed_lines: int, shard_failed: bool
) -> dict[str, Any] | None:
    """Stripe ``doc`` with shard ``index`` counted; None if it was counted already."""
    counted = bytearray.fromhex(doc["counted"])
    byte, bit = divmod(index // int(doc["of"]), 8)
    if byte >= len(counted) or counted[byte] & (1 << bit):
        return None
    counted[byte] |= 1 << bit
    shards, failed, done, lost = doc.get("snapshot", [0, 0, 0, 0])
    snapshot = [shards + 1, failed + shard_failed, done + lines, lost + failed_lines]
    return {**doc, "counted": counted.hex(), "snapshot": snapshot}


def snapshot(stripe: dict[str, Any]) -> Snapshot:
    return list(stripe.get("snapshot", [0, 0, 0, 0]))


def stripe_complete(stripe: dict[str, Any]) -> bool:
    return snapshot(stripe)[0] >= int(stripe["size"])


def reports(stripe: dict[str, Any]) -> bool:
    """Whether a count that leaves ``stripe`` so folds it into the status: at each quarter of its
    shards and at its end (so the status's totals move in steps of about 1/(4K) of the job, and a
    count costs two requests fewer three times in four)."""
    size, counted = int(stripe["size"]), snapshot(stripe)[0]
    return counted >= size or counted % max(1, size // REPORTS) == 0


def fold(
    doc: dict[str, Any], k: int, snap: Snapshot, now: float | None = None
) -> dict[str, Any] | None:
    """Status ``doc`` with stripe ``k``'s snapshot in it; None if the status is final or already
    holds this snapshot or a later one (a stripe's counts only grow)."""
    if doc["state"] in FINAL or k >= len(doc["stripes"]) or doc["stripes"][k][0] >= snap[0]:
        return None
    stripes = [list(s) for s in doc["stripes"]]
    stripes[k] = list(snap)
    counted, failed, done_lines, failed_lines = (sum(col) for col in zip(*stripes, strict=True))
    now = time.time() if now is None else now
    elapsed = max(1e-3, now - float(doc["started_ts"]))
    left = doc["lines"]["total"] - done_lines
    return {
        **doc,
        "shards": {**doc["shards"], "done": counted - failed, "failed": failed},
        "lines": {**doc["lines"], "done": done_lines, "failed": failed_lines},
        "updated_at": _iso(now),
        "eta_s": round(left * elapsed / done_lines, 1) if done_lines else None,
        "stripes": stripes,
    }


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
    }


async def finish(s3: Any, bucket: str, keys: OutputKeys, summary: dict[str, Any]) -> None:
    """Write the final status (raises, so that the step that finishes the job is retried)."""
    await put_json(s3, bucket, status_key(keys), final(summary, keys))


async def start(s3: Any, bucket: str, key: str, doc: dict[str, Any]) -> bool:
    """Write the first status unless one exists (a redelivered split leaves it as it is). A status
    found here of another run of the same input (final, or started by another manifest: the input's
    outputs were deleted and it was sent again) is replaced. The caller then checks for the summary
    and, if the job is in fact finished, writes the final status again, so the last status written
    is always the true one. Whether this call wrote it (then it holds no count yet: the caller
    folds in the stripes that exist, :func:`recount`)."""
    if await put_new(s3, bucket, key, doc):
        return True
    got = await get_json(s3, bucket, key)
    if got is None:
        return False
    found, etag = got
    if found["state"] in FINAL or found.get("started_ts") != doc["started_ts"]:
        with contextlib.suppress(PreconditionFailed):
            await put_json(s3, bucket, key, doc, IfMatch=etag)
            return True
    return False


async def start_stripes(s3: Any, bucket: str, folder: JobFolder, manifest: Manifest) -> None:
    """Create the job's stripes that do not exist yet (before any shard message is sent: a shard
    that finds its stripe gone knows its job's folder went, and lists instead)."""
    await asyncio.gather(
        *(
            put_new(s3, bucket, folder.stripe(k), initial_stripe(manifest, k))
            for k in range(manifest.stripe_count)
        )
    )


async def recount(
    s3: Any, bucket: str, key: str, folder: JobFolder, manifest: Manifest
) -> dict[str, Any] | None:
    """Fold every stripe into a status just (re)written: a status that was gone while shards
    finished would otherwise never be complete, and no count would send the merge message."""
    got = await asyncio.gather(
        *(get_json(s3, bucket, folder.stripe(k)) for k in range(manifest.stripe_count))
    )
    snaps = [(k, snapshot(g[0])) for k, g in enumerate(got) if g is not None]

    def change(doc: dict[str, Any]) -> dict[str, Any] | None:
        changed = None
        for k, snap in snaps:
            changed = fold(changed or doc, k, snap) or changed
        return changed

    return await update(s3, bucket, key, change)


async def update(
    s3: Any,
    bucket: str,
    key: str,
    change: Callable[[dict[str, Any]], dict[str, Any] | None],
    tries: int = 25,
) -> dict[str, Any] | None:
    """Read, change, write back if unchanged meanwhile (else again); the object as it is after
    this call (changed by it, or already as wanted), None if there is none. A 412 (changed
    meanwhile) and a 409 (a concurrent write in flight) both read again. Raises
    :class:`Contended` when it cannot be written: a count decides who sends the merge message
    (:mod:`worker.fanout.runner`), so its message is retried rather than deleted uncounted."""
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
        except (PreconditionFailed, WriteConflict):
            await asyncio.sleep(random.uniform(0.01, 0.1))
            continue
        return new
    if tries > 1:
        log.warning("status.contended", key=key, tries=tries)
    raise Contended(f"the status {key} stayed contended for {tries} tries")


async def count(
    s3: Any, bucket: str, key: str, folder: JobFolder, manifest: Manifest, outcome: ShardOutcome
) -> bool | None:
    """Count a shard's outcome (see the module doc); whether this count is to send the merge
    message. None when its stripe is gone (the job's folder went: the caller lists instead)."""
    k = outcome.index % manifest.stripe_count
    stripe = await update(
        s3,
        bucket,
        folder.stripe(k),
        lambda d: count_in_stripe(
            d, outcome.index, outcome.lines, outcome.failed, outcome.state == "failed"
        ),
    )
    if stripe is None:
        return None
    snap = snapshot(stripe)
    if reports(stripe):
        with contextlib.suppress(Contended):  # progress alone: the stripe's next report carries it
            await update(s3, bucket, key, lambda d: fold(d, k, snap), tries=1)
    if not stripe_complete(stripe):
        return False
    if len(await finished(s3, bucket, folder)) < manifest.count:
        return False  # a stripe still counting: its last count lists again
    claim = {"shard": outcome.index}
    if await put_new(s3, bucket, folder.merge_claim, claim):
        return True
    got = await get_json(s3, bucket, folder.merge_claim)
    return got is None or got[0] == claim  # the claimer's own message back, or the folder went
