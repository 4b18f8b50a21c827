"""What must hold once a fleet has worked through its jobs, whatever faults it met: each a sentence
of the exactly-once argument (docs/batch-jobs.md), checked on the bucket and the queues (direct
clients, not the proxy). :func:`violations` returns what does not hold, empty when all does."""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus

from tests.aws import read_object, receive_all
from tests.worker.fanout_support import pending, stripped
from worker.formats import items_for
from worker.jobs import JobFailed, write_records
from worker.outputs import output_keys
from worker.settings import WorkerSettings


@dataclass
class Job:
    """One input dropped in the bucket, and what the single path makes of it."""

    key: str
    etag: str
    body: bytes
    expected: list[dict[str, Any]] | None  # the single path's records; None if it fails the job
    numbers: list[int]  # every input line (or element) number, in order


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), 4096):
        yield data[start : start + 4096]


async def single_path_records(
    key: str, body: bytes, settings: WorkerSettings, engine: Any
) -> tuple[list[dict[str, Any]] | None, list[int]]:
    """The records the single path writes for ``body`` (None if it fails the job), and the item
    numbers the input holds (read again without an engine)."""
    numbers = [item.line async for item in items_for(key, _chunks(body), settings.max_line_bytes)]
    out = io.BytesIO()
    try:
        items = items_for(key, _chunks(body), settings.max_line_bytes)
        await write_records(engine, items, out, settings)
    except JobFailed:
        return None, numbers
    return stripped(out.getvalue()), numbers


async def _versions(s3: Any, bucket: str, key: str) -> int:
    got = await s3.list_object_versions(Bucket=bucket, Prefix=key)
    return sum(1 for v in got.get("Versions", []) if v["Key"] == key)


