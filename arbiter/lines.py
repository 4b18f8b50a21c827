"""JSON Lines of decisions: one output record per input line, errors beside results.

Shared by `arbiter decide` and the adapter's `application/jsonlines` path, so a file scored locally
and the same file posted to a SageMaker endpoint give the same records.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from arbiter import jsonio
from arbiter.errors import ArbiterError, EngineFailure, InvalidDecision
from arbiter.logging import get_logger
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.scorer import Scorer

log = get_logger("arbiter.lines")


def numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """A JSON Lines file's non-blank lines with their 1-based numbers, as bytes split at ``\n``
    (as a job's or an HTTP body's lines are read): a line that is not UTF-8 is decoded where it is
    parsed and becomes its own ``invalid_json`` record, never a traceback that stops the whole
    command at that line (as reading the file as text would)."""
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
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


def parse_decision_line(line: str | bytes) -> DecisionRequest:
    return validate_decision(jsonio.loads(line, "the line"))


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


Line = str | bytes | ArbiterError


def score_lines(
    engine: Scorer,
    batch: list[tuple[int, Line]],
    observe: Callable[[DecisionResult | ArbiterError], None] | None = None,
) -> list[dict[str, Any]]:
    """Parse and score numbered lines in one engine call (shared states are grouped).

    An item may already be an error (a line too long to read); bad lines become error records.
    """
    parsed: list[tuple[int, DecisionRequest | ArbiterError, Any]] = []
    for number, line in batch:
        if isinstance(line, ArbiterError):
            parsed.append((number, line, None))
            continue
        raw: Any = None
        try:
            raw = jsonio.loads(line, "the line")
            decision = validate_decision(raw)
            parsed.append((number, decision, decision.id))
        except ArbiterError as exc:
            parsed.append((number, exc, echo_id(raw)))
    decisions = [d for _, d, _ in parsed if isinstance(d, DecisionRequest)]
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
    records: list[dict[str, Any]] = []
    for number, item, rid in parsed:
        outcome = next(outcomes) if isinstance(item, DecisionRequest) else item
        if observe is not None:
            observe(outcome)
        if isinstance(outcome, ArbiterError):
            records.append({"line": number, "id": rid, "error": outcome.to_dict()})
        else:
            records.append({"line": number, "id": rid, "result": outcome.model_dump()})
    return records
