"""Cutting a large job into shard inputs, reading the input once.

A job within ``shard_lines`` items is not cut: the items the split read are handed back framed in
a spool (:class:`Whole`), and the job runs whole from it, without reading its input again.

A job with more than ``shard_lines`` items is cut into contiguous ranges: every ``shard_lines``
items, moved on by up to a quarter of that while the next item has the same state as the last (so
its prefill is not paid twice). The cut depends on the input and the plan's settings alone
(:func:`worker.fanout.plan.plan_id`), so any worker that cuts the same input gets the same bytes
under the same keys. The input is streamed (raw items, see :func:`worker.formats.raw_items_for`):
memory holds one item, disk at most :data:`UPLOADS` + 1 shards (the uploader sends up to that many
at once while the next is read: one at a time, each PUT's round trip was the split's pace).

A job that would need more than :data:`~worker.fanout.plan.MAX_SHARDS` shards is refused with a clear
error instead of a last shard that takes every remaining line, and **before the split**: unless its
size alone shows that it fits (:func:`fits_unread`), the input is first read once without writing
any shard input, cut as the split would cut it (:func:`precount`), and refused as soon as it needs
one shard too many, so that no shard input is uploaded for a job that is then refused. That read
keeps its first shard in a spool: a job it finds within one shard runs whole from it, and only a
job of several shards is read a second time, to be split.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

from arbiter.errors import ArbiterError
from arbiter.lines import Item
from worker.fanout.frames import frame, unframe
from worker.fanout.keys import JobFolder
from worker.fanout.plan import MAX_SHARDS, STRIPES, Manifest, ShardSpan, plan_id
from worker.formats import PIECE, decode_items, item_kind, raw_items_for
from worker.jobs import JobRejected, Located, open_input, raw_chunks
from worker.s3io import delete_prefix, upload_spool
from worker.settings import WorkerSettings

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
    gaps: list[tuple[int, int]] = field(default_factory=list)

    def add(self, number: int, data: bytes | ArbiterError) -> None:
        framed = frame(number, data)
        self.spool.write(framed)
        if self.last and number > self.last + 1:
            self.gaps.append((self.last + 1, number - 1))
        self.first = self.first or number
        self.last = number
        self.items += 1
        self.size += len(framed)

    @classmethod
    def open(cls, index: int, tmp_dir: str | None) -> _Shard:
        # Closed by the uploader once sent, or by split_input on failure.
        return cls(index, tempfile.TemporaryFile(dir=tmp_dir))

    def span(self) -> ShardSpan:
        return ShardSpan(
            index=self.index,
            first=self.first,
            last=self.last,
            items=self.items,
            bytes=self.size,
            gaps=self.gaps,
        )


async def _read(spool: IO[bytes]) -> AsyncIterator[bytes]:
    spool.seek(0)
    while chunk := spool.read(PIECE):
        yield chunk


@dataclass
class Whole:
    """An input within one shard, as the split read it: its items framed in a spool, as a shard
    input would hold them, so that the job runs whole from it (:func:`worker.jobs.run_located`)
    without reading its input again. Whoever runs it closes it."""

    spool: IO[bytes]
    kind: str

    @contextlib.asynccontextmanager
    async def items(self) -> AsyncIterator[AsyncIterator[Item]]:
        """The job's items, read back from the spool (a :data:`worker.jobs.Source`)."""
        yield decode_items(unframe(_read(self.spool)), self.kind)

    def close(self) -> None:
        self.spool.close()


UPLOADS = 4  # shard inputs in flight at once while the next is read (UPLOADS + 1 spools on disk)


