"""The merge of a split job: exactly one ordered results object, on S3 alone.

Whoever finishes a shard lists the shard markers; whoever finds them all tries to merge:

1. **Claim.** ``merge.json`` is created with ``If-None-Match: *``; it names its owner, the SQS message
   the owner merges for, the multipart upload it is writing, and an expiry that the owner renews
   every third of ``ARBITER_MERGE_CLAIM_TTL_S`` (``If-Match`` on its ETag). A claim that expired (a
   quarter of the TTL is allowed for clocks), or whose message has come back to another worker (SQS
   only redelivers a message its holder stopped renewing), is taken over with ``If-Match`` on the
   ETag read: one taker wins. Any other finder raises :class:`Deferred`: its message is sent again
   later, without counting as a failed receive, so it is not deleted before the job is done.
2. **Results.** One multipart upload of the shard outputs in shard order: an output of at least
   5 MiB is copied inside S3 (``UploadPartCopy``, with a byte range when it also tops up the part
   before it); smaller ones are downloaded and joined into parts of ``ARBITER_PART_SIZE_MB``
   (S3 refuses a part under 5 MiB unless it is the last). It is completed with
   ``If-None-Match: *``, so the results object is written once whoever merges, however many do.
3. **Summary**, last, with ``If-None-Match: *``: its existence marks the job done, as for one worker.
4. The status says done (or failed); the shard folder is deleted.

Each step looks at what exists first, so a merger killed at any point is followed by one that
finishes the job: the message it held comes back, or a deferred one does, and takes the claim over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

import structlog
from botocore.exceptions import ClientError

from arbiter.errors import EngineFailure
from arbiter.schema import DecisionRequest
from worker import status
from worker.formats import decode_items
from worker.jobs import JobFailed, OutputKeys, exists, is_missing, raw_chunks
from worker.lease import stop_together
from worker.settings import WorkerSettings
from worker.shards import (
    Manifest,
    PreconditionFailed,
    ShardKeys,
    ShardSpan,
    delete_prefix,
    get_json,
    is_precondition_failed,
    put_json,
    unframe,
)

log = structlog.get_logger("arbiter.worker")

MiB = 1024 * 1024
S3_MIN_PART = 5 * MiB  # every part but the last (UploadPart and UploadPartCopy alike)
S3_MAX_COPY = 5 * 1024 * MiB  # the largest part UploadPartCopy takes
S3_MAX_PARTS = 10_000
PART_CONCURRENCY = 2  # parts in flight: at most this many times (part size + 5 MiB) in memory
OWNER = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Deferred(Exception):
    """Nothing failed, but the message's work is not over: look at it again in ``seconds``."""

    def __init__(self, seconds: float, reason: str) -> None:
        super().__init__(reason)
        self.seconds = int(min(900, max(1, seconds)))  # SQS's DelaySeconds range


# -- the plan of parts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    segment: int
    start: int
    end: int


@dataclass(frozen=True)
class Part:
    """One part of the upload: a copy of one range of an S3 object, or bytes joined here."""

    pieces: tuple[Piece, ...]
    copy: bool

    @property
    def size(self) -> int:
        return sum(p.end - p.start for p in self.pieces)


def plan_parts(
    sizes: Sequence[int], copyable: Sequence[bool], target: int, min_part: int = S3_MIN_PART
) -> list[Part]:
    """The parts that write ``sizes`` (segments in order) as one object: a copyable segment of at
    least ``min_part`` is copied (after its head tops up a short buffer of joined bytes to
    ``min_part``, when what remains is still ``min_part``); the rest is joined into parts of about
    ``target``. Every part but the last is at least ``min_part``."""
    if target < min_part:
        raise ValueError(f"part target {target} is below the minimum part {min_part}")
    parts: list[Part] = []
    buf: list[Piece] = []
    buffered = 0

    def flush() -> None:
        nonlocal buffered
        parts.append(Part(tuple(buf), copy=False))
        buf.clear()
        buffered = 0

    for seg, (size, can_copy) in enumerate(zip(sizes, copyable, strict=True)):
        pos = 0
        if can_copy and min_part <= size <= S3_MAX_COPY:
            need = max(0, min_part - buffered) if buffered else 0
            if size - need >= min_part:
                if need:
                    buf.append(Piece(seg, 0, need))
                    pos = need
                if buf:
                    flush()
                parts.append(Part((Piece(seg, pos, size),), copy=True))
                continue
        while pos < size:
            take = min(size - pos, target - buffered)
            buf.append(Piece(seg, pos, pos + take))
            buffered += take
            pos += take
            if buffered >= target:
                flush()
    if buf:
        flush()
    return parts


