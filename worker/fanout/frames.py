"""The shard input format: the numbered raw items of one shard, exactly as the whole job reads them.

Per item a header line ``<number> d <length>`` (a raw line or element) or ``<number> e <length>``
(the error the reader gave it, as JSON), then that many bytes and a newline. Raw items keep their
exact bytes, so a shard's records equal those the whole job would give, line for line; the same
input cut by the same plan gives the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from arbiter.errors import ArbiterError, MalformedRequest, PayloadTooLarge
from worker.formats import PIECE
from worker.jobs import JobRejected

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


class DamagedShard(JobRejected):
    """A shard input that does not parse, or holds other items than its plan says: written by a
    broken or foreign writer. No retry reads other bytes, so the shard fails at once."""


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
