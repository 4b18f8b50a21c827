"""JSON Lines of decisions: one output record per input line, errors beside results.

Shared by `arbiter decide` and the adapter's `application/jsonlines` path, so a file scored locally
and the same file posted to a SageMaker endpoint give the same records.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pydantic import ValidationError

from adapter.errors import ArbiterError, InvalidDecision, MalformedRequest
from adapter.schema import DecisionRequest, DecisionResult


class Scorer(Protocol):
    def score(
        self, decisions: Sequence[DecisionRequest]
    ) -> list[DecisionResult | ArbiterError]: ...


def validation_error(exc: ValidationError, prefix: str | None = None) -> InvalidDecision:
    """The first pydantic error as a typed error naming its field (``options.2.id``)."""
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    param = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or None)
    message = first["msg"]
    if param:
        message = f"{param}: {message}"
    return InvalidDecision(message, param=param, code="invalid_field")


def parse_decision_line(line: str) -> DecisionRequest:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MalformedRequest(f"line is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidDecision("line must be a JSON object (one decision)", code="invalid_type")
    try:
        return DecisionRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def raw_id(line: str) -> Any:
    """The ``id`` of a line that failed validation, if it can be read at all (for its error)."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError:
        return None
    return raw.get("id") if isinstance(raw, dict) else None


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
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError:
                parsed.append((number, MalformedRequest("the line is not valid UTF-8"), None))
                continue
        try:
            decision = parse_decision_line(line)
            parsed.append((number, decision, decision.id))
        except ArbiterError as exc:
            parsed.append((number, exc, raw_id(line)))
    outcomes = iter(engine.score([d for _, d, _ in parsed if isinstance(d, DecisionRequest)]))
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
