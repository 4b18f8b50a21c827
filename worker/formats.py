"""Job formats: the bytes of an input object -> numbered items, each a decision or the typed error
that its line (JSON Lines) or element (``{"decisions": [...]}``) earned.

Memory stays bounded whatever the input. Gzip is inflated at most :data:`PIECE` bytes at a time, so a
gzip bomb is only a long stream. Each byte is scanned once: runs of blank lines are skipped in C, and
a line or element longer than ``max_item_bytes`` is dropped as it streams by and becomes one
``payload_too_large`` item. Whatever is wrong inside one line is that line's error item: bad UTF-8,
bad JSON, nesting too deep for the parser, an integer too long to convert, a schema error. Only a
broken stream ends the input early, with one error item: corrupt or truncated gzip, or a ``.json``
document whose structure breaks (a missing comma, an unterminated element).

Lines are split, parsed and given their records by :mod:`arbiter.lines`, as `arbiter decide` and
the HTTP JSON Lines path read theirs, so a file gives the same records whichever way it comes in.

The readers are async iterators of bounded items; :func:`raw_items_for` gives them undecoded, which is
what a large job is split into shards by (:mod:`worker.fanout.split`).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import AsyncIterator

from arbiter.errors import MalformedRequest, PayloadTooLarge
from arbiter.lines import BOM, Item, LineReader, Numbered, parse_line

PIECE = 1 << 20  # bytes read from S3, or inflated from gzip, at a time
DEFAULT_MAX_ITEM = 6 << 20  # as the adapter's largest JSON body

_WS = re.compile(rb"[ \t\r\n]*")
_PLAIN = re.compile(rb'[^"\[\]{}]*')  # inside a container, up to the next structural byte
_STRING = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # a string body, escapes included
_OPENS = re.compile(rb"[\[{]+")
_CLOSES = re.compile(rb"[\]}]+")
_SCALAR = re.compile(rb"[^,\]}\s]*")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPENERS = b"[{"


class CorruptInput(Exception):
    """The byte stream itself is broken (gzip): the input ends with one error item."""


# -- bytes -----------------------------------------------------------------------------------------


async def gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Inflate in pieces of at most :data:`PIECE` bytes, concatenated members included."""
    decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    in_member = False
    try:
        async for chunk in chunks:
            data = chunk
            while True:
                in_member = in_member or bool(data)
                out = decoder.decompress(data, PIECE)
                if out:
                    yield out
                if decoder.eof:  # a member ended; another may follow (`cat a.gz b.gz`)
                    in_member = False
                    data = decoder.unused_data
                    decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    if not data:
                        break
                elif decoder.unconsumed_tail:
                    data = decoder.unconsumed_tail
                elif len(out) == PIECE:
                    data = b""  # the input is used up, but zlib may still hold output
                else:
                    break
    except zlib.error as exc:
        raise CorruptInput(f"the input is not valid gzip: {exc}") from exc
    if in_member:
        raise CorruptInput("the gzip input is truncated")


