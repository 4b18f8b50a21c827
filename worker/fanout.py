"""What a worker does with a job or shard message: run a small job whole, split a large one, score a
shard, and merge when the last shard is done.

**A job message.** If the input already has a manifest, it was split before (this is a duplicate, or
the splitter died before every shard message was sent: the shards not yet finished are sent again).
Otherwise the input is read once as raw lines; if it ends within the first shard's lines, the job
runs whole as it always did (:func:`worker.jobs.run_job`); if not, it is split
(:func:`worker.shards.split_job`), one message per shard goes on the job queue, and the job message is
deleted only after that.

**A shard message.** Any worker scores the shard: its input is read, scored in chunks as a whole job
is, and its records are written to an output object of this attempt's own, then the done marker
(``If-None-Match: *``: one attempt wins; a loser deletes its output). A shard is the unit of retry,
heartbeat and backoff like a job; when its last allowed receive fails too, it is marked failed (and
its message copied to the dead-letter queue), so the job still finishes, its summary naming the
shard and why. Then the worker lists the markers and, if every shard is finished, merges
(:mod:`worker.merge`); the message is deleted only once the summary exists.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from botocore.exceptions import ClientError

from arbiter.schema import DecisionRequest
from arbiter.scorer import Scorer
from worker import status
from worker.events import JobRef, ShardRef, UnreadableMessage, parse_message
from worker.formats import Item, decode_items
from worker.jobs import (
    JobRejected,
    JobReport,
    Runner,
    exists,
    is_missing,
    locate,
    output_keys,
    raw_chunks,
    run_job,
    upload_spool,
    write_records,
)
from worker.merge import Merger
from worker.policies import goes_to_dlq
from worker.settings import WorkerSettings
from worker.shards import (
    DamagedShard,
    Manifest,
    PreconditionFailed,
    ShardKeys,
    ShardSpan,
    delete_quietly,
    enqueue_shards,
    finished_shards,
    put_json,
    read_manifest,
    shard_keys,
    shard_message,
    split_job,
    unframe,
)

log = structlog.get_logger("arbiter.worker")


@dataclass(frozen=True)
class Delivery:
    """The SQS message a reference came in: its id (stable across redeliveries) and this receive's
    number among its tries."""

    message_id: str | None = None
    receive_count: int = 1


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


class FanOut:
    """Runs job and shard references for one worker (see the module doc)."""

    def __init__(
        self,
        settings: WorkerSettings,
        s3: Any,
        sqs: Any,
        engine: Scorer,
        queue_url: str,
        max_receive_count: int | None = None,
        dlq_url: str | None = None,
        metrics: Any = None,
        run: Runner | None = None,
    ) -> None:
        self.settings = settings
        self.bucket = settings.bucket
        self.s3, self.sqs, self.engine = s3, sqs, engine
        self.queue_url = queue_url
        self.max_receive_count = max_receive_count
        self.dlq_url = dlq_url
        self.metrics = metrics
        self.run_engine = run
        self.merger = Merger(s3, settings, metrics)
        self._manifests: dict[str, Manifest] = {}

    async def run(self, ref: JobRef | ShardRef, delivery: Delivery | None = None) -> JobReport:
        delivery = delivery or Delivery()
        if isinstance(ref, ShardRef):
            return await self.shard(ref, delivery)
        return await self.job(ref)

    # -- job messages ------------------------------------------------------------------------------

    async def job(self, ref: JobRef) -> JobReport:
        found = await locate(self.s3, ref, self.settings)
        if isinstance(found, JobReport):
            return found
        skeys = shard_keys(self.settings, ref.key, found.etag)
        manifest = await read_manifest(self.s3, self.bucket, skeys)
        if manifest is None:
            if self.settings.shard_lines == 0:
                return await self._whole(ref)
            split = await split_job(self.s3, ref, found, skeys, self.settings)
            if split is None:
                return await self._whole(ref)
            if not split.mine:
                return JobReport("duplicate", ref, found.keys)
            manifest = split.manifest
            pending = list(range(manifest.count))
        else:
            if await exists(self.s3, self.bucket, skeys.enqueued):
                return JobReport("duplicate", ref, found.keys)
            done, failed = await finished_shards(self.s3, self.bucket, skeys)
            pending = [i for i in range(manifest.count) if i not in done | failed]
        await status.start(
            self.s3,
            self.bucket,
            status.status_key(found.keys),
            status.initial(manifest, found.keys),
        )
        await enqueue_shards(self.sqs, self.queue_url, manifest, pending)
        await put_json(
            self.s3,
            self.bucket,
            skeys.enqueued,
            {"shards": manifest.count, "sent": len(pending), "at": datetime.now(UTC).isoformat()},
        )
        log.info(
            "job.split",
            shards=manifest.count,
            lines=manifest.items,
            sent=len(pending),
            runs_kept_whole=manifest.runs_kept_whole,
            runs_cut=manifest.runs_cut,
        )
        return JobReport(
            "split", ref, found.keys, {"lines": manifest.items, "shards": manifest.count}
        )

    async def _whole(self, ref: JobRef) -> JobReport:
        return await run_job(
            self.s3, self.engine, ref, self.settings, self.metrics, self.run_engine
        )

    # -- shard messages ----------------------------------------------------------------------------

    async def _manifest(self, skeys: ShardKeys) -> Manifest | None:
        manifest = self._manifests.get(skeys.base)
        if manifest is None:
            manifest = await read_manifest(self.s3, self.bucket, skeys)
            if manifest is not None:
                if len(self._manifests) >= 64:
                    self._manifests.pop(next(iter(self._manifests)))
                self._manifests[skeys.base] = manifest
        return manifest

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.shards.labels(outcome).inc()

    async def shard(self, ref: ShardRef, delivery: Delivery) -> JobReport:
        job = JobRef(ref.bucket, ref.key, ref.etag)
        keys = output_keys(self.settings, ref.key, ref.etag)
        skeys = shard_keys(self.settings, ref.key, ref.etag)
        where = f"shard {ref.index} of s3://{ref.bucket}/{ref.key}"
        with structlog.contextvars.bound_contextvars(shard=ref.index, shards=ref.count):
            manifest = await self._manifest(skeys)
            if manifest is None:
                if await exists(self.s3, self.bucket, keys.summary):
                    self._count("duplicate")  # the job is done and its shard folder deleted
                    return JobReport("shard", job, keys)
                raise JobRejected(f"{where}: its job's manifest is gone")
            if manifest.split != ref.split or ref.index >= manifest.count:
                log.warning("shard.stale", split=ref.split, current=manifest.split)
                self._count("stale")
                return JobReport("shard", job, keys)
            span = manifest.shards[ref.index]
            if await exists(self.s3, self.bucket, keys.summary):
                self._count("duplicate")  # a copy, or a deferred message back after the merge
                await self.merger.merge(keys, skeys, manifest, delivery.message_id)  # cleans up
                return JobReport("shard", job, keys)
            if await exists(self.s3, self.bucket, skeys.done(ref.index)) or await exists(
                self.s3, self.bucket, skeys.failed(ref.index)
            ):
                self._count("duplicate")
            else:
                self._count(await self._score(ref, keys, skeys, manifest, span, delivery))
            done, failed = await finished_shards(self.s3, self.bucket, skeys)
            if len(done | failed) < manifest.count:
                return JobReport("shard", job, keys)
            summary = await self.merger.merge(keys, skeys, manifest, delivery.message_id)
            if summary is None:
                return JobReport("shard", job, keys)
            return JobReport("merged", job, keys, summary)

    async def _score(
        self,
        ref: ShardRef,
        keys: Any,
        skeys: ShardKeys,
        manifest: Manifest,
        span: ShardSpan,
        delivery: Delivery,
    ) -> str:
        """Score the shard; its outcome (ok, duplicate: another attempt won, failed: for good)."""
        try:
            marker = await self._score_shard(ref, keys, skeys, manifest, span)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            permanent = isinstance(exc, JobRejected)
            if not permanent and not goes_to_dlq(delivery.receive_count, self.max_receive_count):
                raise  # retried with backoff, like a job
            if await exists(self.s3, self.bucket, keys.summary):
                return "duplicate"
            reason = f"{type(exc).__name__}: {exc}"
            await self._mark_failed(ref, skeys, manifest, span, reason, delivery.receive_count)
            return "failed"
        if marker is None:
            return "duplicate"
        await status.update(
            self.s3,
            self.bucket,
            status.status_key(keys),
            lambda doc: status.count_shard(
                doc, span.index, marker["lines"], marker["failed"], False
            ),
        )
        return "ok"

    async def _score_shard(
        self, ref: ShardRef, keys: Any, skeys: ShardKeys, manifest: Manifest, span: ShardSpan
    ) -> dict[str, Any] | None:
        """Score and publish one shard: its output, then its done marker; None if another attempt
        (or the finished job) got there first."""
        started = time.perf_counter()
        key = skeys.input(manifest.split, span.index)
        try:
            got = await self.s3.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if is_missing(exc):
                raise JobRejected(f"the shard input s3://{self.bucket}/{key} is gone") from exc
            raise
        runs = _Runs()
        with tempfile.TemporaryFile(dir=self.settings.tmp_dir) as spool:
            async with got["Body"] as body:
                items = decode_items(unframe(raw_chunks(body)), manifest.kind)
                tally = await write_records(
                    self.engine,
                    runs.watch(items),
                    spool,
                    self.settings,
                    self.metrics,
                    self.run_engine,
                )
            if tally.lines != span.items:
                raise DamagedShard(f"shard {span.index} has {tally.lines} items, not {span.items}")
            if await exists(self.s3, self.bucket, keys.summary):
                return None  # the job finished without this attempt
            output = skeys.output(span.index, uuid.uuid4().hex[:12])
            size = spool.tell()
            await upload_spool(self.s3, self.settings, output, spool)
        marker = {
            "index": span.index,
            "output": output,
            "bytes": size,
            "lines": tally.lines,
            "ok": tally.ok,
            "failed": tally.failed,
            "errors_by_code": dict(sorted(tally.codes.items())),
            "prompt_tokens": tally.prompt_tokens,
            "engine_s": round(tally.engine_s, 4),
            "seconds": round(time.perf_counter() - started, 4),
            "decisions": runs.decisions,
            "runs": runs.runs,
            "first_state": runs.first,
            "last_state": runs.last,
            "model": self.engine.model_info.model_dump(mode="json"),
            "worker": {"host": socket.gethostname(), "pid": os.getpid()},
            "finished_at": datetime.now(UTC).isoformat(),
        }
        try:
            await put_json(self.s3, self.bucket, skeys.done(span.index), marker, IfNoneMatch="*")
        except PreconditionFailed:
            await delete_quietly(self.s3, self.bucket, output)
            return None
        log.info("shard.done", lines=tally.lines, failed=tally.failed, bytes=size)
        return marker

    async def give_up(self, body: str, reason: str, receives: int) -> None:
        """A shard message's last allowed receive failed where :meth:`_score` could not see it (its
        lease was lost: SQS's 12 h limit, a refused extension): mark the shard failed and send its
        message once more, so that a worker finds its job complete and merges it. Anything else
        (a job message, a shard of a finished job) is left to the dead-letter queue alone."""
        try:
            [ref] = parse_message(body, bucket=self.bucket, input_prefix=self.settings.input_prefix)
        except (UnreadableMessage, ValueError):
            return
        if not isinstance(ref, ShardRef):
            return
        skeys = shard_keys(self.settings, ref.key, ref.etag)
        manifest = await self._manifest(skeys)
        if manifest is None or manifest.split != ref.split or ref.index >= manifest.count:
            return
        span = manifest.shards[ref.index]
        if await exists(self.s3, self.bucket, skeys.done(ref.index)):
            return
        if await self._mark_failed(ref, skeys, manifest, span, reason, receives, copy=False):
            await self.sqs.send_message(QueueUrl=self.queue_url, MessageBody=body)

    async def _mark_failed(
        self,
        ref: ShardRef,
        skeys: ShardKeys,
        manifest: Manifest,
        span: ShardSpan,
        reason: str,
        receives: int,
        copy: bool = True,
    ) -> bool:
        """Shard ``span`` will not be scored: say why, so the job can finish and its summary tell;
        ``copy``: its message to the dead-letter queue too. False if it was marked already."""
        log.error("shard.failed", error=reason, receives=receives)
        marker = {
            "index": span.index,
            "error": reason[:2000],
            "receives": receives,
            "worker": {"host": socket.gethostname(), "pid": os.getpid()},
            "at": datetime.now(UTC).isoformat(),
        }
        try:
            await put_json(self.s3, self.bucket, skeys.failed(span.index), marker, IfNoneMatch="*")
        except PreconditionFailed:
            return False
        if copy and self.dlq_url:
            await self.sqs.send_message(
                QueueUrl=self.dlq_url, MessageBody=shard_message(manifest, span.index)
            )
            if self.metrics is not None:
                self.metrics.dlq_moves.labels("shard_failed").inc()
        await status.update(
            self.s3,
            self.bucket,
            status.status_key(output_keys(self.settings, ref.key, ref.etag)),
            lambda doc: status.count_shard(doc, span.index, span.items, span.items, True),
        )
        return True
