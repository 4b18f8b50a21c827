"""A job message: run a small job whole, split a large one, or repair one split before.

The job is located once (:func:`worker.jobs.locate`) and its input read once: the split reads it to
cut it, and a job it finds within one shard runs whole from what the split read
(:class:`~worker.fanout.split.Whole`); with splitting off, the job runs whole from S3.

Every receive of a job message ends the same way, whatever happened before it: the job's summary
exists (its end is made sure of, :meth:`~worker.fanout.merge.Merger.finalize`), or its manifest does
and every shard without an outcome has been sent a message (one merge message instead when none is
left). So a duplicate notification, a user's re-send, or the splitter's own message back after a
kill or a lost delete repairs the job, never drops it.

A splitter that finds, at its manifest write, another splitter's manifest (two copies of the
notification, or SQS's second delivery of one message, split at once) repairs too: it cannot know
that the other splitter's message will come back if it dies (the two may hold the same message, and
this one's delete removes it for both), so it sends the shard messages itself. Duplicates cost
receives that find their shard done, and at most one wave of duplicate scoring.
"""

from __future__ import annotations

import structlog

from worker.context import WorkerContext
from worker.events import JobRef
from worker.fanout import status
from worker.fanout.keys import JobFolder, job_folder
from worker.fanout.merge import Merger
from worker.fanout.messages import send_merge, send_shards
from worker.fanout.outcome import finished
from worker.fanout.plan import Manifest, read_manifest, write_manifest
from worker.fanout.split import Whole, split_input
from worker.jobs import (
    JobReport,
    Located,
    OutOfTries,
    Source,
    locate,
    run_located,
    s3_items,
)
from worker.s3io import delete_prefix, exists
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")

LAST_TRY = "its last allowed receive did not finish (the worker died or lost the message)"
SHARD_LINES_METADATA = "arbiter-shard-lines"  # x-amz-meta-arbiter-shard-lines: this job's own


def shard_lines_for(found: Located, settings: WorkerSettings) -> int:
    """The shard size of this job: its object's ``x-amz-meta-arbiter-shard-lines`` if that is a
    positive number (``arbiter submit --shard-lines``), else ``ARBITER_SHARD_LINES``."""
    value = found.head.get("Metadata", {}).get(SHARD_LINES_METADATA, "")
    return int(value) if value.isdigit() and int(value) > 0 else settings.shard_lines


class Splitter:
    """Handles job messages for one worker (see the module doc)."""

    def __init__(self, ctx: WorkerContext, merger: Merger) -> None:
        self.settings, self.s3, self.sqs, self.engine = ctx.settings, ctx.s3, ctx.sqs, ctx.engine
        self.bucket = ctx.settings.bucket
        self.queue_url, self.merger = ctx.queue.url, merger
        self.metrics, self.run_engine = ctx.metrics, ctx.run

    async def run(self, ref: JobRef, out_of_tries: bool = False) -> JobReport:
        """Handle a job message; ``out_of_tries``: its last try died, so only a repair (the job
        was split) is done, and a job that would run or split raises :class:`OutOfTries`."""
        found = await locate(self.s3, ref, self.settings)
        if isinstance(found, JobReport):
            if found.outcome == "duplicate" and found.keys and found.etag:
                folder = job_folder(self.settings, ref.bucket, ref.key, found.etag)
                await self.merger.finalize(found.keys, folder)
            return found
        folder = job_folder(self.settings, ref.bucket, ref.key, found.etag)
        manifest = await read_manifest(self.s3, self.bucket, folder)
        outcome = "repaired"
        if manifest is None and out_of_tries:
            raise OutOfTries(f"s3://{ref.bucket}/{ref.key}: {LAST_TRY}")
        if manifest is None:
            shard_lines = shard_lines_for(found, self.settings)
            if shard_lines <= 0:  # never split: read once, from S3
                return await self._whole(found, s3_items(self.s3, found, self.settings))
            cut = await split_input(self.s3, found, folder, self.settings, shard_lines)
            if isinstance(cut, Whole):
                try:
                    return await self._whole(found, cut.items)
                finally:
                    cut.close()
            manifest, mine = await write_manifest(self.s3, self.bucket, folder, cut)
            if manifest.plan != cut.plan:  # another plan counts: this one's inputs are not needed
                await delete_prefix(self.s3, self.bucket, folder.plan_prefix(cut.plan))
            outcome = "split" if mine else "repaired"
        sent = await self._send(ref, found, folder, manifest)
        if sent is None:
            return JobReport("duplicate", ref, found.keys, etag=found.etag)
        log.info(
            f"job.{outcome}",
            shards=manifest.count,
            lines=manifest.items,
            plan=manifest.plan,
            sent=sent,
            runs_kept_whole=manifest.runs_kept_whole,
            runs_cut=manifest.runs_cut,
        )
        summary = {"lines": manifest.items, "shards": manifest.count, "sent": sent}
        return JobReport(outcome, ref, found.keys, summary, etag=found.etag)

    async def _whole(self, found: Located, source: Source) -> JobReport:
        return await run_located(
            self.s3, self.engine, found, source, self.settings, self.metrics, self.run_engine
        )

    async def _send(
        self, ref: JobRef, found: Located, folder: JobFolder, manifest: Manifest
    ) -> str | None:
        """Start the status, then send what the job still needs (see the module doc); what was
        sent, or None if the job turned out to be finished (a late splitter: its end is run)."""
        keys = found.keys
        key = status.status_key(keys)
        wrote = await status.start(self.s3, self.bucket, key, status.initial(manifest, keys))
        await status.start_stripes(self.s3, self.bucket, folder, manifest)
        if await exists(self.s3, self.bucket, keys.summary):
            await self.merger.finalize(keys, folder)
            return None
        # Listed after the status was written: an outcome written before is in the listing and
        # counted here; one written after finds the status and counts itself.
        done = await finished(self.s3, self.bucket, folder)
        if wrote and done:  # a status that was gone (or another run's), rebuilt from the stripes
            await status.recount(self.s3, self.bucket, key, folder, manifest)
            log.warning("status.rebuilt", shards=len(done), of=manifest.count)
        if len(done) >= manifest.count:
            await send_merge(self.sqs, self.queue_url, manifest)
            return "merge"
        pending = [i for i in range(manifest.count) if i not in done]
        await send_shards(self.sqs, self.queue_url, manifest, pending)
        return f"{len(pending)} shards"