async def _without_bom(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Drop a UTF-8 byte order mark at the very start of a ``.json`` document (a JSON Lines
    input's is dropped by its :class:`~arbiter.lines.LineReader`)."""
    head = b""
    started = False
    async for chunk in chunks:
        if started:
            yield chunk
            continue
        head += chunk
        if len(head) < len(BOM) and BOM.startswith(head):
            continue  # too short to tell yet
        started = True
        if rest := head.removeprefix(BOM):
            yield rest
    if not started and head:
        yield head


def _too_large(what: str, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the {what} is over {limit:,} bytes (ARBITER_MAX_LINE_BYTES)")


def _corrupt(exc: CorruptInput) -> MalformedRequest:
    return MalformedRequest(f"{exc}; nothing after this point was read", code="invalid_gzip")


# -- JSON Lines ------------------------------------------------------------------------------------


async def lines(
    chunks: AsyncIterator[bytes], max_line: int = DEFAULT_MAX_ITEM
) -> AsyncIterator[Numbered]:
    """Non-blank lines numbered from 1 (:class:`~arbiter.lines.LineReader`, as every way in reads
    them); a line over ``max_line`` bytes is skipped unread and given as :class:`PayloadTooLarge`;
    a broken gzip stream ends the input with one ``invalid_gzip`` line."""
    reader = LineReader(max_line, lambda: _too_large("line", max_line))
    try:
        async for line in reader.alines(chunks):
            yield line
    except CorruptInput as exc:
        yield reader.number + 1, _corrupt(exc)


async def decode_items(raw: AsyncIterator[Numbered], what: str = "line") -> AsyncIterator[Item]:
    """Numbered raw lines (or elements) -> items: each parsed, or kept as the error it already is."""
    async for number, data in raw:
        yield parse_line(number, data, what)


def jsonl_items(
    chunks: AsyncIterator[bytes], max_line: int = DEFAULT_MAX_ITEM
) -> AsyncIterator[Item]:
    """One item per non-blank line: the decision, or the typed error that line earned."""
    return decode_items(lines(chunks, max_line))


# -- one JSON document -----------------------------------------------------------------------------


class _Document:
    """A byte window over a streamed JSON document, with a scanner that finds where each value
    ends (tracking strings and bracket depth, not building anything) in one pass."""

    def __init__(self, chunks: AsyncIterator[bytes], max_item: int) -> None:
        self._chunks = chunks
        self.max_item = max_item
        self.buf = bytearray()
        self.pos = 0

    async def _more(self) -> bool:
        try:
            piece = await anext(self._chunks)
        except StopAsyncIteration:
            return False
        self.buf += piece
        return True

    def _drop(self, upto: int) -> int:
        """Forget the bytes before ``upto``; returns how far positions moved."""
        del self.buf[:upto]
        self.pos = max(0, self.pos - upto)
        return upto

    async def peek(self) -> int | None:
        """The next non-blank byte (not consumed); None at the end of the document."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            self._drop(self.pos)
            if not await self._more():
                return None

    async def expect(self, chars: bytes, where: str) -> int:
        found = await self.peek()
        if found is None or found not in chars:
            shown = "the end of the document" if found is None else repr(chr(found))
            options = " or ".join(repr(chr(c)) for c in chars)
            raise MalformedRequest(
                f"the document is not valid JSON: expected {options} {where}, found {shown}"
            )
        self.pos += 1
        return found

    async def value(self, keep: bool = True) -> bytes | None:
        """The next JSON value's bytes; None if it is over ``max_item`` or ``keep`` is False (its
        bytes are dropped as they are scanned). The value is checked only for where it ends."""
        if await self.peek() is None:
            raise MalformedRequest(
                "the document is not valid JSON: it ends where a value was expected"
            )
        first = self.buf[self.pos]
        scan = self.pos
        depth = 0
        in_string = first == _QUOTE
        if in_string:
            scan += 1
        elif first not in _OPENERS:
            return await self._scalar(keep)
        while True:
            scan, done, depth, in_string = _scan(self.buf, scan, depth, in_string)
            if done:
                return self._take(scan, keep)
            scan, keep = await self._grow(scan, keep)

    def _take(self, end: int, keep: bool) -> bytes | None:
        data = bytes(self.buf[self.pos : end]) if keep and end - self.pos <= self.max_item else None
        self.pos = end
        return data

    async def _scalar(self, keep: bool) -> bytes | None:
        scan = self.pos
        while True:
            scan = _SCALAR.match(self.buf, scan).end()  # type: ignore[union-attr]
            if scan < len(self.buf):
                return self._take(scan, keep)
            scan, keep = await self._grow(scan, keep)

    async def _grow(self, scan: int, keep: bool) -> tuple[int, bool]:
        """More bytes for a value scanned up to ``scan`` that has not ended: the value's bytes are
        kept while it fits ``max_item``, else dropped as scanned. Returns the scan position in the
        new buffer and whether the value is still kept."""
        if scan - self.pos > self.max_item:
            keep = False
        scan -= self._drop(scan if not keep else self.pos)
        if not keep:
            self.pos = 0
        if not await self._more():
            raise MalformedRequest("the document is not valid JSON: it ends inside a value")
        return scan, keep


def _scan(buf: bytearray, scan: int, depth: int, in_string: bool) -> tuple[int, bool, int, bool]:
    """Advance over a value's bytes from ``scan``: (position, ended, depth, inside a string). Runs of
    plain bytes, escapes and brackets are matched by regular expressions, not byte by byte."""
    end = len(buf)
    while scan < end:
        if in_string:
            scan = _STRING.match(buf, scan).end()  # type: ignore[union-attr]
            if scan >= end or buf[scan] == _BACKSLASH:  # a lone backslash ends the piece
                break
            scan += 1
            in_string = False
            if depth == 0:
                return scan, True, 0, False
            continue
        scan = _PLAIN.match(buf, scan).end()  # type: ignore[union-attr]
        if scan >= end:
            break
        byte = buf[scan]
        if byte == _QUOTE:
            in_string = True
            scan += 1
        elif byte in _OPENERS:
            run = _OPENS.match(buf, scan).end()  # type: ignore[union-attr]
            depth += run - scan
            scan = run
        else:
            run = _CLOSES.match(buf, scan).end()  # type: ignore[union-attr]
            if run - scan >= depth:
                return scan + depth, True, 0, False
            depth -= run - scan
            scan = run
    return scan, False, depth, in_string


def json_items(
    chunks: AsyncIterator[bytes], max_item: int = DEFAULT_MAX_ITEM
) -> AsyncIterator[Item]:
    """``{"decisions": [...]}`` read element by element; ``line`` is the 1-based element index.

    An element that is not a valid decision (bad JSON inside, too deep, too large) is its own error
    item and reading goes on. A break in the document's own structure ends it: one error item at
    the next index, and reading stops (what follows cannot be located reliably).
    """
    return decode_items(json_elements(chunks, max_item), "element")


async def json_elements(
    chunks: AsyncIterator[bytes], max_item: int = DEFAULT_MAX_ITEM
) -> AsyncIterator[Numbered]:
    """The elements of ``"decisions"`` as raw bytes, numbered from 1, undecoded (see
    :func:`json_items`): an element over ``max_item`` or a break in the document is an error."""
    doc = _Document(chunks, max_item)
    emitted = 0
    found = False
    try:
        await doc.expect(b"{", "at the start")
        if await doc.peek() == ord("}"):
            doc.pos += 1
        else:
            while True:
                key = _key(await doc.value())
                await doc.expect(b":", "after a key")
                if key != "decisions":
                    await doc.value(keep=False)
                else:
                    found = True
                    async for number, data in _elements(doc, emitted):
                        emitted = number
                        yield number, data
                if await doc.expect(b",}", "after a value") == ord("}"):
                    break
        if await doc.peek() is not None:
            raise MalformedRequest("the document is not valid JSON: content after its end")
        if not found:
            yield 1, MalformedRequest('the document has no "decisions" array', param="decisions")
    except MalformedRequest as exc:
        yield emitted + 1, exc
    except CorruptInput as exc:
        yield emitted + 1, _corrupt(exc)


def _key(data: bytes | None) -> str:
    try:
        key = json.loads((data or b"").decode("utf-8"))
    except (ValueError, RecursionError):
        key = None
    if not isinstance(key, str):
        raise MalformedRequest("the document is not valid JSON: expected a string key")
    return key


async def _elements(doc: _Document, emitted: int) -> AsyncIterator[Numbered]:
    await doc.expect(b"[", 'after "decisions":')
    if await doc.peek() == ord("]"):
        doc.pos += 1
        return
    index = emitted
    while True:
        index += 1
        data = await doc.value()
        yield index, _too_large("element", doc.max_item) if data is None else data
        if await doc.expect(b",]", "after an element") == ord("]"):
            return


def item_kind(key: str) -> str:
    """What one item of the job at ``key`` is called in error messages: a line or an element."""
    return "element" if key.removesuffix(".gz").endswith(".json") else "line"


def raw_items_for(
    key: str, chunks: AsyncIterator[bytes], max_item_bytes: int = DEFAULT_MAX_ITEM
) -> AsyncIterator[Numbered]:
    """The numbered, undecoded lines (or elements) of a job object, by its key's suffix
    (``.jsonl``/``.json``, optionally ``.gz``): what a job is split into shards by."""
    if key.endswith(".gz"):
        chunks = gunzip(chunks)
    if item_kind(key) == "element":
        return json_elements(_without_bom(chunks), max_item_bytes)
    return lines(chunks, max_item_bytes)


def items_for(
    key: str, chunks: AsyncIterator[bytes], max_item_bytes: int = DEFAULT_MAX_ITEM
) -> AsyncIterator[Item]:
    """The items of a job object, by its key's suffix (``.jsonl``/``.json``, optionally ``.gz``)."""
    return decode_items(raw_items_for(key, chunks, max_item_bytes), item_kind(key))
