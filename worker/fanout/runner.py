"""What a worker does with each fan-out message: a job (:mod:`.job`), a shard, or a merge.

**A shard message.** If the shard has an outcome, nothing is scored. Otherwise, unless its job is
finished: within the worker's own tries it is scored (:mod:`.shard`) and its outcome published
(:mod:`.outcome`); past them (its last try died: a kill, an OOM, a lost lease) it is failed without
running, cheaply, so the job still finishes with its summary saying why. Then, whatever happened,
the worker lists the outcomes: if every shard has one, it sends a merge message; and if the job's
summary exists by now, it runs the job's end (a write that came after the clean-up is cleaned up
too). Only then is the message deleted.

**A merge message** merges (:mod:`.merge`), or, if the summary exists, makes sure of the job's end.
Its retries are its own message's; a merge that fails never spends a shard's tries.
"""

from __future__ import annotations

import asyncio

import structlog

from worker.context import WorkerContext
from worker.events import JobRef, MergeRef, ShardRef
from worker.fanout import status
from worker.fanout.job import LAST_TRY, Splitter
from worker.fanout.keys import JobFolder, job_folder
from worker.fanout.merge import Merger
from worker.fanout.messages import send_merge
from worker.fanout.outcome import ShardOutcome, finished, publish, read_outcome
from worker.fanout.plan import Manifest, ManifestCache, ShardSpan, read_manifest
from worker.fanout.shard import ShardWork
from worker.faults import classify, describe
from worker.jobs import JobRejected, JobReport, LastTryMayRun
from worker.outputs import OutputKeys, output_keys
from worker.s3io import exists
from worker.tries import Receive

log = structlog.get_logger("arbiter.worker")


