"""One shard's work: score its input into an output of this attempt's own, or, once it is out of
tries, write a ``shard_failed`` record for each of its lines. Either way the result is an
:class:`~worker.fanout.outcome.ShardOutcome` to publish; nothing here decides who wins.

**A shard whose decisions all raise.** While the engine has failed on every decision of the shard
so far, a try stops early and is retried, as the single path does at the start of a job: a broken
engine on one worker should not turn a shard into errors, and a retry may land on a healthy worker.
The shard's last allowed try never stops early: every line gets its own record, a result for those
that score and ``engine_failure`` for those that raise, exactly what the single path writes for such
lines (after its first success). So good lines are never turned into ``shard_failed``; only a shard
that cannot even be read, or whose last try did not finish, is.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import IO, Any

import structlog
from botocore.exceptions import ClientError

from arbiter.errors import EngineFailure
from arbiter.lines import Item, encode_record
from arbiter.schema import DecisionRequest
from arbiter.scorer import Scorer
from worker.fanout.frames import DamagedShard, unframe
from worker.fanout.keys import JobFolder
from worker.fanout.outcome import ShardOutcome
from worker.fanout.plan import Manifest, ShardSpan
from worker.formats import decode_items
from worker.jobs import JobRejected, Offload, raw_chunks, write_records
from worker.s3io import gone, upload_spool
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")


def _state_hash(request: DecisionRequest) -> str:
    text = json.dumps(request.state, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Runs:
    """Counts runs of consecutive decisions that share a state as a shard's items stream by."""

    def __init__(self) -> None:
        self.decisions = 0
        self.runs = 0
        self.first: str | None = None
        self._last: DecisionRequest | None = None

    async def watch(self, items: AsyncIterator[Item]) -> AsyncIterator[Item]:
        async for item in items:
            value = item.value
            if isinstance(value, DecisionRequest):
                if self._last is None:
                    self.first = _state_hash(value)
                if self._last is None or value.state != self._last.state:
                    self.runs += 1
                self._last = value
                self.decisions += 1
            yield item

    @property
    def last(self) -> str | None:
        return None if self._last is None else _state_hash(self._last)


def _worker() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


class ShardWork:
    """Scores shards, or fails them, for one worker (see the module doc)."""

    def __init__(
        self,
        settings: WorkerSettings,
        s3: Any,
        engine: Scorer,
        metrics: Any = None,
        run: Offload | None = None,
    ) -> None:
        self.settings, self.s3, self.engine = settings, s3, engine
        self.bucket = settings.bucket
        self.metrics, self.run = metrics, run

    async def _open(self, folder: JobFolder, manifest: Manifest, index: int) -> Any:
        key = folder.input(manifest.plan, index)
        try:
            return await self.s3.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if await gone(self.s3, self.bucket, key, exc):
                raise JobRejected(f"the shard input s3://{self.bucket}/{key} is gone") from exc
            raise

    async def score(
        self,
        folder: JobFolder,
        manifest: Manifest,
        span: ShardSpan,
        last_try: bool,
        wanted: Callable[[], Awaitable[bool]] | None = None,
    ) -> ShardOutcome | None:
        """Score the shard into this attempt's own output (see the module doc); None, with nothing
        written, if ``wanted()`` says after the scoring that the job no longer needs it (it ended
        meanwhile: a write into its folder now could outlive the clean-up)."""
        started = time.perf_counter()
        got = await self._open(folder, manifest, span.index)
        runs = _Runs()
        attempt = uuid.uuid4().hex[:12]
        output = folder.output(span.index, attempt)
        with tempfile.TemporaryFile(dir=self.settings.tmp_dir) as spool:
            async with got["Body"] as body:
                items = decode_items(unframe(raw_chunks(body)), manifest.kind)
                tally = await write_records(
                    self.engine,
                    runs.watch(items),
                    spool,
                    self.settings,
                    self.metrics,
                    self.run,
                    judge_engine=not last_try,
                )
            if tally.lines != span.items:
                raise DamagedShard(f"shard {span.index} has {tally.lines} items, not {span.items}")
            if wanted is not None and not await wanted():
                return None
            size = spool.tell()
            await upload_spool(self.s3, self.settings, output, spool)
        log.info("shard.scored", lines=tally.lines, failed=tally.failed, bytes=size)
        return ShardOutcome(
            index=span.index,
            state="done",
            attempt=attempt,
            output=output,
            bytes=size,
            lines=tally.lines,
            ok=tally.ok,
            failed=tally.failed,
            errors_by_code=dict(sorted(tally.codes.items())),
            abstained=tally.abstained,
            prompt_tokens=tally.prompt_tokens,
            engine_s=round(tally.engine_s, 4),
            seconds=round(time.perf_counter() - started, 4),
            decisions=runs.decisions,
            runs=runs.runs,
            first_state=runs.first,
            last_state=runs.last,
            model=self.engine.model_info.model_dump(mode="json"),
            worker=_worker(),
            at=datetime.now(UTC).isoformat(),
        )

    async def fail(
        self, folder: JobFolder, manifest: Manifest, span: ShardSpan, reason: str, receives: int
    ) -> ShardOutcome:
        """The shard will not be scored: a ``shard_failed`` record for each of its items, with its
        id when the input can still be read, from the plan's line range when it cannot."""
        log.error("shard.failed", error=reason, receives=receives)
        error = EngineFailure(
            f"shard {span.index} (lines {span.first}-{span.last}) failed: {reason}"[:2000],
            code="shard_failed",
        )
        attempt = uuid.uuid4().hex[:12]
        output = folder.output(span.index, attempt)
        with tempfile.TemporaryFile(dir=self.settings.tmp_dir) as spool:
            await self._failed_records(folder, manifest, span, error, spool)
            size = spool.tell()
            await upload_spool(self.s3, self.settings, output, spool)
        return ShardOutcome(
            index=span.index,
            state="failed",
            attempt=attempt,
            output=output,
            bytes=size,
            lines=span.items,
            ok=0,
            failed=span.items,
            errors_by_code={"shard_failed": span.items},
            worker=_worker(),
            error=reason[:2000],
            receives=receives,
            at=datetime.now(UTC).isoformat(),
        )

    async def _failed_records(
        self,
        folder: JobFolder,
        manifest: Manifest,
        span: ShardSpan,
        error: EngineFailure,
        spool: IO[bytes],
    ) -> None:
        try:
            got = await self._open(folder, manifest, span.index)
            written = 0
            async with got["Body"] as body:
                async for item in decode_items(unframe(raw_chunks(body)), manifest.kind):
                    spool.write(encode_record(item.line, item.id, error)[0])
                    written += 1
            if written == span.items:
                return
        except JobRejected as exc:  # gone or damaged: the plan still knows every line number
            log.error("shard.input_unreadable", shard=span.index, error=str(exc))
        spool.seek(0)
        spool.truncate()
        for number in span.numbers():
            spool.write(encode_record(number, None, error)[0])
