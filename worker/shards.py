"""Splitting a large job into shards: their keys in S3, the manifest, the shard input format, the split.

A job with more than ``shard_lines`` lines is cut, by the worker that receives it, into contiguous
line ranges ("shards") that any worker may score. The cut is a function of the input and the
settings alone: every ``shard_lines`` items, moved on by up to a quarter of that while the next line
has the same state as the last (so its prefill is not paid twice). The input is streamed once
(raw lines, see :func:`worker.formats.raw_items_for`): memory holds one line, disk one shard.

Everything of a split job lives under ``<shard_prefix><name>.<etag>/`` while it runs::

    <split>/in/<i>            shard i's input: its numbered raw lines, framed (below)
    manifest.json             written once (If-None-Match: *) after every input: the split's id, the
                              line range of each shard; a second split of the same input loses here
    enqueued.json             every shard message was sent
    out/<i>.<attempt>.jsonl   shard i's result records, one object per attempt, never overwritten
    done/<i>.json             shard i is done (If-None-Match: *): the output that won, its tally
    failed/<i>.json           shard i failed for good: why, after how many receives
    merge.json                the merge claim (:mod:`worker.merge`)

The shard input format: per item a header line ``<number> d <length>`` (a raw line) or ``<number> e
<length>`` (the error the reader gave it, as JSON), then that many bytes and a newline. Raw lines keep
their exact bytes, so a shard's records equal those the whole job would give.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any, Literal

import structlog
from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field

from arbiter.errors import ArbiterError, MalformedRequest, PayloadTooLarge
from worker.events import JobRef, ShardMessage
from worker.formats import PIECE, item_kind, raw_items_for
from worker.jobs import (
    MAX_KEY_BYTES,
    JobFailed,
    JobRejected,
    Located,
    fit_name,
    is_missing,
    raw_chunks,
    upload_spool,
)
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")

MAX_SHARDS = 10_000  # S3's limit on the parts of one upload; far beyond any sensible job
_SUFFIX_ROOM = (
    64  # the longest key tail under a job's shard folder, e.g. "out/00017.<12 hex>.jsonl"
)


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""


def is_precondition_failed(exc: ClientError) -> bool:
    """412: the condition was checked and is false. Not S3's 409 ``ConditionalRequestConflict`` (a
    concurrent write was in progress, outcome unknown): that one is retried as any S3 error is."""
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return bool(error.get("Code") == "PreconditionFailed" or status == 412)


async def put_json(s3: Any, bucket: str, key: str, doc: Any, **condition: str) -> str:
    """PutObject of a JSON document; ``IfNoneMatch="*"`` or ``IfMatch=<etag>`` make it conditional
    (:class:`PreconditionFailed` when it loses). Returns the new object's ETag."""
    try:
        put = await s3.put_object(
            Bucket=bucket,
            Key=key,
            Body=json.dumps(doc, indent=1).encode(),
            ContentType="application/json",
            **condition,
        )
    except ClientError as exc:
        if is_precondition_failed(exc) or (condition.get("IfMatch") and is_missing(exc)):
            raise PreconditionFailed(key) from exc
        raise
    return str(put["ETag"])


async def get_json(s3: Any, bucket: str, key: str) -> tuple[Any, str] | None:
    """A JSON object and its ETag; None if there is no such key."""
    try:
        got = await s3.get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if is_missing(exc):
            return None
        raise
    async with got["Body"] as body:
        data = await body.read()
    return json.loads(data), str(got["ETag"])


async def delete_quietly(s3: Any, bucket: str, key: str) -> None:
    with contextlib.suppress(Exception):
        await s3.delete_object(Bucket=bucket, Key=key)


# -- where a split job lives -----------------------------------------------------------------------


@dataclass(frozen=True)
class ShardKeys:
    """The keys of one split job (see the module doc)."""

    base: str

    @property
    def manifest(self) -> str:
        return f"{self.base}manifest.json"

    @property
    def enqueued(self) -> str:
        return f"{self.base}enqueued.json"

    @property
    def claim(self) -> str:
        return f"{self.base}merge.json"

    @property
    def done_prefix(self) -> str:
        return f"{self.base}done/"

    @property
    def failed_prefix(self) -> str:
        return f"{self.base}failed/"

    def input(self, split: str, index: int) -> str:
        return f"{self.base}{split}/in/{index:05d}"

    def output(self, index: int, attempt: str) -> str:
        return f"{self.base}out/{index:05d}.{attempt}.jsonl"

    def done(self, index: int) -> str:
        return f"{self.done_prefix}{index:05d}.json"

    def failed(self, index: int) -> str:
        return f"{self.failed_prefix}{index:05d}.json"


