"""`arbiter submit`: drop a job file into the input prefix and wait for its summary.

A job large enough to be split into shards shows its progress meanwhile: a bar on stderr, read
from the job's status object (shards and lines done, lines failed, ETA).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from aiobotocore.session import get_session
from botocore.exceptions import ClientError
from tqdm import tqdm

from worker.events import normalize_etag
from worker.fanout.job import SHARD_LINES_METADATA
from worker.fanout.status import status_key
from worker.jobs import output_keys
from worker.s3io import get_json, gone
from worker.settings import WorkerSettings


def _show(bar: tqdm[Any], doc: dict[str, Any]) -> None:
    shards = doc["shards"]
    bar.total = doc["lines"]["total"]
    bar.update(doc["lines"]["done"] - bar.n)  # the rate counts lines done while watched
    failed = f", {doc['lines']['failed']} lines failed" if doc["lines"]["failed"] else ""
    bar.set_postfix_str(f"{shards['done'] + shards['failed']}/{shards['total']} shards{failed}")


async def _rejection(s3: Any, bucket: str, key: str, uploaded: Any) -> dict[str, Any] | None:
    """The job's rejection record (worker/jobs.py, write_rejection) if it is this upload's."""
    try:
        got = await s3.get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if await gone(s3, bucket, key, exc):  # as get_json: a 403 of a scoped role, resolved
            return None
        raise
    if got["LastModified"] < uploaded:
        return None
    async with got["Body"] as body:
        record: dict[str, Any] = json.loads(await body.read())
    return record


async def submit(
    settings: WorkerSettings,
    path: Path,
    *,
    key: str | None = None,
    timeout_s: float = 900.0,
    progress: bool = True,
    shard_lines: int | None = None,
) -> dict[str, Any] | None:
    """Upload ``path``; return the job's summary once written (or its rejection record, with a
    ``rejected`` reason, if the workers refused it), or None after ``timeout_s``.
    ``shard_lines``: this job's shard size (``x-amz-meta-arbiter-shard-lines``), else the workers'."""
    key = key or f"{settings.input_prefix}{path.name}"
    bar: tqdm[Any] | None = None
    async with get_session().create_client("s3", **settings.client_kwargs()) as s3:
        data = await asyncio.to_thread(path.read_bytes)
        meta = {SHARD_LINES_METADATA: str(shard_lines)} if shard_lines else {}
        put = await s3.put_object(Bucket=settings.bucket, Key=key, Body=data, Metadata=meta)
        etag = normalize_etag(put["ETag"]) or ""
        # S3's clock, not ours: a rejection record older than this upload is an earlier run's.
        uploaded = (await s3.head_object(Bucket=settings.bucket, Key=key))["LastModified"]
        keys = output_keys(settings, key, etag)
        print(f"submitted s3://{settings.bucket}/{key} (etag {etag})", file=sys.stderr)
        print(f"waiting for s3://{settings.bucket}/{keys.summary}", file=sys.stderr)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                got = await get_json(s3, settings.bucket, keys.summary)
                if got is not None:
                    summary: dict[str, Any] = got[0]
                    if bar is not None:
                        final = await get_json(s3, settings.bucket, status_key(keys))
                        if final is not None:
                            _show(bar, final[0])
                        bar.refresh()
                    return summary
                refused = await _rejection(s3, settings.bucket, keys.rejected, uploaded)
                if refused is not None:
                    return refused
                if progress:
                    doc = await get_json(s3, settings.bucket, status_key(keys))
                    if doc is not None:
                        bar = bar or tqdm(
                            desc="lines",
                            unit="line",
                            file=sys.stderr,
                            initial=doc[0]["lines"]["done"],
                            total=doc[0]["lines"]["total"],
                        )
                        _show(bar, doc[0])
                        bar.refresh()
                await asyncio.sleep(0.5)
        finally:
            if bar is not None:
                bar.close()
    return None