# -- the claim -------------------------------------------------------------------------------------


class Claim:
    """This worker's claim on a job's merge (see the module doc)."""

    def __init__(self, s3: Any, bucket: str, key: str, ttl_s: float, doc: dict[str, Any]) -> None:
        self.s3, self.bucket, self.key, self.ttl_s, self.doc = s3, bucket, key, ttl_s, doc
        self.etag = ""
        self._writing = asyncio.Lock()  # renewals and notes go one at a time, each on the last ETag
        self.previous_upload: str | None = None  # of a merger this claim took over from

    @classmethod
    async def take(
        cls, s3: Any, bucket: str, key: str, ttl_s: float, message_id: str | None
    ) -> Claim:
        """Claim the merge, or take over a dead merger's claim; :class:`Deferred` otherwise."""
        now = time.time()
        claim = cls(s3, bucket, key, ttl_s, {"owner": OWNER, "message_id": message_id})
        try:
            await claim._write(now, IfNoneMatch="*")
            return claim
        except PreconditionFailed:
            pass
        got = await get_json(s3, bucket, key)
        if got is None:  # the merge just finished and its folder was deleted: look again soon
            raise Deferred(1, "the merge claim vanished")
        current, etag = got
        margin = ttl_s / 4
        left = float(current.get("expires_at", 0)) + margin - now
        same_message = message_id is not None and current.get("message_id") == message_id
        if left > 0 and not same_message:
            # Looked at again well before the claim could expire: most merges end sooner.
            raise Deferred(min(left, 30), f"{current.get('owner')} is merging this job")
        try:
            await claim._write(now, IfMatch=etag)
        except PreconditionFailed:
            raise Deferred(5, "another worker took the merge over first") from None
        claim.previous_upload = current.get("upload_id")
        log.warning(
            "merge.taken_over",
            previous=current.get("owner"),
            reason="its message came back" if same_message else "its claim expired",
        )
        return claim

    async def _write(self, now: float, **condition: str) -> None:
        self.doc["expires_at"] = now + self.ttl_s
        self.doc["renewed_at"] = datetime.fromtimestamp(now, UTC).isoformat()
        self.etag = await put_json(self.s3, self.bucket, self.key, self.doc, **condition)

    async def _renew(self) -> None:
        async with self._writing:
            await self._write(time.time(), IfMatch=self.etag)

    async def note_upload(self, upload_id: str) -> None:
        self.doc["upload_id"] = upload_id
        await self._renew()

    async def release(self) -> None:
        """Mark the claim expired (a merge stopped on purpose, at a drain): the next finder takes
        it over at once instead of waiting out the TTL."""
        async with self._writing:
            self.doc["released"] = True
            with contextlib.suppress(Exception):
                await self._write(time.time() - self.ttl_s * 2, IfMatch=self.etag)

    async def keep(self) -> str:
        """Renew until cancelled; returns (why) only when the claim is lost."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self._renew()
            except PreconditionFailed:
                return "another worker took the merge over"
            except Exception as exc:
                log.warning("merge.renew_failed", error=f"{type(exc).__name__}: {exc}")
                if time.time() >= float(self.doc["expires_at"]):
                    return "the merge claim expired while renewals failed"


# -- the merge -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One shard's records: an S3 object (``key``), or a local spool (a failed shard's errors)."""

    size: int
    key: str | None = None
    spool: IO[bytes] | None = None


def _error_record(number: int, raw_id: Any, error: EngineFailure) -> bytes:
    for candidate in (raw_id, None):
        with contextlib.suppress(ValueError, TypeError, RecursionError):
            record = {"line": number, "id": candidate, "error": error.to_dict()}
            return json.dumps(record, allow_nan=False).encode() + b"\n"
    raise AssertionError("unreachable")  # pragma: no cover