def shard_keys(settings: WorkerSettings, key: str, etag: str) -> ShardKeys:
    """``<shard_prefix><key without input prefix>.<etag>/``, cut like the output keys if long."""
    name = key.removeprefix(settings.input_prefix)
    fixed = len(f"{settings.shard_prefix}.{etag}/".encode()) + _SUFFIX_ROOM
    return ShardKeys(f"{settings.shard_prefix}{fit_name(name, MAX_KEY_BYTES - fixed)}.{etag}/")


def marker_index(key: str) -> int | None:
    """The shard index in a ``done/`` or ``failed/`` marker key."""
    stem = key.rsplit("/", 1)[-1].removesuffix(".json")
    return int(stem) if stem.isdigit() else None


async def finished_shards(s3: Any, bucket: str, keys: ShardKeys) -> tuple[set[int], set[int]]:
    """The indices with a done marker, and those with a failed marker (one listing each; S3's
    listings are strongly consistent, so a marker written before this call is always seen)."""
    found: list[set[int]] = []
    for prefix in (keys.done_prefix, keys.failed_prefix):
        indices: set[int] = set()
        paginator = s3.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                if (index := marker_index(obj["Key"])) is not None:
                    indices.add(index)
        found.append(indices)
    return found[0], found[1]


async def delete_prefix(s3: Any, bucket: str, prefix: str) -> int:
    """Delete every object under ``prefix`` (1,000 per call); how many were deleted."""
    deleted = 0
    paginator = s3.get_paginator("list_objects_v2")
    async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        objects = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if objects:
            answer = await s3.delete_objects(
                Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
            )
            for error in answer.get("Errors", []):
                log.warning("shards.delete_failed", key=error.get("Key"), code=error.get("Code"))
            deleted += len(objects) - len(answer.get("Errors", []))
    return deleted


# -- the manifest ----------------------------------------------------------------------------------


class ShardSpan(BaseModel):
    """One shard: items ``first``..``last`` (1-based line or element numbers), ``items`` of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    first: int = Field(ge=1)
    last: int = Field(ge=1)
    items: int = Field(ge=1)
    bytes: int = Field(ge=0)


class Manifest(BaseModel):
    """The split of one input version, written once; read back by every shard and the merge."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: Literal[1] = 1
    split: str
    input: dict[str, Any]
    kind: Literal["line", "element"]
    shard_lines: int
    items: int
    shards: list[ShardSpan]
    runs_kept_whole: int = 0  # boundaries moved on so a run of one state stays in one shard
    runs_cut: int = 0  # boundaries inside a run of one state longer than the allowed move
    created_at: str
    created_ts: float

    @property
    def count(self) -> int:
        return len(self.shards)


async def read_manifest(s3: Any, bucket: str, keys: ShardKeys) -> Manifest | None:
    got = await get_json(s3, bucket, keys.manifest)
    return None if got is None else Manifest.model_validate(got[0])


# -- the shard input format ------------------------------------------------------------------------

_ERRORS: dict[str, type[ArbiterError]] = {
    "MalformedRequest": MalformedRequest,
    "PayloadTooLarge": PayloadTooLarge,
}


def frame(number: int, data: bytes | ArbiterError) -> bytes:
    """One item of a shard input (see the module doc)."""
    if isinstance(data, ArbiterError):
        name = type(data).__name__ if type(data).__name__ in _ERRORS else "MalformedRequest"
        error = {"class": name, "code": data.code, "message": data.message, "param": data.param}
        body = json.dumps(error).encode()
        return b"%d e %d\n" % (number, len(body)) + body + b"\n"
    return b"%d d %d\n" % (number, len(data)) + data + b"\n"


