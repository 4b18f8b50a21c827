"""Labeled task files for `arbiter eval` / `arbiter calibrate`, in two formats (detected per line).

**Arbiter's own**: one decision per line plus ``"label": <option id>``; optional ``tier``, ``family``
and ``split`` keys are read as metadata (they are not part of the decision).

**JevBench** (the public task format): ``id``, ``family``, ``group``, ``split``, ``state`` (string or
JSON), ``question: {type, instructions, criteria}``, ``labels`` and ``expected``. The question is
mapped exactly as `POST /v1/systemone` maps it (``arbiter.systemone.to_decisions``), so an eval
measures what the service answers:
- ``noul``: options ``true``/``false`` (criteria texts, default "Yes"/"No"); ``expected`` is
  ``"yes"``/``"no"`` (``true``/``false`` are accepted too).
- ``choice``: one option per criteria key; ``expected`` is the key. ``labels`` is the exact option
  order (criteria given as a list are matched to ``labels`` by position).
- ``score``: options ``"0"``..``"n-1"`` from the ordered criteria list; ``expected`` is the level index
  (an int or its string; a level's text listed in ``labels`` is accepted too).
Instructions that are objects are JSON-encoded (``systemone.text``).

A line that cannot be read is an error naming the file and line: a task file is fixed input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from arbiter.schema import DecisionRequest
from arbiter.systemone import SystemOneRequest, to_decisions

_META_KEYS = ("label", "tier", "family", "split", "group", "hard", "rationale")
_YES = {"yes", "true", "1"}
_NO = {"no", "false", "0"}
_TIERS = (("easy", "easy"), ("original", "standard"), ("standard", "standard"), ("hard", "hard"))


class TaskFileError(ValueError):
    """A task line that cannot be turned into a labeled decision."""


@dataclass(frozen=True)
class EvalItem:
    id: str
    file: str
    request: DecisionRequest
    label: str  # the correct option id
    tier: str | None = None
    family: str | None = None
    split: str | None = None

    @property
    def question_type(self) -> str:
        return self.request.question_type or "decision"

    @property
    def label_index(self) -> int:
        return [o.id for o in self.request.options].index(self.label)


def _tier(record: dict[str, Any], file: str) -> str | None:
    """The record's tier, or one named by a ``easy-``/``hard-``... prefix of its family/split/file."""
    if record.get("tier"):
        return str(record["tier"])
    for hint in (record.get("family"), record.get("split"), Path(file).stem):
        if not hint:
            continue
        hint = str(hint).lower()
        if "judge" in hint:
            return "judge"
        for prefix, tier in _TIERS:
            if hint == prefix or hint.startswith((prefix + "-", prefix + "_", prefix + "/")):
                return tier
    return None


def _arbiter_item(record: dict[str, Any], file: str) -> EvalItem:
    if "label" not in record:
        raise TaskFileError('an Arbiter-format line needs "label": the correct option id')
    decision = DecisionRequest.model_validate(
        {k: v for k, v in record.items() if k not in _META_KEYS}
    )
    label = str(record["label"])
    if label not in [o.id for o in decision.options]:
        raise TaskFileError(f"label {label!r} is not one of the option ids")
    return _item(record, file, decision.id, decision, label)


def _item(
    record: dict[str, Any], file: str, item_id: str, decision: DecisionRequest, label: str
) -> EvalItem:
    """The item, with the record's metadata (tier, family, split)."""
    return EvalItem(
        id=item_id,
        file=file,
        request=decision,
        label=label,
        tier=_tier(record, file),
        family=record.get("family"),
        split=record.get("split"),
    )


def _noul_label(expected: Any) -> str:
    value = str(expected).strip().lower()
    if value not in _YES | _NO:
        raise TaskFileError(f'noul expected must be "yes" or "no", not {expected!r}')
    return "true" if value in _YES else "false"


def _choice(criteria: Any, labels: list[str], expected: Any) -> tuple[dict[str, Any], str]:
    if isinstance(criteria, list):
        if len(labels) != len(criteria):
            raise TaskFileError("choice criteria given as a list need one label per criterion")
        criteria = dict(zip(labels, criteria, strict=True))
    elif isinstance(criteria, dict) and labels:
        if sorted(labels) != sorted(criteria):
            raise TaskFileError(
                f"labels {labels} are not the criteria keys {list(criteria)} (in any order)"
            )
        criteria = {key: criteria[key] for key in labels}
    label = str(expected)
    if not isinstance(criteria, dict) or label not in criteria:
        raise TaskFileError(f"expected {expected!r} is not a choice criteria key")
    return criteria, label


def _score_label(criteria: Any, labels: list[str], expected: Any) -> str:
    if not isinstance(criteria, list):
        raise TaskFileError("score criteria must be the ordered list of levels")
    text = str(expected).strip()
    if text.lstrip("-").isdigit():
        index = int(text)
    elif text in labels:
        index = labels.index(text)
    else:
        raise TaskFileError(f"score expected {expected!r} is not a level index")
    if not 0 <= index < len(criteria):
        raise TaskFileError(f"score expected {index} is outside 0..{len(criteria) - 1}")
    return str(index)


def _jevbench_question(record: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The System One question of a JevBench record, and its expected option id."""
    question = record["question"]
    kind = question.get("type")
    labels = [str(x) for x in record.get("labels") or []]
    expected = record.get("expected")
    if expected is None:
        raise TaskFileError('a JevBench line needs "expected"')
    criteria = question.get("criteria")
    if kind == "noul":
        label = _noul_label(expected)
    elif kind == "choice":
        criteria, label = _choice(criteria, labels, expected)
    elif kind == "score":
        label = _score_label(criteria, labels, expected)
    else:
        raise TaskFileError(f"question type {kind!r} is not noul, choice or score")
    mapped = {"type": kind, "instructions": question.get("instructions"), "criteria": criteria}
    return mapped, label


def _jevbench_item(record: dict[str, Any], file: str) -> EvalItem:
    for key in ("id", "state", "question"):
        if key not in record:
            raise TaskFileError(f"a JevBench line needs {key!r}")
    question, label = _jevbench_question(record)
    item_id = str(record["id"])
    request = SystemOneRequest.model_validate(
        {"model": "eval", "state": record["state"], "questions": {item_id: question}}
    )
    return _item(record, file, item_id, to_decisions(request)[0], label)


def parse_record(record: Any, file: str) -> EvalItem:
    if not isinstance(record, dict):
        raise TaskFileError("a task line must be a JSON object")
    if isinstance(record.get("question"), dict):
        return _jevbench_item(record, file)
    return _arbiter_item(record, file)


def load(paths: list[Path]) -> list[EvalItem]:
    """Every labeled item of every file, in file then line order."""
    items: list[EvalItem] = []
    seen: set[tuple[str, str]] = set()
    for path in paths:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    item = parse_record(json.loads(line), path.name)
                except json.JSONDecodeError as exc:
                    raise TaskFileError(f"{where}: not valid JSON: {exc}") from exc
                except (TaskFileError, ValidationError) as exc:
                    raise TaskFileError(f"{where}: {_first_line(exc)}") from exc
                except Exception as exc:  # SystemOneInvalid and friends
                    raise TaskFileError(f"{where}: {exc}") from exc
                if (path.name, item.id) in seen:
                    raise TaskFileError(f"{where}: duplicate id {item.id!r}")
                seen.add((path.name, item.id))
                items.append(item)
    return items


def _first_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False)[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(exc)
