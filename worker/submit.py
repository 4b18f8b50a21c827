"""`arbiter submit`: drop a job file into the input prefix and wait for its summary."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from aiobotocore.session import get_session
from botocore.exceptions import ClientError

from worker.events import normalize_etag
from worker.jobs import output_keys
from worker.settings import WorkerSettings


async def submit(
    settings: WorkerSettings, path: Path, *, key: str | None = None, timeout_s: float = 900.0
) -> dict[str, Any] | None:
    """Upload ``path``; return the job's summary once written, or None after ``timeout_s``."""
    key = key or f"{settings.input_prefix}{path.name}"
    async with get_session().create_client("s3", **settings.client_kwargs()) as s3:
        data = await asyncio.to_thread(path.read_bytes)
        put = await s3.put_object(Bucket=settings.bucket, Key=key, Body=data)
        etag = normalize_etag(put["ETag"]) or ""
        keys = output_keys(settings, key, etag)
        print(f"submitted s3://{settings.bucket}/{key} (etag {etag})", file=sys.stderr)
        print(f"waiting for s3://{settings.bucket}/{keys.summary}", file=sys.stderr)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                got = await s3.get_object(Bucket=settings.bucket, Key=keys.summary)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in {"NoSuchKey", "404"}:
                    raise
                await asyncio.sleep(0.5)
                continue
            async with got["Body"] as body:
                summary: dict[str, Any] = json.loads(await body.read())
            return summary
    return None