def _tally(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    codes = Counter(r["error"]["code"] for r in records if "error" in r)
    ok = sum(1 for r in records if "result" in r)
    return {"lines": len(records), "ok": ok, "failed": len(records) - ok, "codes": dict(codes)}


async def job_violations(
    s3: Any, settings: WorkerSettings, job: Job
) -> tuple[list[str], set[tuple[str, int]]]:
    """What does not hold for one job; and its failed shards, as (key, index)."""
    bad: list[str] = []
    keys = output_keys(settings, job.key, job.etag)
    where = job.key
    written = (
        await _versions(s3, settings.bucket, keys.results),
        await _versions(s3, settings.bucket, keys.summary),
    )
    if written != (1, 1):
        return [f"{where}: results and summary written {written} times, not (1, 1)"], set()
    records = stripped(await read_object(s3, settings.bucket, keys.results))
    summary = json.loads(await read_object(s3, settings.bucket, keys.summary))
    lines = [r["line"] for r in records]
    if lines != job.numbers:
        bad.append(f"{where}: lines {lines[:20]}... are not every input line once, in order")
    failed_spans = [
        (f["first_line"], f["last_line"]) for f in summary.get("shards", {}).get("failed", [])
    ]
    failed_shards = {(job.key, f["index"]) for f in summary.get("shards", {}).get("failed", [])}
    if job.expected is not None and lines == job.numbers:
        for got, want in zip(records, job.expected, strict=True):
            in_failed = any(a <= got["line"] <= b for a, b in failed_spans)
            if in_failed:
                if got.get("error", {}).get("code") != "shard_failed":
                    bad.append(f"{where}: line {got['line']} of a failed shard is {got}")
            elif got != want:
                bad.append(f"{where}: line {got['line']} is {got}, the single path wrote {want}")
                break
    tally = _tally(records)
    said = {
        "lines": summary["lines"],
        "ok": summary["ok"],
        "failed": summary["failed"],
        "codes": summary["errors_by_code"],
    }
    if said != tally:
        bad.append(f"{where}: the summary says {said}, the results hold {tally}")
    if "shards" in summary:
        status_key = keys.summary.removesuffix("summary.json") + "status.json"
        got_status = json.loads(await read_object(s3, settings.bucket, status_key))
        want_state = "failed" if failed_spans else "done"
        seen = (got_status["state"], got_status["lines"])
        want = (
            want_state,
            {"total": tally["lines"], "done": tally["lines"], "failed": tally["failed"]},
        )
        if seen != want:
            bad.append(f"{where}: the status is {seen}, not {want}")
    return bad, failed_shards


async def violations(
    s3: Any,
    sqs: Any,
    stack: dict[str, str],
    settings: WorkerSettings,
    jobs: Sequence[Job],
    dead_letters: list[dict[str, Any]] | None = None,
    duplicate_records: bool = False,
    rejected: Sequence[str] = (),
    redriven: Callable[[Sequence[str]], list[str]] | None = None,
) -> list[str]:
    """Every job finished once, line for line; nothing left behind; the DLQ holds exactly one
    record per shard that truly failed (its lines ``shard_failed`` and counted) and nothing else.
    ``dead_letters`` collects the DLQ's messages; ``duplicate_records``: a worker was killed right
    after sending a record (the one way a record comes twice, worker/fanout/deadletters.py);
    ``rejected``: keys of jobs that must be rejected, whose notifications the DLQ holds;
    ``redriven``: of the DLQ's message IDs, those SQS's redrive moved there after the deletes of
    a message whose work was done failed (:func:`redriven_messages`); not held against the run,
    since every job above must still check out (docs/fanout.md says why this is left)."""
    bad: list[str] = []
    failed: set[tuple[str, int]] = set()
    for job in jobs:
        found, shards = await job_violations(s3, settings, job)
        bad += found
        failed |= shards
    left = await s3.list_objects_v2(Bucket=settings.bucket, Prefix=settings.shard_prefix)
    if left.get("Contents"):
        bad.append(f"shard objects left: {[o['Key'] for o in left['Contents']][:5]}")
    uploads = await s3.list_multipart_uploads(Bucket=settings.bucket)
    if uploads.get("Uploads"):
        bad.append(f"multipart uploads left: {[u['Key'] for u in uploads['Uploads']][:5]}")
    if await pending(sqs, stack["queue_url"]):
        left_messages = await receive_all(sqs, stack["queue_url"], wait=1)
        bodies = [m["Body"][:160] for m in left_messages]
        bad.append(f"messages left on the job queue: {bodies}")
    dead = []
    for _ in range(5):
        got = await receive_all(sqs, stack["dlq_url"], wait=0)
        if not got:
            break
        dead += got
    if redriven is not None:
        moved = set(redriven([m["MessageId"] for m in dead]))
        dead = [m for m in dead if m["MessageId"] not in moved]
    bodies = [json.loads(m["Body"]) for m in dead]
    if dead_letters is not None:
        dead_letters += bodies
    return bad + _dead_letter_violations(bodies, failed, duplicate_records, rejected)


def _dead_letter_violations(
    dead: list[dict[str, Any]],
    failed: set[tuple[str, int]],
    duplicate_records: bool,
    rejected: Sequence[str],
) -> list[str]:
    """One record per failed shard, the rejected jobs' notifications, and nothing else."""
    bad = []
    copies: Counter[tuple[str, int]] = Counter()
    refused = set()
    for body in dead:
        if (key := _notified(body)) in rejected:
            refused.add(key)
            continue
        copy = (body.get("key"), body.get("index"))
        if "arbiter_shard" not in body or copy not in failed:
            bad.append(f"the DLQ holds {json.dumps(body)[:200]}")
        copies[copy] += 1
    if failed - set(copies):
        bad.append(f"failed shards without a DLQ record: {sorted(failed - set(copies))}")
    if set(rejected) - refused:
        bad.append(f"rejected jobs not in the DLQ: {sorted(set(rejected) - refused)}")
    twice = sorted(c for c, n in copies.items() if n > 1)
    if twice and not duplicate_records:
        bad.append(f"failed shards with more than one DLQ record: {twice}")
    return bad


def _notified(body: dict[str, Any]) -> str | None:
    """The key an S3 notification names (decoded), if ``body`` is one."""
    records = body.get("Records") or [{}]
    key = records[0].get("s3", {}).get("object", {}).get("key")
    return unquote_plus(key) if isinstance(key, str) else None


def redriven_messages(
    received: dict[str, str], deletes: dict[str, list[str]], dlq_ids: Sequence[str]
) -> list[str]:
    """Of the DLQ's message IDs, those SQS's redrive moved (a message the workers received: what
    they send there is a new message) though the workers did their part: every receive of it
    (``received``: receipt handle -> message ID) answered with a delete (``deletes``: receipt
    handle -> the proxy's actions on its deletes), one of them at least refused, failed or lost.
    A worker that leaves any receive undeleted is still caught."""
    moved = []
    for message in dlq_ids:
        receipts = [r for r, m in received.items() if m == message]
        answered = bool(receipts) and all(deletes.get(r) for r in receipts)
        if answered and any(a != "forward" for r in receipts for a in deletes[r]):
            moved.append(message)
    return moved


def records_may_repeat(log: Sequence[tuple[int, str, str, str]], dlq_name: str) -> bool:
    """Whether a run's faults can have sent a dead-letter record twice (the proxy's log of the
    requests it did not just forward): a send to the DLQ duplicated, its answer lost or its worker
    killed around it, or a worker killed before marking the records sent (the one way a record
    comes twice, worker/fanout/deadletters.py; a refused send commits nothing)."""
    for _, op, key, action in log:
        to_dlq = op.startswith("SendMessage") and key.endswith(f"/{dlq_name}")
        if to_dlq and not action.startswith("fail_"):
            return True
        if key.endswith("dead-letters.json") and action.startswith("kill"):
            return True
    return False
