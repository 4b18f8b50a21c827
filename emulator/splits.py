"""How Batch Transform cuts an input object into requests, in bounded memory.

An object is read from S3 in chunks of at most ``READ_BYTES`` (inflated, for ``Gzip``, no more than
that per piece either, so a small compressed object cannot expand in one step). ``SplitType=Line``
cuts the chunks into records (lines), refusing a record as soon as its unfinished part passes the
limit (never after holding it whole), and ``MultiRecord`` gathers whole records up to
``MaxPayloadInMB``. What has no limit (``SplitType=None``, or ``MultiRecord`` with
``MaxPayloadInMB=0``) is never gathered at all: the object becomes one request whose body is the
stream of its chunks (HTTP chunked encoding, as SageMaker sends ``MaxPayloadInMB=0``).
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from arbiter.settings import MB
from emulator.s3io import READ_BYTES, S3Uri

MAX_PAYLOAD = 100 * MB  # MaxPayloadInMB's largest value
# A record posted alone (SingleRecord) or filtered (DataProcessing) is held whole; with
# MaxPayloadInMB=0 nothing else bounds it.
SINGLE_RECORD_CAP = MAX_PAYLOAD


class OverLimit(Exception):
    """A record, a mini-batch or an object is larger than the job allows; the message says which."""


async def object_chunks(s3: Any, uri: S3Uri, gzip: bool) -> AsyncIterator[bytes]:
    """The object's bytes (inflated for ``gzip``), in pieces of at most ``READ_BYTES``."""
    got = await s3.get_object(Bucket=uri.bucket, Key=uri.key)
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
    async with got["Body"] as body:
        while chunk := await body.read(READ_BYTES):
            if inflate is None:
                yield chunk
                continue
            data = inflate.decompress(chunk, READ_BYTES)
            while data:
                yield data
                data = inflate.decompress(inflate.unconsumed_tail, READ_BYTES)
    if inflate is not None and (rest := inflate.flush()):
        yield rest


async def records(chunks: AsyncIterator[bytes], max_record: int) -> AsyncIterator[bytes]:
    """The lines of ``chunks``, each with its newline (the last one may lack it); a line that grows
    past ``max_record`` bytes is refused while it is read, not once it is whole."""
    pending = bytearray()
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if pending:
                pending += chunk[start : end + 1]
                line = bytes(pending)
                pending.clear()
            else:
                line = chunk[start : end + 1]
            if len(line) > max_record:
                raise _record_over(len(line), max_record)
            yield line
            start = end + 1
        pending += chunk[start:]
        if len(pending) > max_record:
            raise _record_over(len(pending), max_record, unfinished=True)
    if pending:
        yield bytes(pending)


def _record_over(size: int, limit: int, unfinished: bool = False) -> OverLimit:
    what = f"at least {size}" if unfinished else f"{size}"
    if limit == SINGLE_RECORD_CAP:
        return OverLimit(
            f"a record of {what} bytes is over {limit // MB} MB, the most a record is held whole "
            "with MaxPayloadInMB=0 (SingleRecord, or DataProcessing); MultiRecord without "
            "DataProcessing streams the object"
        )
    return OverLimit(f"a record of {what} bytes is over MaxPayloadInMB ({limit // MB} MB)")


async def mini_batches(
    lines: AsyncIterator[bytes], limit: int, single: bool
) -> AsyncIterator[tuple[bytearray, int]]:
    """(payload, records) per request: one record each (``single``), or as many whole records as
    fit in ``limit`` bytes. A payload is a fresh buffer the caller may keep."""
    batch = bytearray()
    count = 0
    async for line in lines:
        if batch and (single or len(batch) + len(line) > limit):
            yield batch, count
            batch, count = bytearray(), 0
        batch += line
        count += bool(line.strip())
    if batch:
        yield batch, count


async def slices(payload: bytes | bytearray) -> AsyncIterator[memoryview]:
    """A held payload as a request body, ``READ_BYTES`` at a time, without copying it."""
    view = memoryview(payload)
    for start in range(0, len(view), READ_BYTES):
        yield view[start : start + READ_BYTES]


@dataclass
class StreamedBody:
    """One object as one request body, counted as it is sent; over ``limit`` (0: none) it stops
    with :class:`OverLimit`, which breaks the request rather than ending it short."""

    source: AsyncIterator[bytes]
    limit: int
    sent: int = 0
    lines: int = 0
    over: OverLimit | None = None
    _open_line: bool = False  # the last line seen so far has content but no newline yet

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.source:
            self.sent += len(chunk)
            if self.limit and self.sent > self.limit:
                self.over = OverLimit(
                    f"an object of at least {self.sent} bytes is over MaxPayloadInMB "
                    f"({self.limit // MB} MB)"
                )
                raise self.over
            self._count(chunk)
            yield chunk

    def _count(self, chunk: bytes) -> None:
        *complete, last = chunk.split(b"\n")
        for part in complete:
            self.lines += self._open_line or bool(part.strip())
            self._open_line = False
        self._open_line = self._open_line or bool(last.strip())

    @property
    def records(self) -> int:
        """Non-blank lines seen (a last line without its newline included)."""
        return self.lines + self._open_line
