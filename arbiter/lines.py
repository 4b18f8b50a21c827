"""JSON Lines of decisions: one reader, one parser and one record builder for every way in.

`arbiter decide` and `arbiter prompt` (a file), `POST /invocations` with `application/jsonlines`
(a streamed body) and S3 jobs (an object, run whole or in shards) read their lines here, so one
file gives the same records whichever way it comes in:

- a UTF-8 byte order mark at the very start is dropped (editors on Windows write one);
- a line ends at ``\\n``; the ``\\r`` of a CRLF is JSON whitespace; the last line needs no line end;
- a line of whitespace only has no record, but counts in the numbering records carry;
- a line is strict JSON (:func:`arbiter.jsonio.loads`): bytes that are not UTF-8 (Latin-1, say),
  ``NaN`` and ``Infinity``, and nesting past the parser's limit are ``invalid_json``;
- an invalid line's record echoes its ``id`` only when it is a string, a number or a boolean;
- a record is always strict JSON: a result that cannot be written (NaN) is an ``engine_failure``.
"""

from __future__ import annotations

import argparse
import codecs
import math
import re
import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from arbiter import jsonio
from arbiter.errors import ArbiterError, EngineFailure, InvalidDecision, PayloadTooLarge
from arbiter.logging import get_logger
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.scorer import Outcome, Scorer

log = get_logger("arbiter.lines")

PIECE = 1 << 20  # bytes read from a file at a time
BOM = codecs.BOM_UTF8
_BLANKS = re.compile(rb"[ \t\r\n\x0b\x0c]+")  # what bytes.strip() strips

Numbered = tuple[int, bytes | ArbiterError]


# -- reading ---------------------------------------------------------------------------------------


class LineReader:
    """Bytes fed in pieces of any size -> numbered non-blank lines, undecoded (a line that is not
    UTF-8 is its own error where it is parsed). ``number``: the lines ended so far, blank ones too.

    A line over ``max_line`` bytes is dropped as it streams by and given as ``too_long()``, so
    memory holds one line at most; runs of blank lines are skipped without being copied. Each
    :meth:`feed` must be iterated to its end before the next.
    """

    def __init__(
        self, max_line: int | None = None, too_long: Callable[[], ArbiterError] | None = None
    ) -> None:
        self.max_line = sys.maxsize if max_line is None else max_line
        self.too_long = too_long or (
            lambda: PayloadTooLarge(f"the line is over {self.max_line:,} bytes")
        )
        self.number = 0
        self._buf = bytearray()  # the start of the current line
        self._skipping = False  # the current line is over the limit: its bytes are dropped
        self._head: bytes | None = b""  # the first bytes, until they show whether a BOM leads

    def feed(self, piece: bytes) -> Iterator[Numbered]:
        """The lines that ``piece`` ends."""
        if self._head is not None:
            piece = self._head + piece
            if len(piece) < len(BOM) and BOM.startswith(piece):
                self._head = piece  # too short to tell yet
                return
            self._head = None
            piece = piece.removeprefix(BOM)
        buf = self._buf
        start, end = 0, len(piece)
        while start < end:
            if not buf and not self._skipping and (blank := _BLANKS.match(piece, start)):
                self.number += piece.count(b"\n", start, blank.end())
                start = blank.end()
                continue
            newline = piece.find(b"\n", start)
            if newline < 0:
                break
            self.number += 1
            if self._skipping or len(buf) + newline - start > self.max_line:
                yield self.number, self.too_long()
            else:
                buf += piece[start:newline]
                if buf.strip():
                    yield self.number, bytes(buf)
            buf.clear()
            self._skipping = False
            start = newline + 1
        if start < end and not self._skipping:
            if len(buf) + end - start > self.max_line:
                buf.clear()
                self._skipping = True
            else:
                buf += piece[start:end]

    def end(self) -> Iterator[Numbered]:
        """The last line, which needs no line end."""
        head, self._head = self._head, None
        if head:  # the whole input is shorter than a BOM and starts like one: it is a line
            yield from self.feed(head)
        if self._skipping:
            yield self.number + 1, self.too_long()
        elif self._buf.strip():
            yield self.number + 1, bytes(self._buf)
        self._buf.clear()
        self._skipping = False

    def lines(self, pieces: Iterable[bytes]) -> Iterator[Numbered]:
        for piece in pieces:
            yield from self.feed(piece)
        yield from self.end()

    async def alines(self, pieces: AsyncIterable[bytes]) -> AsyncIterator[Numbered]:
        """:meth:`lines` of a stream; an error the stream raises ends it (after the lines of the
        pieces before), and ``number`` then says how far it got."""
        async for piece in pieces:
            for line in self.feed(piece):
                yield line
        for line in self.end():
            yield line


def numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """A JSON Lines file's non-blank lines with their 1-based numbers (see the module doc)."""
    with path.open("rb") as handle:
        for number, line in LineReader().lines(iter(lambda: handle.read(PIECE), b"")):
            if isinstance(line, ArbiterError):  # none without a limit on a line's length
                raise line
            yield number, line


