"""`arbiter check-fanout`: run a small split job on a deployed stack and verify what it left.

What moto cannot prove (IAM, real S3's conditional writes, real SQS redelivery) is checked on the
stack itself, in one command: a generated job of ``--lines`` decisions (and two bad lines) is
uploaded with ``x-amz-meta-arbiter-shard-lines`` so that it splits into shards of
``--shard-lines`` whatever the workers' ``ARBITER_SHARD_LINES``; once its summary exists the check
reads back, with the caller's credentials:

- one record per line, in input order, each with its id; results and summary written once (when
  the bucket is versioned: one version of each);
- the summary's counts equal the results'; its shards as many as the plan; none failed;
- the status object final (``done``);
- nothing left under the job's shard folder, and no multipart upload under it or the results key;
- the dead-letter queue's depth, before and after (it should not grow).

The check's objects are deleted afterwards unless ``--keep``. Exit status 0 when everything holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from worker.fanout.keys import job_folder
from worker.fanout.status import status_key
from worker.outputs import output_keys
from worker.s3io import get_bytes
from worker.settings import WorkerSettings

BAD_LINES = (b"{not json", b'{"id": 7}')


def check_job(lines: int) -> bytes:
    """``lines`` decisions, three per state, and two bad lines a third and two thirds in."""
    out = []
    for i in range(lines):
        decision = {
            "id": f"check-{i}",
            "state": f"Check ticket {i // 3}: the customer cannot log in after a reset.",
            "question": "Which queue should handle it?",
            "options": [
                {"id": "access", "description": "Account access"},
                {"id": "billing", "description": "Billing and invoices"},
            ],
        }
        out.append(json.dumps(decision).encode())
    for k, bad in enumerate(BAD_LINES):
        out.insert((k + 1) * len(out) // 3, bad)
    return b"\n".join(out) + b"\n"


async def _versions(s3: Any, bucket: str, key: str) -> int | None:
    status = await s3.get_bucket_versioning(Bucket=bucket)
    if status.get("Status") != "Enabled":
        return None
    got = await s3.list_object_versions(Bucket=bucket, Prefix=key)
    return sum(1 for v in got.get("Versions", []) if v["Key"] == key)


async def _dlq_depth(sqs: Any, settings: WorkerSettings) -> int | None:
    """The depth of the job queue's dead-letter queue (found from its redrive policy, as the
    workers find it); None if it cannot be read."""
    from worker.replies import describe_queue

    try:
        queue = await describe_queue(sqs, settings)
        if queue.dlq_url is None:
            return None
        got = await sqs.get_queue_attributes(
            QueueUrl=queue.dlq_url, AttributeNames=["ApproximateNumberOfMessages"]
        )
    except Exception:  # not allowed to read it: reported as unknown
        return None
    return int(got["Attributes"]["ApproximateNumberOfMessages"])


async def verify(
    s3: Any, settings: WorkerSettings, key: str, etag: str, lines: int, shard_lines: int
) -> list[tuple[str, bool, str]]:
    """Each check: (what, held, detail)."""
    keys = output_keys(settings, key, etag)
    checks: list[tuple[str, bool, str]] = []
    got = await get_bytes(s3, settings.bucket, keys.results)
    records = [json.loads(x) for x in (got[0] if got else b"").splitlines() if x.strip()]
    total = lines + len(BAD_LINES)
    in_order = [r["line"] for r in records] == list(range(1, total + 1))
    checks.append(("one record per line, in order", in_order, f"{len(records)} of {total}"))
    ids = [r["id"] for r in records if "result" in r]
    checks.append(
        ("every decision scored, with its id", ids == [f"check-{i}" for i in range(lines)], "")
    )
    summary_got = await get_json_doc(s3, settings.bucket, keys.summary)
    summary = summary_got or {}
    codes = Counter(r["error"]["code"] for r in records if "error" in r)
    tally = (len(records), sum("result" in r for r in records), dict(codes))
    said = (summary.get("lines"), summary.get("ok"), summary.get("errors_by_code"))
    checks.append(("the summary's counts equal the results'", said == tally, f"{said} vs {tally}"))
    shards = summary.get("shards", {})
    expected = -(-lines // shard_lines)
    count_ok = bool(shards) and abs(int(shards.get("count", 0)) - expected) <= 1
    checks.append(("split into shards", count_ok, f"{shards.get('count')} (about {expected})"))
    checks.append(("no shard failed", shards.get("failed") == [], f"{shards.get('failed')}"))
    doc = await get_json_doc(s3, settings.bucket, status_key(keys))
    state = (doc or {}).get("state")
    checks.append(("the status is final", state == "done", f"state {state}"))
    folder = job_folder(settings, settings.bucket, key, etag)
    left = await s3.list_objects_v2(Bucket=settings.bucket, Prefix=folder.base, MaxKeys=10)
    checks.append(("nothing left in the shard folder", not left.get("Contents"), folder.base))
    uploads = []
    for prefix in (keys.results, folder.base):
        page = await s3.list_multipart_uploads(Bucket=settings.bucket, Prefix=prefix)
        uploads += [u["Key"] for u in page.get("Uploads", [])]
    checks.append(("no multipart upload left", not uploads, ", ".join(uploads)))
    for name, object_key in (("results", keys.results), ("summary", keys.summary)):
        n = await _versions(s3, settings.bucket, object_key)
        if n is not None:
            checks.append((f"the {name} written once", n == 1, f"{n} versions"))
    return checks


async def get_json_doc(s3: Any, bucket: str, key: str) -> dict[str, Any] | None:
    got = await get_bytes(s3, bucket, key)
    return None if got is None else dict(json.loads(got[0]))


async def check_fanout(
    settings: WorkerSettings,
    lines: int = 240,
    shard_lines: int = 40,
    timeout_s: float = 1800,
    keep: bool = False,
    progress: bool = True,
) -> tuple[bool, list[tuple[str, bool, str]]]:
    """Run the check (see the module doc); whether everything held, and each check."""
    from aiobotocore.session import get_session

    from worker.submit import submit

    key = f"{settings.input_prefix}arbiter-check/{uuid.uuid4().hex[:12]}.jsonl"
    session = get_session()
    async with (
        session.create_client("s3", **settings.client_kwargs()) as s3,
        session.create_client("sqs", **settings.client_kwargs()) as sqs,
    ):
        dead_before = await _dlq_depth(sqs, settings)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "check.jsonl"
            path.write_bytes(check_job(lines))
            started = time.monotonic()
            summary = await submit(
                settings,
                path,
                key=key,
                timeout_s=timeout_s,
                progress=progress,
                shard_lines=shard_lines,
            )
        if summary is None:
            return False, [("the job finished", False, f"no summary after {timeout_s:.0f} s")]
        etag = summary["input"]["etag"]
        checks = [("the job finished", True, f"{time.monotonic() - started:.1f} s")]
        checks += await verify(s3, settings, key, etag, lines, shard_lines)
        dead_after = await _dlq_depth(sqs, settings)
        if dead_before is not None and dead_after is not None:
            grew = dead_after - dead_before
            checks.append(("the dead-letter queue did not grow", grew <= 0, f"{grew:+d}"))
        if not keep:
            keys = output_keys(settings, key, etag)
            for doomed in (key, keys.results, keys.summary, status_key(keys)):
                await s3.delete_object(Bucket=settings.bucket, Key=doomed)
    return all(held for _, held, _ in checks), checks


def cmd_check_fanout(args: argparse.Namespace) -> int:
    settings = WorkerSettings()
    ok, checks = asyncio.run(
        check_fanout(settings, args.lines, args.shard_lines, args.timeout, args.keep)
    )
    for what, held, detail in checks:
        print(f"{'ok  ' if held else 'FAIL'}  {what}{f'  ({detail})' if detail else ''}")
    print("the fan-out works on this stack" if ok else "the fan-out check FAILED")
    return 0 if ok else 1