class FanOut:
    """Runs job, shard and merge references for one worker (see the module doc)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.settings = settings = ctx.settings
        self.bucket = settings.bucket
        self.s3, self.sqs = ctx.s3, ctx.sqs
        self.queue_url, self.tries, self.dlq_url = ctx.queue.url, ctx.tries, ctx.queue.dlq_url
        self.metrics = ctx.metrics
        self.manifests = ManifestCache()
        self.merger = Merger(ctx.s3, settings, ctx.metrics, ctx.sqs, ctx.queue.dlq_url)
        self.work = ShardWork(settings, ctx.s3, ctx.engine, ctx.metrics, ctx.run)
        self.splitter = Splitter(ctx, self.merger)

    async def run(
        self, ref: JobRef | ShardRef | MergeRef, receive: Receive | None = None
    ) -> JobReport:
        """Run ``ref`` as this ``receive`` of its message (None: a first receive)."""
        receive = receive or Receive(1)
        if isinstance(ref, ShardRef):
            with structlog.contextvars.bound_contextvars(shard=ref.index, shards=ref.count):
                return await self.shard(ref, receive)
        if isinstance(ref, MergeRef):
            with structlog.contextvars.bound_contextvars(merge=True):
                return await self.merge(ref)
        out_of_tries = self.tries is not None and self.tries.past(receive.count)
        return await self.splitter.run(ref, out_of_tries)

    def _where(self, ref: ShardRef | MergeRef) -> tuple[JobRef, JobFolder, OutputKeys]:
        job = JobRef(ref.bucket, ref.key, ref.etag)
        folder = job_folder(self.settings, ref.bucket, ref.key, ref.etag)
        return job, folder, output_keys(self.settings, ref.key, ref.etag)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.shards.labels(outcome).inc()

    async def _ended(self, keys: OutputKeys, folder: JobFolder) -> bool:
        """If the job's summary exists, make sure of its end; whether it did."""
        if not await exists(self.s3, self.bucket, keys.summary):
            return False
        await self.merger.finalize(keys, folder)
        return True

    async def _manifest(self, ref: ShardRef | MergeRef, folder: JobFolder) -> Manifest | None:
        return await self.manifests.get(self.s3, self.bucket, folder, ref.plan)

    # -- shards ------------------------------------------------------------------------------------

    async def shard(self, ref: ShardRef, receive: Receive) -> JobReport:
        job, folder, keys = self._where(ref)
        manifest = await self._manifest(ref, folder)
        if manifest is None or ref.index >= manifest.count:
            return await self._gone(job, folder, keys, f"shard {ref.index}")
        span = manifest.shards[ref.index]
        outcome = await read_outcome(self.s3, self.bucket, folder, ref.index)
        if outcome is not None:
            self._count("duplicate")
        elif await self._ended(keys, folder):
            self._count("duplicate")
            return JobReport("shard", job, keys)
        else:
            settled = await self._settle(folder, keys, manifest, span, receive)
            if settled is None:  # the job ended while this shard was scored or failed
                await self.merger.finalize(keys, folder)
                self._count("duplicate")
                return JobReport("shard", job, keys)
            outcome = settled
        # After this worker's write: a summary found now means the clean-up may have missed it.
        if await self._ended(keys, folder):
            return JobReport("shard", job, keys)
        if await self._completes(folder, keys, manifest, outcome):
            await send_merge(self.sqs, self.queue_url, manifest)
        return JobReport("shard", job, keys)

    async def _completes(
        self, folder: JobFolder, keys: OutputKeys, manifest: Manifest, outcome: ShardOutcome
    ) -> bool:
        """Count the shard in its status stripe (:mod:`.status`); whether this count completed
        the job. The swaps are serial, so one count completes it and one worker sends the merge
        message, not every one that finished near the end. A shard message is deleted only once
        counted, so every outcome is counted in the end (a count repeated is a no-op that finds
        the status complete: a duplicate merge message, harmless). With no status or stripe
        (deleted, or final), the outcomes are listed instead."""
        try:
            done = await status.count(
                self.s3, self.bucket, status.status_key(keys), folder, manifest, outcome
            )
        except Exception:
            # Not counted: if every outcome exists already, the merge is sent anyway; else the
            # message comes back and counts again (a count must land for the last one to see it).
            if len(await finished(self.s3, self.bucket, folder)) >= manifest.count:
                return True
            raise
        if done is None:
            done = len(await finished(self.s3, self.bucket, folder)) >= manifest.count
        return done

    async def _settle(
        self,
        folder: JobFolder,
        keys: OutputKeys,
        manifest: Manifest,
        span: ShardSpan,
        receive: Receive,
    ) -> ShardOutcome | None:
        """Score or fail the shard and publish its outcome; the outcome that counts, or None if the
        job ended while the shard was scored or failed (nothing of this attempt is kept then)."""

        async def wanted() -> bool:
            return not await exists(self.s3, self.bucket, keys.summary)

        count = receive.count
        last = self.tries is not None and self.tries.last(count)
        if self.tries is not None and self.tries.past(count):
            if receive.reason is None and self.tries.first_past(count):
                # Past the tries is not proof that the last one died: SQS may have shown the
                # message again (a second delivery, or a slow holder's lapsed visibility) while it
                # still runs. The next receive, if the last try does not finish, fails it (fuzz
                # seed 2048: a second delivery failed a shard whose last try was scoring it).
                raise LastTryMayRun(f"shard {span.index}: its last try may still be running")
            outcome = await self.work.fail(
                folder, manifest, span, receive.reason or LAST_TRY, count
            )
        else:
            try:
                scored = await self.work.score(folder, manifest, span, last, wanted)
                if scored is None:
                    return None
                outcome = scored
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Only the shard's own failure gives it up, on its last try (a store or queue
                # fault is retried without spending one: worker.faults); an input that is gone
                # or damaged, at once.
                if not (isinstance(exc, JobRejected) or (last and classify(exc).counts)):
                    raise
                outcome = await self.work.fail(folder, manifest, span, describe(exc), count)
        published = await publish(self.s3, self.bucket, folder, outcome)
        if published is None:  # the job ended while this shard was scored or failed
            return None
        counted, mine = published
        if not mine:
            self._count("duplicate")
            return counted
        self._count("failed" if counted.state == "failed" else "ok")
        log.info("shard.done", state=counted.state, lines=counted.lines, failed=counted.failed)
        return counted

    async def _gone(self, job: JobRef, folder: JobFolder, keys: OutputKeys, what: str) -> JobReport:
        if await self._ended(keys, folder):
            self._count("duplicate")  # the job is done and its folder deleted
            return JobReport("shard", job, keys)
        raise JobRejected(
            f"{what} of s3://{job.bucket}/{job.key}: its job's manifest is gone (the job's folder "
            "was deleted or expired); re-send the job's notification to run it again"
        )

    # -- merges ------------------------------------------------------------------------------------

    async def merge(self, ref: MergeRef) -> JobReport:
        job, folder, keys = self._where(ref)
        if await self._ended(keys, folder):
            return JobReport("duplicate", job, keys)
        # Read afresh, not from the cache: a re-run of the same input (its outputs deleted, its
        # notification re-sent) has the same plan but its own manifest, and the summary's times
        # are the manifest's (a cached one put the first run's into a re-run's summary).
        manifest = await read_manifest(self.s3, self.bucket, folder)
        if manifest is None or manifest.plan != ref.plan:
            return await self._gone(job, folder, keys, "the merge")
        summary = await self.merger.merge(manifest, keys, folder)
        return JobReport("merged", job, keys, summary)