def _error(body: bytes) -> ArbiterError:
    raw = json.loads(body)
    cls = _ERRORS.get(raw.get("class"), MalformedRequest)
    return cls(str(raw.get("message", "")), param=raw.get("param"), code=raw.get("code"))


class DamagedShard(JobFailed):
    """A shard input that does not parse: written by a broken or foreign writer."""


async def unframe(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, bytes | ArbiterError]]:
    """The items of a shard input, in order; memory holds one item and one read."""
    buf = bytearray()
    pos = 0
    ended = False
    while True:
        newline = buf.find(b"\n", pos)
        if newline < 0:
            if ended:
                if pos < len(buf):
                    raise DamagedShard("a shard input ends inside an item header")
                return
            del buf[:pos]
            pos = 0
            try:
                buf += await anext(chunks)
            except StopAsyncIteration:
                ended = True
            continue
        try:
            number_s, kind, length_s = bytes(buf[pos:newline]).split(b" ")
            number, length = int(number_s), int(length_s)
            if kind not in (b"d", b"e") or length < 0:
                raise ValueError(f"kind {kind!r}, length {length}")
        except ValueError as exc:
            raise DamagedShard(f"a shard input has a bad item header: {exc}") from exc
        start, end = newline + 1, newline + 1 + length
        while len(buf) < end + 1 and not ended:
            try:
                buf += await anext(chunks)
            except StopAsyncIteration:
                ended = True
        if len(buf) < end + 1 or buf[end] != ord("\n"):
            raise DamagedShard("a shard input item is cut short")
        data = bytes(buf[start:end])
        pos = end + 1
        if pos > PIECE:
            del buf[:pos]
            pos = 0
        yield number, (_error(data) if kind == b"e" else data)


# -- splitting -------------------------------------------------------------------------------------

_NO_STATE = object()


def state_of(data: bytes | ArbiterError) -> Any:
    """The ``state`` of a raw line, parsed only at shard boundaries; a unique marker if none."""
    if isinstance(data, ArbiterError):
        return _NO_STATE
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        return _NO_STATE
    return raw.get("state", _NO_STATE) if isinstance(raw, dict) else _NO_STATE


def same_state(a: Any, b: Any) -> bool:
    return a is not _NO_STATE and b is not _NO_STATE and a == b


@dataclass
class _Shard:
    """A shard being written to its spool file."""

    index: int
    spool: IO[bytes]
    first: int = 0
    last: int = 0
    items: int = 0
    size: int = 0

    def add(self, number: int, data: bytes | ArbiterError) -> None:
        framed = frame(number, data)
        self.spool.write(framed)
        self.first = self.first or number
        self.last = number
        self.items += 1
        self.size += len(framed)

    @classmethod
    def open(cls, index: int, tmp_dir: str | None) -> _Shard:
        # Closed by the uploader once sent, or by split_job on failure.
        return cls(index, tempfile.TemporaryFile(dir=tmp_dir))

    def span(self) -> ShardSpan:
        return ShardSpan(
            index=self.index, first=self.first, last=self.last, items=self.items, bytes=self.size
        )


@dataclass
class SplitResult:
    manifest: Manifest
    mine: bool  # False: another worker's split of the same input won the manifest


