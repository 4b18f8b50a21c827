"""The progress of a job run whole (not split): the same status object a split job keeps.

`arbiter submit` showed progress only for a split job (over 1,000 lines): a smaller one was a
silent wait. A job run whole now writes ``<...>.status.json`` (the shape of
:mod:`worker.fanout.status`'s, one "shard") when it starts and after a chunk at most every
``EVERY_S``, and deletes it when the run ends, however it ends: what a finished job leaves is its
results and summary (or its rejection), as before. Progress is never worth a job: a write that
fails is logged and the job goes on.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import structlog

from worker.s3io import put_json

log = structlog.get_logger("arbiter.worker")
EVERY_S = 2.0


class Progress:
    """Called with the lines done and failed so far; writes at most every ``every_s``."""

    def __init__(self, s3: Any, bucket: str, key: str, every_s: float | None = None) -> None:
        self.s3, self.bucket, self.key = s3, bucket, key
        self.every_s = EVERY_S if every_s is None else every_s
        self.started = datetime.now(UTC).isoformat()
        self.written_at: float | None = None

    async def __call__(self, done: int, failed: int) -> None:
        now = time.monotonic()
        if self.written_at is not None and now - self.written_at < self.every_s:
            return
        self.written_at = now
        doc = {
            "state": "running",
            "shards": {"total": 1, "done": 0, "failed": 0},
            "lines": {"total": None, "done": done, "failed": failed},
            "started_at": self.started,
            "updated_at": datetime.now(UTC).isoformat(),
        }
        try:
            await put_json(self.s3, self.bucket, self.key, doc)
        except Exception as exc:
            log.warning("job.progress_not_written", key=self.key, error=repr(exc))

    async def clear(self) -> None:
        if self.written_at is None:
            return
        try:
            await self.s3.delete_object(Bucket=self.bucket, Key=self.key)
        except Exception as exc:
            log.warning("job.progress_not_cleared", key=self.key, error=repr(exc))
