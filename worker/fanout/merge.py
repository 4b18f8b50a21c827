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
   job message that comes back, a duplicate merge): one dead-letter record per failed shard the
   summary lists (:mod:`.deadletters`), the final status, every multipart upload under the results
   key and the job's folder aborted (a worker killed between creating an upload and completing or
   aborting it), the folder deleted. Each of these is a repeatable step.

A merge that fails is retried with its own message's receives and backoff, never a shard's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import structlog

from worker.fanout import status
from worker.fanout.deadletters import DeadLetters
from worker.fanout.keys import JobFolder
from worker.fanout.outcome import ShardOutcome, read_all
from worker.fanout.parts import S3_MIN_PART, MiB, Part, Piece, plan_upload
from worker.fanout.plan import Manifest
from worker.fanout.summary import ResultsTally, build_summary, outcomes_digest
from worker.jobs import JobFailed, raw_chunks
from worker.outputs import OutputKeys
from worker.s3io import abort_uploads, complete_upload, delete_prefix, exists, get_json, put_new
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")

OUTCOMES_METADATA = "arbiter-outcomes"  # x-amz-meta-arbiter-outcomes: what the results are made of
PART_CONCURRENCY = 2  # parts in flight: at most this many times (part size + 5 MiB) in memory
PIECE_CONCURRENCY = 8  # ranged GETs in flight for one joined part (its bytes are in memory anyway)


class Merger:
    """Merges split jobs and ends them, for one worker (see the module doc)."""

    def __init__(
        self,
        s3: Any,
        settings: WorkerSettings,
        metrics: Any = None,
        sqs: Any = None,
        dlq_url: str | None = None,
    ) -> None:
        self.s3 = s3
        self.settings = settings
        self.bucket = settings.bucket
        self.metrics = metrics
        stale = float(settings.visibility_timeout_s)
        self.dead_letters = DeadLetters(s3, sqs, self.bucket, dlq_url, stale, metrics)

    async def merge(
        self, manifest: Manifest, keys: OutputKeys, folder: JobFolder
    ) -> dict[str, Any]:
        """Write the results and the summary unless they exist, then end the job; the summary."""
        started = time.perf_counter()
        outcomes = await read_all(self.s3, self.bucket, folder, manifest)
        digest = outcomes_digest(outcomes)
        stats: dict[str, Any] = {"reused_results": True}
        if not await exists(self.s3, self.bucket, keys.results):
            stats = await self._results(keys, outcomes, digest)
        stats["seconds"] = round(time.perf_counter() - started, 4)
        summary = build_summary(manifest, keys, outcomes, stats)
        if stats["reused_results"] and not await self._made_of(keys, digest):
            summary = await self._describe_results(keys, manifest, summary)
        if await put_new(self.s3, self.bucket, keys.summary, summary):
            log.info("merge.summary_written", shards=manifest.count, lines=summary["lines"])
            if self.metrics is not None:
                self.metrics.merges.labels("ok").inc()
                self.metrics.merge_seconds.observe(stats["seconds"])
        else:
            summary = await self._summary(keys) or summary  # another merge's, equal in its counts
        await self.finalize(keys, folder, summary)
        return summary

    async def _made_of(self, keys: OutputKeys, digest: str) -> bool:
        """Whether the results object that exists was made of the outcomes of this digest."""
        head = await self.s3.head_object(Bucket=self.bucket, Key=keys.results)
        return bool(head.get("Metadata", {}).get(OUTCOMES_METADATA) == digest)

    async def _describe_results(
        self, keys: OutputKeys, manifest: Manifest, summary: dict[str, Any]
    ) -> dict[str, Any]:
        """The summary of a results object made of other outcomes (another run's): its counts
        read from its records, so the summary says what the results hold."""
        tally = ResultsTally(manifest)
        got = await self.s3.get_object(Bucket=self.bucket, Key=keys.results)
        buf = b""
        async with got["Body"] as body:
            async for chunk in raw_chunks(body):
                *whole, buf = (buf + chunk).split(b"\n")
                for line in whole:
                    if line.strip():
                        tally.add(json.loads(line))
        if buf.strip():
            tally.add(json.loads(buf))
        log.warning("merge.results_of_another_run", key=keys.results, lines=tally.lines)
        return tally.apply(summary)

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
            await self.dead_letters.send(keys, summary)
            await status.finish(self.s3, self.bucket, keys, summary)
        await abort_uploads(self.s3, self.bucket, keys.results, exact=True)
        await abort_uploads(self.s3, self.bucket, folder.base)
        deleted = await delete_prefix(self.s3, self.bucket, folder.base)
        if deleted:
            log.info("merge.cleaned", prefix=folder.base, objects=deleted)

    # -- the results -------------------------------------------------------------------------------

    async def _results(
        self, keys: OutputKeys, outcomes: list[ShardOutcome], digest: str
    ) -> dict[str, Any]:
        target = max(S3_MIN_PART, int(self.settings.part_size_mb * MiB))
        plan = plan_upload([o.bytes for o in outcomes], [True] * len(outcomes), target)
        upload = await self.s3.create_multipart_upload(
            Bucket=self.bucket,
            Key=keys.results,
            ContentType="application/x-ndjson",
            Metadata={OUTCOMES_METADATA: digest},
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

    async def _read(self, outcome: ShardOutcome, start: int, end: int) -> bytearray:
        """Bytes ``start``..``end`` of a shard's output, read in pieces."""
        got = await self.s3.get_object(
            Bucket=self.bucket, Key=outcome.output, Range=f"bytes={start}-{end - 1}"
        )
        data = bytearray()
        async with got["Body"] as body:
            async for chunk in raw_chunks(body):
                data += chunk
        if len(data) != end - start:
            raise JobFailed(f"{outcome.output} is shorter than its outcome says")
        return data

    async def _put_part(
        self, key: str, upload_id: str, number: int, part: Part, outcomes: list[ShardOutcome]
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
        # Several small pieces in one part: fetched PIECE_CONCURRENCY at a time (one at a time,
        # each ranged GET's round trip was the merge's pace: ~10 a part of 0.8 MB outputs).
        gate = asyncio.Semaphore(PIECE_CONCURRENCY)

        async def fetch(piece: Piece) -> bytearray:
            async with gate:
                return await self._read(outcomes[piece.segment], piece.start, piece.end)

        pieces = await asyncio.gather(*(fetch(p) for p in part.pieces))
        body = b"".join(pieces)  # bytes, as the single path's (aiohttp takes a bytearray badly)
        del pieces
        uploaded = await self.s3.upload_part(**common, Body=body)
        return {"PartNumber": number, "ETag": uploaded["ETag"]}