class _Uploader:
    """Shard inputs go up one at a time while the next is being read (at most two spools)."""

    def __init__(self, s3: Any, settings: WorkerSettings, keys: ShardKeys, split: str) -> None:
        self.s3, self.settings, self.keys, self.split = s3, settings, keys, split
        self.pending: asyncio.Task[None] | None = None

    async def _up(self, shard: _Shard) -> None:
        try:
            key = self.keys.input(self.split, shard.index)
            await upload_spool(self.s3, self.settings, key, shard.spool, "application/octet-stream")
        finally:
            shard.spool.close()

    async def send(self, shard: _Shard) -> None:
        await self.wait()
        self.pending = asyncio.create_task(self._up(shard))

    async def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            await pending

    async def cancel(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            with contextlib.suppress(BaseException):
                await self.pending


async def split_job(
    s3: Any, ref: JobRef, found: Located, keys: ShardKeys, settings: WorkerSettings
) -> SplitResult | None:
    """Cut the input into shard inputs and write the manifest; None when the whole input fits in
    one shard (run it as one job). Raises :class:`JobRejected` if the input is gone."""
    try:
        response = await s3.get_object(**found.head_kw, IfMatch=f'"{found.etag}"')
    except ClientError as exc:
        if is_missing(exc):
            raise JobRejected(f"the input s3://{ref.bucket}/{ref.key} no longer exists") from exc
        raise
    split = uuid.uuid4().hex[:12]
    target = settings.shard_lines
    slack = max(1, target // 4)
    uploader = _Uploader(s3, settings, keys, split)
    shards: list[_Shard] = []
    current = _Shard.open(0, settings.tmp_dir)
    kept = cut = 0
    last_state: Any = _NO_STATE
    previous: bytes | ArbiterError = b""
    try:
        async with response["Body"] as body:
            raw = raw_items_for(ref.key, raw_chunks(body), settings.max_line_bytes)
            async for number, data in raw:
                if current.items >= target and len(shards) < MAX_SHARDS - 1:
                    if current.items == target:
                        last_state = state_of(previous)
                    same = same_state(state_of(data), last_state)
                    if not same or current.items >= target + slack:
                        cut += same
                        kept += current.items > target
                        shards.append(current)
                        await uploader.send(current)
                        current = _Shard.open(len(shards), settings.tmp_dir)
                current.add(number, data)
                previous = data
        if not shards:
            current.spool.close()
            return None
        shards.append(current)
        await uploader.send(current)
        await uploader.wait()
    except BaseException:
        await uploader.cancel()
        for shard in (*shards, current):
            shard.spool.close()
        raise
    now = time.time()
    manifest = Manifest(
        split=split,
        input={
            "bucket": ref.bucket,
            "key": ref.key,
            "etag": found.etag,
            "version_id": ref.version_id or found.head.get("VersionId"),
            "bytes": found.head.get("ContentLength"),
        },
        kind="element" if item_kind(ref.key) == "element" else "line",
        shard_lines=target,
        items=sum(s.items for s in shards),
        shards=[s.span() for s in shards],
        runs_kept_whole=kept,
        runs_cut=cut,
        created_at=datetime.fromtimestamp(now, UTC).isoformat(),
        created_ts=now,
    )
    try:
        await put_json(
            s3, settings.bucket, keys.manifest, manifest.model_dump(mode="json"), IfNoneMatch="*"
        )
    except PreconditionFailed:
        # A duplicate delivery split the same input at the same time and won: its shards count.
        await delete_prefix(s3, settings.bucket, f"{keys.base}{split}/")
        winner = await read_manifest(s3, settings.bucket, keys)
        if winner is None:
            raise JobFailed("the winning split's manifest vanished") from None
        return SplitResult(winner, mine=False)
    return SplitResult(manifest, mine=True)


# -- shard messages --------------------------------------------------------------------------------


def shard_message(manifest: Manifest, index: int) -> str:
    inp = manifest.input
    message = ShardMessage(
        arbiter_shard=1,
        bucket=inp["bucket"],
        key=inp["key"],
        etag=inp["etag"],
        split=manifest.split,
        index=index,
        count=manifest.count,
    )
    return message.model_dump_json()


async def enqueue_shards(
    sqs: Any, queue_url: str, manifest: Manifest, indices: list[int], tries: int = 5
) -> None:
    """One message per shard on the job queue (batches of 10); entries SQS refuses are sent again,
    and a shard still refused after ``tries`` fails the split's receive (it is retried whole)."""
    for start in range(0, len(indices), 10):
        entries = {
            str(i): {"Id": str(i), "MessageBody": shard_message(manifest, i)}
            for i in indices[start : start + 10]
        }
        for attempt in range(tries):
            answer = await sqs.send_message_batch(
                QueueUrl=queue_url, Entries=list(entries.values())
            )
            failed = {f["Id"] for f in answer.get("Failed", [])}
            for entry in answer.get("Failed", []):
                log.warning("shards.enqueue_failed", shard=entry["Id"], code=entry.get("Code"))
            entries = {k: v for k, v in entries.items() if k in failed}
            if not entries:
                break
            await asyncio.sleep(0.2 * 2**attempt)
        if entries:
            raise JobFailed(f"SQS refused shard messages {sorted(entries)}")
