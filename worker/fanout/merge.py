"""The merge of a split job, and its end: exactly one results object and one summary, on S3 alone.

A merge message is sent by whoever saw every shard with an outcome; any worker merges. There is no
claim: every object the merge writes is a function of the outcomes, which never change, so two
merges at once (two workers saw the last outcome; a message came back after its worker died) write
equal things and the first write of each wins:

1. **Results.** One multipart upload of the shards' outputs in shard order (:mod:`.parts`),
   completed with ``If-None-Match: *``. A 412, or a results object found first, means an equal one
   exists; this merge's upload is aborted.
2. **Summary**, with ``If-None-Match: *``; a 412 means an equal one exists.
3. **The end** (:meth:`Merger.finalize`), run by whoever finds the summary (this merge, a shard or
   job message that comes back, a duplicate merge): the final status, every multipart upload under
   the results key and the job's folder aborted (a worker killed between creating an upload and
   completing or aborting it), the folder deleted. Each of these is a plain repeatable step.

A merge that fails is retried with its own message's receives and backoff, never a shard's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog

from worker.fanout import status
from worker.fanout.keys import JobFolder
from worker.fanout.outcome import Outcome, read_all
from worker.fanout.parts import S3_MIN_PART, MiB, Part, plan_upload
from worker.fanout.plan import Manifest
from worker.fanout.summary import build_summary
from worker.jobs import JobFailed, OutputKeys, raw_chunks
from worker.s3io import abort_uploads, complete_upload, delete_prefix, exists, get_json, put_new
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")

PART_CONCURRENCY = 2  # parts in flight: at most this many times (part size + 5 MiB) in memory


class Merger:
    """Merges split jobs and ends them, for one worker (see the module doc)."""

    def __init__(self, s3: Any, settings: WorkerSettings, metrics: Any = None) -> None:
        self.s3 = s3
        self.settings = settings
        self.bucket = settings.bucket
        self.metrics = metrics

    async def merge(
        self, manifest: Manifest, keys: OutputKeys, folder: JobFolder
    ) -> dict[str, Any]:
        """Write the results and the summary unless they exist, then end the job; the summary."""
        started = time.perf_counter()
        outcomes = await read_all(self.s3, self.bucket, folder, manifest)
        stats: dict[str, Any] = {"reused_results": True}
        if not await exists(self.s3, self.bucket, keys.results):
            stats = await self._results(keys, outcomes)
        stats["seconds"] = round(time.perf_counter() - started, 4)
        summary = build_summary(manifest, keys, outcomes, stats)
        if await put_new(self.s3, self.bucket, keys.summary, summary):
            log.info("merge.summary_written", shards=manifest.count, lines=summary["lines"])
            if self.metrics is not None:
                self.metrics.merges.labels("ok").inc()
                self.metrics.merge_seconds.observe(stats["seconds"])
        else:
            summary = await self._summary(keys) or summary  # another merge's, equal in its counts
        await self.finalize(keys, folder, summary)
        return summary

    async def _summary(self, keys: OutputKeys) -> dict[str, Any] | None:
        got = await get_json(self.s3, self.bucket, keys.summary)
        return None if got is None else dict(got[0])

    async def finalize(
        self, keys: OutputKeys, folder: JobFolder, summary: dict[str, Any] | None = None
    ) -> None:
        """End a job whose summary exists (see the module doc); every step may run again."""
        summary = summary or await self._summary(keys)
        if summary is None:
            return
        if "shards" in summary:
            await status.finish(self.s3, self.bucket, keys, summary)
        await abort_uploads(self.s3, self.bucket, keys.results, exact=True)
        await abort_uploads(self.s3, self.bucket, folder.base)
        deleted = await delete_prefix(self.s3, self.bucket, folder.base)
        if deleted:
            log.info("merge.cleaned", prefix=folder.base, objects=deleted)

    # -- the results -------------------------------------------------------------------------------

    async def _results(self, keys: OutputKeys, outcomes: list[Outcome]) -> dict[str, Any]:
        target = max(S3_MIN_PART, int(self.settings.part_size_mb * MiB))
        plan = plan_upload([o.bytes for o in outcomes], [True] * len(outcomes), target)
        upload = await self.s3.create_multipart_upload(
            Bucket=self.bucket, Key=keys.results, ContentType="application/x-ndjson"
        )
        upload_id = upload["UploadId"]
        written = False
        try:
            gate = asyncio.Semaphore(PART_CONCURRENCY)

            async def one(number: int, part: Part) -> dict[str, Any]:
                async with gate:
                    return await self._put_part(keys.results, upload_id, number, part, outcomes)

            parts = await asyncio.gather(*(one(n, p) for n, p in enumerate(plan, start=1)))
            written = await complete_upload(
                self.s3, self.bucket, keys.results, upload_id, list(parts), {"IfNoneMatch": "*"}
            )
        finally:
            if not written:
                with contextlib.suppress(Exception):  # else aborted by finalize
                    await asyncio.shield(
                        self.s3.abort_multipart_upload(
                            Bucket=self.bucket, Key=keys.results, UploadId=upload_id
                        )
                    )
        if not written:
            log.info("merge.results_written_by_another", key=keys.results)
        copied = [p for p in plan if p.copy]
        return {
            "reused_results": not written,
            "parts": len(plan),
            "copied_parts": len(copied),
            "copied_bytes": sum(p.size for p in copied),
            "joined_bytes": sum(p.size for p in plan if not p.copy),
        }

    async def _read_into(self, data: bytearray, outcome: Outcome, start: int, end: int) -> None:
        """Append bytes ``start``..``end`` of a shard's output to ``data``, read in pieces."""
        got = await self.s3.get_object(
            Bucket=self.bucket, Key=outcome.output, Range=f"bytes={start}-{end - 1}"
        )
        before = len(data)
        async with got["Body"] as body:
            async for chunk in raw_chunks(body):
                data += chunk
        if len(data) - before != end - start:
            raise JobFailed(f"{outcome.output} is shorter than its outcome says")

    async def _put_part(
        self, key: str, upload_id: str, number: int, part: Part, outcomes: list[Outcome]
    ) -> dict[str, Any]:
        common = {"Bucket": self.bucket, "Key": key, "UploadId": upload_id, "PartNumber": number}
        if part.copy:
            [piece] = part.pieces
            copied = await self.s3.upload_part_copy(
                **common,
                CopySource={"Bucket": self.bucket, "Key": outcomes[piece.segment].output},
                CopySourceRange=f"bytes={piece.start}-{piece.end - 1}",
            )
            return {"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]}
        data = bytearray()
        for piece in part.pieces:  # several small pieces in one part: fetched in turn
            await self._read_into(data, outcomes[piece.segment], piece.start, piece.end)
        body = bytes(data)  # as the single path's parts (aiohttp takes a large bytearray badly)
        del data
        uploaded = await self.s3.upload_part(**common, Body=body)
        return {"PartNumber": number, "ETag": uploaded["ETag"]}