class Merger:
    """Merges split jobs for one worker; ``on_step`` sees each step's name (tests stop there)."""

    def __init__(
        self,
        s3: Any,
        settings: WorkerSettings,
        metrics: Any = None,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.s3 = s3
        self.settings = settings
        self.bucket = settings.bucket
        self.metrics = metrics
        self.on_step = on_step

    def _step(self, name: str) -> None:
        log.info("merge.step", step=name)
        if self.on_step is not None:
            self.on_step(name)

    async def merge(
        self, keys: OutputKeys, skeys: ShardKeys, manifest: Manifest, message_id: str | None
    ) -> dict[str, Any] | None:
        """Merge the job; the summary this call wrote, or None if the job was done already.
        Raises :class:`Deferred` when another worker holds the merge."""
        if await exists(self.s3, self.bucket, keys.summary):
            await self._clean(skeys)
            return None
        claim = await Claim.take(
            self.s3, self.bucket, skeys.claim, self.settings.merge_claim_ttl_s, message_id
        )
        if await exists(self.s3, self.bucket, keys.summary):  # finished between the two looks
            await self._clean(skeys)
            return None
        self._step("claimed")
        keeper = asyncio.create_task(claim.keep())
        work = asyncio.create_task(self._merge(keys, skeys, manifest, claim))
        try:
            await asyncio.wait({keeper, work}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # a drain deadline: hand the merge on without delay
            await asyncio.shield(claim.release())
            raise
        finally:
            await stop_together(keeper, work)
        if work.cancelled():
            lost = keeper.result() if not keeper.cancelled() else "cancelled"
            if self.metrics is not None:
                self.metrics.merges.labels("lost").inc()
            raise Deferred(5, f"merge stopped: {lost}")
        return work.result()

    async def _merge(
        self, keys: OutputKeys, skeys: ShardKeys, manifest: Manifest, claim: Claim
    ) -> dict[str, Any] | None:
        started = time.perf_counter()
        done, failed = await self._markers(skeys, manifest)
        stats: dict[str, Any] = {"reused_results": True}
        if not await exists(self.s3, self.bucket, keys.results):
            stats = await self._results(keys, skeys, manifest, done, failed, claim)
        self._step("results_written")
        stats["seconds"] = round(time.perf_counter() - started, 4)
        summary = build_summary(manifest, keys, done, failed, stats)
        try:
            await put_json(self.s3, self.bucket, keys.summary, summary, IfNoneMatch="*")
        except PreconditionFailed:
            return None  # another merger finished first (after a takeover)
        self._step("summary_written")
        await status.update(
            self.s3, self.bucket, status.status_key(keys), lambda doc: status.finish(doc, summary)
        )
        if self.metrics is not None:
            self.metrics.merges.labels("ok").inc()
            self.metrics.merge_seconds.observe(stats["seconds"])
        await self._clean(skeys)
        self._step("cleaned")
        return summary

    async def _clean(self, skeys: ShardKeys) -> None:
        """The shard folder goes once the summary exists (a lifecycle rule expires leftovers)."""
        deleted = await delete_prefix(self.s3, self.bucket, skeys.base)
        log.info("merge.cleaned", prefix=skeys.base, objects=deleted)

    async def _markers(
        self, skeys: ShardKeys, manifest: Manifest
    ) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
        """Every shard's done marker, or its failed marker."""
        gate = asyncio.Semaphore(16)

        async def one(index: int) -> tuple[int, str, dict[str, Any]]:
            async with gate:
                for kind, key in (("done", skeys.done(index)), ("failed", skeys.failed(index))):
                    got = await get_json(self.s3, self.bucket, key)
                    if got is not None:
                        return index, kind, got[0]
            raise JobFailed(f"shard {index} has no done or failed marker any more")

        found = await asyncio.gather(*(one(s.index) for s in manifest.shards))
        done = {i: doc for i, kind, doc in found if kind == "done"}
        failed = {i: doc for i, kind, doc in found if kind == "failed"}
        return done, failed

    async def _results(
        self,
        keys: OutputKeys,
        skeys: ShardKeys,
        manifest: Manifest,
        done: dict[int, dict[str, Any]],
        failed: dict[int, dict[str, Any]],
        claim: Claim,
    ) -> dict[str, Any]:
        segments: list[Segment] = []
        try:
            for span in manifest.shards:
                if span.index in done:
                    marker = done[span.index]
                    segments.append(Segment(int(marker["bytes"]), key=marker["output"]))
                else:
                    segments.append(await self._failed_records(skeys, manifest, span, failed))
            return await self._upload(keys, segments, claim)
        finally:
            for segment in segments:
                if segment.spool is not None:
                    segment.spool.close()

    async def _failed_records(
        self,
        skeys: ShardKeys,
        manifest: Manifest,
        span: ShardSpan,
        failed: dict[int, dict[str, Any]],
    ) -> Segment:
        """An error record for each line of a shard that failed for good, read from its input."""
        why = failed[span.index].get("error", "unknown")
        error = EngineFailure(
            f"shard {span.index} (lines {span.first}-{span.last}) failed: {why}"[:2000],
            code="shard_failed",
        )
        spool = tempfile.TemporaryFile(dir=self.settings.tmp_dir)  # noqa: SIM115 (closed by _results)
        try:
            got = await self.s3.get_object(
                Bucket=self.bucket, Key=skeys.input(manifest.split, span.index)
            )
            async with got["Body"] as body:
                async for item in decode_items(unframe(raw_chunks(body)), manifest.kind):
                    value = item.value
                    raw_id = value.id if isinstance(value, DecisionRequest) else item.raw_id
                    spool.write(_error_record(item.line, raw_id, error))
        except ClientError as exc:
            if not is_missing(exc):
                spool.close()
                raise
            log.error("merge.failed_shard_input_gone", shard=span.index)
        except BaseException:
            spool.close()
            raise
        return Segment(spool.tell(), spool=spool)

    async def _read_into(self, data: bytearray, segment: Segment, piece: Piece) -> None:
        """Append the piece's bytes to ``data``, read in bounded pieces."""
        want = piece.end - piece.start
        if segment.spool is not None:
            segment.spool.seek(piece.start)
            data += segment.spool.read(want)
            return
        got = await self.s3.get_object(
            Bucket=self.bucket, Key=segment.key, Range=f"bytes={piece.start}-{piece.end - 1}"
        )
        before = len(data)
        async with got["Body"] as body:
            async for chunk in raw_chunks(body):
                data += chunk
        if len(data) - before != want:
            raise JobFailed(f"{segment.key} is shorter than its done marker says")

    async def _put_part(
        self, key: str, upload_id: str, number: int, part: Part, segments: list[Segment]
    ) -> dict[str, Any]:
        common = {"Bucket": self.bucket, "Key": key, "UploadId": upload_id, "PartNumber": number}
        if part.copy:
            [piece] = part.pieces
            copied = await self.s3.upload_part_copy(
                **common,
                CopySource={"Bucket": self.bucket, "Key": segments[piece.segment].key},
                CopySourceRange=f"bytes={piece.start}-{piece.end - 1}",
            )
            return {"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]}
        data = bytearray()
        for piece in part.pieces:  # several small pieces in one part: fetched in turn
            await self._read_into(data, segments[piece.segment], piece)
        body = bytes(data)  # as the single path's parts (aiohttp takes a large bytearray badly)
        del data
        uploaded = await self.s3.upload_part(**common, Body=body)
        return {"PartNumber": number, "ETag": uploaded["ETag"]}

    async def _upload(
        self, keys: OutputKeys, segments: list[Segment], claim: Claim
    ) -> dict[str, Any]:
        target = max(S3_MIN_PART, int(self.settings.part_size_mb * MiB))
        copyable = [s.key is not None for s in segments]
        plan = plan_parts([s.size for s in segments], copyable, target)
        while len(plan) > S3_MAX_PARTS:  # only for a job of tens of GB: bigger joined parts
            target *= 2
            plan = plan_parts([s.size for s in segments], [False] * len(segments), target)
        upload = await self.s3.create_multipart_upload(
            Bucket=self.bucket, Key=keys.results, ContentType="application/x-ndjson"
        )
        upload_id = upload["UploadId"]
        completed = False
        try:
            await claim.note_upload(upload_id)
            gate = asyncio.Semaphore(PART_CONCURRENCY)

            async def one(number: int, part: Part) -> dict[str, Any]:
                async with gate:
                    return await self._put_part(keys.results, upload_id, number, part, segments)

            parts = await asyncio.gather(*(one(n, p) for n, p in enumerate(plan, start=1)))
            self._step("parts_uploaded")
            completed = await self._complete(keys.results, upload_id, list(parts))
        finally:
            if not completed:
                with contextlib.suppress(Exception):
                    await asyncio.shield(
                        self.s3.abort_multipart_upload(
                            Bucket=self.bucket, Key=keys.results, UploadId=upload_id
                        )
                    )
        if claim.previous_upload and claim.previous_upload != upload_id:
            with contextlib.suppress(Exception):  # a dead merger's upload: not needed any more
                await self.s3.abort_multipart_upload(
                    Bucket=self.bucket, Key=keys.results, UploadId=claim.previous_upload
                )
        copied = [p for p in plan if p.copy]
        return {
            "parts": len(plan),
            "copied_parts": len(copied),
            "copied_bytes": sum(p.size for p in copied),
            "joined_bytes": sum(p.size for p in plan if not p.copy),
        }

    async def _complete(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> bool:
        """Complete the upload unless the results exist; True if this call wrote them."""
        try:
            await self.s3.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            lost = is_precondition_failed(exc) or code == "NoSuchUpload"
            if lost and await exists(self.s3, self.bucket, key):
                log.info("merge.results_written_by_another", key=key)
                return False
            raise
        return True


def _prefix_reuse(manifest: Manifest, done: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """How much of the single path's state reuse the shard cut kept: a run of lines sharing a state
    is prefilled once by one worker; each shard boundary inside such a run costs one more."""
    decisions = sum(int(m.get("decisions", 0)) for m in done.values())
    runs = sum(int(m.get("runs", 0)) for m in done.values())
    cut = 0
    for span in manifest.shards[1:]:
        before, after = done.get(span.index - 1), done.get(span.index)
        if (
            before
            and after
            and before.get("last_state")
            and (before.get("last_state") == after.get("first_state"))
        ):
            cut += 1
    single_reuse = decisions - (runs - cut)  # decisions that reuse a prefill on one worker
    kept = (decisions - runs) / single_reuse if single_reuse > 0 else 1.0
    return {
        "decisions": decisions,
        "state_runs": runs - cut,
        "runs_cut_by_shards": cut,
        "boundaries_moved_to_keep_runs": manifest.runs_kept_whole,
        "kept": round(kept, 4),
    }


def build_summary(
    manifest: Manifest,
    keys: OutputKeys,
    done: dict[int, dict[str, Any]],
    failed: dict[int, dict[str, Any]],
    stats: dict[str, Any],
) -> dict[str, Any]:
    """The job's summary, in the single path's shape, plus what the shards did."""
    codes: dict[str, int] = {}
    for marker in done.values():
        for code, n in marker.get("errors_by_code", {}).items():
            codes[code] = codes.get(code, 0) + int(n)
    failed_spans = [s for s in manifest.shards if s.index in failed]
    failed_lines = sum(s.items for s in failed_spans)
    if failed_lines:
        codes["shard_failed"] = codes.get("shard_failed", 0) + failed_lines
    lines = sum(int(m["lines"]) for m in done.values()) + failed_lines
    ok = sum(int(m["ok"]) for m in done.values())
    total_s = max(1e-6, time.time() - manifest.created_ts)
    first = next(iter(done.values()), {})
    return {
        "input": manifest.input,
        "results_key": keys.results,
        "lines": lines,
        "ok": ok,
        "failed": lines - ok,
        "errors_by_code": dict(sorted(codes.items())),
        "tokens": {"prompt": sum(int(m.get("prompt_tokens", 0)) for m in done.values())},
        "seconds": {
            "total": round(total_s, 4),
            "engine": round(sum(float(m.get("engine_s", 0)) for m in done.values()), 4),
            "merge": stats.get("seconds"),
        },
        "decisions_per_s": round(lines / total_s, 3),
        "model": first.get("model"),
        "worker": {"host": socket.gethostname(), "pid": os.getpid()},
        "finished_at": datetime.now(UTC).isoformat(),
        "shards": {
            "count": manifest.count,
            "shard_lines": manifest.shard_lines,
            "done": len(done),
            "failed": [
                {
                    "index": s.index,
                    "first_line": s.first,
                    "last_line": s.last,
                    "lines": s.items,
                    "error": failed[s.index].get("error"),
                    "receives": failed[s.index].get("receives"),
                }
                for s in failed_spans
            ],
            "workers": len({json.dumps(m.get("worker"), sort_keys=True) for m in done.values()}),
            "merge": stats,
            "prefix_reuse": _prefix_reuse(manifest, done),
        },
    }
