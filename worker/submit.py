"""`arbiter submit`: drop a job file into the input prefix and wait for its summary.

Every job shows its progress meanwhile: a bar on stderr, "queued" until a worker takes it, then
read from the job's status object (lines done and failed; shards too for a split job). On a stderr
that is no terminal (a log, CI) the bar's repainted frames would pile up, so it is a line per
change there, at most one every ``LOG_EVERY_S``, the last always. A file the
worker would ignore (not ``.jsonl``/``.json``, optionally ``.gz``) is refused before anything is
uploaded, and an unchanged file, whose summary exists from an earlier run, is said to be that.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiobotocore.session import get_session
from botocore.exceptions import ClientError
from tqdm import tqdm

from arbiter.errors import ArbiterError
from worker.events import ignored, normalize_etag
from worker.fanout.job import SHARD_LINES_METADATA
from worker.fanout.status import status_key
from worker.outputs import output_keys
from worker.s3io import get_json, gone
from worker.settings import WorkerSettings

LOG_EVERY_S = 5.0


def _postfix(doc: dict[str, Any]) -> str:
    shards, failed = doc["shards"], doc["lines"]["failed"]
    split = f"{shards['done'] + shards['failed']}/{shards['total']} shards"
    parts = (split if shards["total"] > 1 else "", f"{failed} lines failed" if failed else "")
    return ", ".join(p for p in parts if p)


class _Bar:
    """A tqdm bar on a terminal, repainted in place."""

    def __init__(self, total: int | None) -> None:
        self._bar = tqdm(desc="queued", unit="line", file=sys.stderr, total=total)

    def show(self, doc: dict[str, Any] | None) -> None:
        if doc is not None:
            self._bar.set_description_str("lines")
            self._bar.total = doc["lines"]["total"] or self._bar.total
            self._bar.update(doc["lines"]["done"] - self._bar.n)  # the rate: lines while watched
            self._bar.set_postfix_str(_postfix(doc))
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


class _Lines:
    """What the bar says, as a line per change: at most one every ``LOG_EVERY_S`` (a change
    within it waits, only the newest), the last one always, at :meth:`close`."""

    def __init__(self, total: int | None) -> None:
        self._total = total  # the file's own count: a whole job's status has none
        self._said = ""
        self._at = -LOG_EVERY_S
        self._pending: str | None = None
        self._say(f"queued ({total} lines)" if total else "queued")

    def show(self, doc: dict[str, Any] | None) -> None:
        if doc is not None:
            done, total = doc["lines"]["done"], doc["lines"]["total"] or self._total
            postfix = _postfix(doc)
            self._say(f"lines {done}/{total or '?'}" + (f" ({postfix})" if postfix else ""))

    def _say(self, text: str) -> None:
        self._pending = None if text == self._said else text
        if self._pending is not None and time.monotonic() - self._at >= LOG_EVERY_S:
            self._write()

    def _write(self) -> None:
        assert self._pending is not None
        print(f"arbiter submit: {self._pending}", file=sys.stderr, flush=True)
        self._said, self._pending, self._at = self._pending, None, time.monotonic()

    def close(self) -> None:
        if self._pending is not None:
            self._write()


def count_lines(path: Path) -> int | None:
    """The decisions in a job file, for the bar's total (None when it cannot tell cheaply)."""
    import gzip

    try:
        opener: Any = gzip.open if path.name.endswith(".gz") else open
        if path.name.removesuffix(".gz").endswith(".jsonl"):
            with opener(path, "rb") as source:
                return sum(1 for line in source if line.strip())
        with opener(path, "rb") as source:
            decisions = json.load(source).get("decisions")
        return len(decisions) if isinstance(decisions, list) else None
    except (OSError, ValueError, AttributeError, EOFError):
        return None


def refusal(settings: WorkerSettings, key: str) -> str | None:
    """Why this submission cannot become a job (the worker would ignore it), or None."""
    why = ignored(settings.bucket, key, settings.bucket, settings.input_prefix)
    if why is None:
        return None
    return f"the worker ignores it: {why}; name a job file (or pass --key)"


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
    refused = refusal(settings, key)
    if refused is not None:
        raise ArbiterError(f"refused: {refused}")
    bar: _Bar | _Lines | None = None
    total = await asyncio.to_thread(count_lines, path) if progress else None
    async with get_session().create_client("s3", **settings.client_kwargs()) as s3:
        data = await asyncio.to_thread(path.read_bytes)
        sent_at = datetime.now(UTC)
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
            if progress:
                bar = _Bar(total) if sys.stderr.isatty() else _Lines(total)
            while time.monotonic() < deadline:
                got = await get_json(s3, settings.bucket, keys.summary)
                if got is not None:
                    summary: dict[str, Any] = got[0]
                    await _say_if_earlier(
                        s3, settings.bucket, keys.summary, uploaded, sent_at, summary
                    )
                    if bar is not None:
                        final = await get_json(s3, settings.bucket, status_key(keys))
                        lines = {
                            "total": summary["lines"],
                            "done": summary["lines"],
                            "failed": summary.get("failed", 0),
                        }
                        last = {"shards": {"total": 1, "done": 1, "failed": 0}, "lines": lines}
                        # a split job's final status; a whole one's is gone with its run
                        bar.show(final[0] if final is not None else last)
                    return summary
                rejected = await _rejection(s3, settings.bucket, keys.rejected, uploaded)
                if rejected is not None:
                    return rejected
                if bar is not None:
                    doc = await get_json(s3, settings.bucket, status_key(keys))
                    bar.show(doc[0] if doc is not None else None)
                await asyncio.sleep(0.5)
        finally:
            if bar is not None:
                bar.close()
    return None


async def _say_if_earlier(
    s3: Any, bucket: str, key: str, uploaded: Any, sent_at: datetime, summary: dict[str, Any]
) -> None:
    """An unchanged file has the same ETag, so its summary is an earlier run's: say so. S3 dates
    objects to the second; within the upload's second, the summary's own time decides."""
    head = await s3.head_object(Bucket=bucket, Key=key)
    written = head["LastModified"]
    same_second = written == uploaded
    try:
        finished = datetime.fromisoformat(str(summary.get("finished_at")))
    except ValueError:
        finished = None
    if written < uploaded or (same_second and finished is not None and finished < sent_at):
        print(
            f"arbiter submit: this file is unchanged since an earlier run (same ETag): the summary "
            f"is that run's, finished at {summary.get('finished_at', '?')}; nothing was run again "
            "(change the file, or its --key, to run it anew)",
            file=sys.stderr,
        )