class _Uploader:
    """Shard inputs go up :data:`UPLOADS` at a time while the next is being read."""

    def __init__(self, s3: Any, settings: WorkerSettings, folder: JobFolder, plan: str) -> None:
        self.s3, self.settings, self.folder, self.plan = s3, settings, folder, plan
        self.pending: set[asyncio.Task[None]] = set()

    async def _up(self, shard: _Shard) -> None:
        try:
            key = self.folder.input(self.plan, shard.index)
            await upload_spool(self.s3, self.settings, key, shard.spool, "application/octet-stream")
        finally:
            shard.spool.close()

    async def send(self, shard: _Shard) -> None:
        while len(self.pending) >= UPLOADS:
            done, self.pending = await asyncio.wait(
                self.pending, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                task.result()  # an upload that failed fails the split
        self.pending.add(asyncio.create_task(self._up(shard)))

    async def wait(self) -> None:
        """Every upload finished (each one ended before a failure is raised: the caller then
        closes the spools)."""
        ended = await asyncio.gather(*self.pending, return_exceptions=True)
        self.pending = set()
        for result in ended:
            if isinstance(result, BaseException):
                raise result

    async def cancel(self) -> None:
        pending, self.pending = self.pending, set()
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                await task


@dataclass
class _Cutter:
    """Where the boundaries go (see the module doc)."""

    target: int
    slack: int
    kept: int = 0
    cut: int = 0
    last_state: Any = _NO_STATE

    def boundary(self, items: int, previous: bytes | ArbiterError, data: Any) -> bool:
        """Whether ``data`` starts a new shard after one of ``items`` whose last is ``previous``."""
        if items < self.target:
            return False
        if items == self.target:
            self.last_state = state_of(previous)
        same = same_state(state_of(data), self.last_state)
        if same and items < self.target + self.slack:
            return False
        self.cut += same
        self.kept += items > self.target
        return True


def too_many(shard_lines: int) -> str:
    lines = MAX_SHARDS * shard_lines
    return (
        f"the job has more than {MAX_SHARDS:,} shards of {shard_lines:,} lines ({lines:,} lines): "
        "split it into several objects, or raise ARBITER_SHARD_LINES (or this object's "
        "x-amz-meta-arbiter-shard-lines)"
    )


def fits_unread(key: str, size: Any, shard_lines: int) -> bool:
    """Whether an input needs at most MAX_SHARDS shards, known from its size alone: an item takes at
    least two bytes (one, and its newline or comma; the last may lack it) and every shard but the
    last holds at least ``shard_lines`` items, so an uncompressed input of up to about
    ``2 x MAX_SHARDS x shard_lines`` bytes (20 MB by default) fits. A compressed one may inflate to
    anything."""
    if key.endswith(".gz") or not isinstance(size, int):
        return False
    return size // 2 + 1 <= MAX_SHARDS * shard_lines


def _kind(key: str) -> str:
    return "element" if item_kind(key) == "element" else "line"


async def precount(
    s3: Any, found: Located, settings: WorkerSettings, shard_lines: int
) -> Whole | None:
    """Read the input once, uploading nothing, and cut it as :func:`split_input` would: the input
    :class:`Whole` if it is within one shard (its items kept in a spool as they went by), else
    None (it is to be split). Raises :class:`JobRejected` as soon as it needs more than
    MAX_SHARDS."""
    key = found.ref.key
    response = await open_input(s3, found)
    cutter = _Cutter(shard_lines, max(1, shard_lines // 4))
    first = _Shard.open(0, settings.tmp_dir)  # closed as soon as a second shard starts
    shards, items = 1, 0
    previous: bytes | ArbiterError = b""
    try:
        async with response["Body"] as body:
            async for number, data in raw_items_for(key, raw_chunks(body), settings.max_line_bytes):
                if cutter.boundary(items, previous, data):
                    first.spool.close()
                    if shards == MAX_SHARDS:
                        raise JobRejected(too_many(shard_lines), found.keys)
                    shards, items = shards + 1, 0
                if shards == 1:
                    first.add(number, data)
                items += 1
                previous = data
    except BaseException:
        first.spool.close()
        raise
    return Whole(first.spool, _kind(key)) if shards == 1 else None


async def split_input(
    s3: Any,
    found: Located,
    folder: JobFolder,
    settings: WorkerSettings,
    shard_lines: int,
) -> Manifest | Whole:
    """Cut the input into shard inputs under its plan; the manifest (not written yet), or the input
    :class:`Whole` when it fits in one shard (run it as one job, from what was read here). Raises
    :class:`JobRejected` if the input is gone or needs more than MAX_SHARDS shards (before any
    shard input is uploaded, see the module doc)."""
    ref = found.ref
    kind = _kind(ref.key)
    plan = plan_id(kind, shard_lines, settings.max_line_bytes)
    if not fits_unread(ref.key, found.head.get("ContentLength"), shard_lines):
        whole = await precount(s3, found, settings, shard_lines)  # refused before any upload
        if whole is not None:
            return whole
    response = await open_input(s3, found)
    cutter = _Cutter(shard_lines, max(1, shard_lines // 4))
    uploader = _Uploader(s3, settings, folder, plan)
    shards: list[_Shard] = []
    current = _Shard.open(0, settings.tmp_dir)
    previous: bytes | ArbiterError = b""
    try:
        async with response["Body"] as body:
            raw = raw_items_for(ref.key, raw_chunks(body), settings.max_line_bytes)
            async for number, data in raw:
                if cutter.boundary(current.items, previous, data):
                    if len(shards) == MAX_SHARDS - 1:
                        raise JobRejected(too_many(shard_lines), found.keys)
                    shards.append(current)
                    await uploader.send(current)
                    current = _Shard.open(len(shards), settings.tmp_dir)
                current.add(number, data)
                previous = data
        if not shards:
            return Whole(current.spool, kind)
        shards.append(current)
        await uploader.send(current)
        await uploader.wait()
    except BaseException as exc:
        await uploader.cancel()
        for shard in (*shards, current):
            shard.spool.close()
        if isinstance(exc, JobRejected):
            await delete_prefix(s3, settings.bucket, folder.plan_prefix(plan))
        raise
    now = time.time()
    return Manifest(
        plan=plan,
        writer=uuid.uuid4().hex[:12],
        input={
            "bucket": ref.bucket,
            "key": ref.key,
            "etag": found.etag,
            "version_id": ref.version_id or found.head.get("VersionId"),
            "bytes": found.head.get("ContentLength"),
        },
        kind=kind,
        shard_lines=shard_lines,
        items=sum(s.items for s in shards),
        shards=[s.span() for s in shards],
        runs_kept_whole=cutter.kept,
        runs_cut=cutter.cut,
        created_at=datetime.fromtimestamp(now, UTC).isoformat(),
        created_ts=now,
        stripes=min(len(shards), STRIPES),
    )