def chunk_size(text: str) -> int:
    """``--chunk N``: how many lines are grouped into one engine call; a positive count (``0``
    raised a traceback, ``-1`` printed nothing and exited 0)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of lines, not {text!r}")
    return value


# -- a decision ------------------------------------------------------------------------------------


# A union member's tag in an error's location (``function-after[unicode_text(), str]``,
# ``list[TextPart]``): pydantic's, not a field of the request.
_UNION_TAG = re.compile(r"^[\w-]+\[.*\]$")


def validation_error(exc: ValidationError, prefix: str | None = None) -> InvalidDecision:
    """The pydantic error as a typed error naming its field (``options.2.id``): the first one,
    or, where a union tried its members, the deepest (the member the input has the shape of: a
    list of content parts says which part, not that it is not a string), with the members'
    tags left out of the field's name."""
    errors = exc.errors()
    first = max(errors, key=lambda error: len(error["loc"]))
    if not any(isinstance(part, str) and _UNION_TAG.match(part) for part in first["loc"]):
        first = errors[0]
    parts = [p for p in first["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p))]
    loc = ".".join(str(part) for part in parts)
    param = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or None)
    message = first["msg"]
    if param:
        message = f"{param}: {message}"
    return InvalidDecision(message, param=param, code="invalid_field")


def validate_decision(raw: Any, prefix: str | None = None) -> DecisionRequest:
    """Parsed JSON as a decision, or ``InvalidDecision`` naming the field (under ``prefix``, such
    as ``decisions.3``): the one check every way in (HTTP, JSON Lines, job files) uses."""
    if not isinstance(raw, dict):
        raise InvalidDecision(
            f"{prefix or 'a decision'} must be a JSON object (one decision)",
            param=prefix,
            code="invalid_type",
        )
    try:
        return DecisionRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc, prefix) from exc
    except Exception as exc:  # a validator tripped over its input (depth, size): still its error
        raise InvalidDecision(
            f"the decision cannot be validated: {type(exc).__name__}: {exc}", param=prefix
        ) from exc


def echo_id(raw: Any) -> Any:
    """The ``id`` of a record that failed validation, for its error record: echoed only when it is
    a string, number or boolean (never a caller's deep structure)."""
    rid = raw.get("id") if isinstance(raw, dict) else None
    if isinstance(rid, str | bool | int) or (isinstance(rid, float) and math.isfinite(rid)):
        return rid
    return None


# -- parsing ---------------------------------------------------------------------------------------


def parse_decision_line(line: str | bytes) -> DecisionRequest:
    return validate_decision(jsonio.loads(line, "the line"))


class Item(NamedTuple):
    """One line (or a job's ``.json`` element) parsed: its 1-based number, the decision or the
    error it earned, the id its record carries, and its size in bytes (to bound a chunk)."""

    line: int
    value: DecisionRequest | ArbiterError
    id: Any = None
    size: int = 0


def parse_line(number: int, data: str | bytes | ArbiterError, what: str = "line") -> Item:
    """The decision in one line, or the error that says why there is none (an item that is already
    an error, a line too long to read, stays one)."""
    if isinstance(data, ArbiterError):
        return Item(number, data)
    raw: Any = None
    try:
        raw = jsonio.loads(data, f"the {what}")
        decision = validate_decision(raw)
    except ArbiterError as exc:
        return Item(number, exc, echo_id(raw), len(data))
    return Item(number, decision, decision.id, len(data))


# -- records ---------------------------------------------------------------------------------------


def record(number: int, rid: Any, outcome: Outcome) -> dict[str, Any]:
    """The output record of line ``number``: ``{"line", "id", "result" | "error"}``."""
    if isinstance(outcome, ArbiterError):
        return {"line": number, "id": rid, "error": outcome.to_dict()}
    return {"line": number, "id": rid, "result": outcome.model_dump(mode="json")}


def encode_record(number: int, rid: Any, outcome: Outcome) -> tuple[bytes, Outcome]:
    """The record as one line of strict JSON, and the outcome it holds: a result that cannot be
    written (NaN) becomes an ``engine_failure``, an id that cannot is left out."""
    try:
        return jsonio.dumps(record(number, rid, outcome), strict=True) + b"\n", outcome
    except (ValueError, TypeError, RecursionError) as exc:
        if not isinstance(outcome, ArbiterError):
            outcome = EngineFailure(f"the engine's result cannot be written as JSON: {exc}")
    for candidate in (rid, None):
        try:
            return jsonio.dumps(record(number, candidate, outcome), strict=True) + b"\n", outcome
        except (ValueError, TypeError, RecursionError):
            continue
    raise AssertionError("unreachable: an error record without an id is always JSON")


# -- scoring ---------------------------------------------------------------------------------------


Line = str | bytes | ArbiterError


def score_lines(
    engine: Scorer,
    batch: list[tuple[int, Line]],
    observe: Callable[[DecisionResult | ArbiterError], None] | None = None,
) -> list[tuple[bytes, Outcome]]:
    """Parse and score numbered lines in one engine call (shared states are grouped): each line's
    encoded record and the outcome it holds.

    An item may already be an error (a line too long to read); bad lines become error records.
    """
    parsed = [parse_line(number, line) for number, line in batch]
    decisions = [item.value for item in parsed if isinstance(item.value, DecisionRequest)]
    try:
        scored = engine.score(decisions) if decisions else []
    except Exception as exc:  # the whole call failed: each of its lines says so, none is lost
        if not isinstance(exc, ArbiterError):
            log.error("score_failed", error=repr(exc), exc_info=exc)
        failure = (
            exc
            if isinstance(exc, ArbiterError)
            else EngineFailure(f"not scored: {type(exc).__name__} in the engine; see the log")
        )
        scored = [failure] * len(decisions)
    outcomes = iter(scored)
    written: list[tuple[bytes, Outcome]] = []
    for item in parsed:
        outcome = next(outcomes) if isinstance(item.value, DecisionRequest) else item.value
        data, outcome = encode_record(item.line, item.id, outcome)
        if observe is not None:
            observe(outcome)
        written.append((data, outcome))
    return written
