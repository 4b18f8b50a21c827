"""TypeSafe System One (`POST /v1/systemone`): its wire models and the mapping onto decisions.

A System One request is one state and a map of questions. Each question becomes one decision over
that state (so all of them share one prefill), and each result becomes the answer shape the official
SDK validates strictly: every number a float, score keys as strings of integers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from arbiter.errors import ArbiterError
from arbiter.schema import MAX_OPTIONS, DecisionRequest, DecisionResult

Text = str | dict[str, Any] | list[Any]
ALIASES = ("jev-latest", "default")
MAX_QUESTIONS = 256
NOUL_DEFAULTS = {"true": "Yes", "false": "No"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoulCriteria(_Strict):
    true: Text | None = None
    false: Text | None = None


class NoulQuestion(_Strict):
    type: Literal["noul"]
    instructions: Text | None = None
    criteria: NoulCriteria | None = None


class ChoiceQuestion(_Strict):
    type: Literal["choice"]
    instructions: Text | None = None
    criteria: dict[str, Text | None] = Field(min_length=2, max_length=MAX_OPTIONS)

    @field_validator("criteria")
    @classmethod
    def _names(cls, criteria: dict[str, Text | None]) -> dict[str, Text | None]:
        for name in criteria:
            if not name.strip():
                raise ValueError("choice names must not be blank")
        return criteria


class ScoreQuestion(_Strict):
    type: Literal["score"]
    instructions: Text | None = None
    criteria: list[Text] = Field(min_length=2, max_length=MAX_OPTIONS)


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class SystemOneRequest(_Strict):
    model: str = Field(min_length=1)
    state: Text
    questions: dict[str, Question] = Field(min_length=1, max_length=MAX_QUESTIONS)

    @field_validator("state")
    @classmethod
    def _state(cls, state: Text) -> Text:
        if isinstance(state, str) and not state.strip():
            raise ValueError("state must not be empty")
        if not isinstance(state, str) and not state:
            raise ValueError("state must not be an empty object or array")
        return state


class SystemOneInvalid(ArbiterError):
    """A request the System One API refuses with 422 and FastAPI's ``{"detail": [...]}`` body."""

    status = 422
    type = "invalid_request_error"
    code = "validation_error"

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        first = detail[0]
        super().__init__(first["msg"], param=".".join(str(p) for p in first["loc"][1:]) or None)
        self.detail = detail


def _detail(loc: list[Any], msg: str, kind: str = "value_error") -> dict[str, Any]:
    where = loc if loc[:1] == ["header"] else ["body", *loc]  # FastAPI names a header so
    return {"loc": where, "msg": msg, "type": kind}


def parse_request(raw: Any) -> SystemOneRequest:
    if not isinstance(raw, dict):
        raise SystemOneInvalid([_detail([], "the body must be a JSON object", "dict_type")])
    try:
        return SystemOneRequest.model_validate(raw)
    except ValidationError as exc:
        detail = []
        for err in exc.errors(include_url=False):
            loc = list(err["loc"])
            # pydantic names the union member it tried ("choice"); clients only know their own path.
            if len(loc) >= 3 and loc[0] == "questions" and loc[2] in ("noul", "choice", "score"):
                del loc[2]
            detail.append(_detail(loc, err["msg"], err["type"]))
        raise SystemOneInvalid(detail) from exc


def text(value: Text) -> str:
    """Instructions and criteria as the model reads them: strings verbatim, JSON with key order kept."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _options(question: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> list[tuple[str, str]]:
    if isinstance(question, NoulQuestion):
        criteria = question.criteria or NoulCriteria()
        return [
            (key, text(value) if value is not None else NOUL_DEFAULTS[key])
            for key, value in (("true", criteria.true), ("false", criteria.false))
        ]
    if isinstance(question, ChoiceQuestion):
        return [
            (name, f"{name}: {text(desc)}" if desc not in (None, "") else name)
            for name, desc in question.criteria.items()
        ]
    return [(str(i), text(level)) for i, level in enumerate(question.criteria)]


_DEFAULT_INSTRUCTIONS = {
    "noul": "Is the statement true for this state?",
    "choice": "Which option fits the state best?",
    "score": "Which level describes the state best?",
}


def location(
    qid: str, question: NoulQuestion | ChoiceQuestion | ScoreQuestion, param: str | None
) -> list[Any]:
    """Where a decision's field lives in the System One body: the one ``state`` at the top (there
    is no ``questions.<id>.state``), a question's ``instructions`` and ``criteria`` (down to the
    criterion) under its id."""
    parts = param.split(".") if param else []
    if not parts:
        return ["questions", qid]  # not one field's (a time budget spent before it was scored)
    if parts[0] == "state":
        return ["state"]
    if parts[0] in ("max_error", "min_confidence"):
        return ["header", f"x-arbiter-{parts[0].replace('_', '-')}"]
    if parts[0] == "question":
        return ["questions", qid, "instructions"]
    if parts[0] == "options":
        loc: list[Any] = ["questions", qid, "criteria"]
        if len(parts) > 1 and parts[1].isdigit():
            keys = [key for key, _ in _options(question)]
            index = int(parts[1])
            if index < len(keys):
                loc.append(index if isinstance(question, ScoreQuestion) else keys[index])
        return loc
    return ["questions", qid, *parts]


def to_decisions(request: SystemOneRequest) -> list[DecisionRequest]:
    """One decision per question, in the request's question order; ids are the question ids."""
    decisions = []
    for qid, question in request.questions.items():
        instructions = question.instructions
        prompt = text(instructions) if instructions not in (None, "") else None
        try:
            decisions.append(
                DecisionRequest.model_validate(
                    {
                        "id": qid or "_",
                        "state": request.state,
                        "question": prompt or _DEFAULT_INSTRUCTIONS[question.type],
                        "question_type": question.type,
                        "options": [
                            {"id": oid, "description": desc} for oid, desc in _options(question)
                        ],
                    }
                )
            )
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            param = ".".join(str(part) for part in first["loc"])
            raise SystemOneInvalid(
                [_detail(location(qid, question, param), first["msg"], first["type"])]
            ) from exc
    return decisions


def confidence(probabilities: list[float]) -> float:
    n = len(probabilities)
    return float(min(1.0, max(0.0, (n * max(probabilities) - 1) / (n - 1))))


def answer(
    question: NoulQuestion | ChoiceQuestion | ScoreQuestion, result: DecisionResult
) -> dict[str, Any]:
    """The SDK's answer shape; a decision held to an error budget or a minimum confidence adds
    ``abstained`` and its ``abstention`` (keys the SDK's models ignore, so it reads them as
    before; a client that wants them reads the raw JSON)."""
    probs = {oid: float(p) for oid, p in zip(result.option_ids, result.probabilities, strict=True)}
    out: dict[str, Any]
    if isinstance(question, NoulQuestion):
        out = {"type": "noul", "noul": probs["true"]}
    elif isinstance(question, ChoiceQuestion):
        out = {
            "type": "choice",
            "choice": result.choice,
            "probabilities": probs,
            "confidence": confidence(result.probabilities),
        }
    else:
        out = {
            "type": "score",
            "score": float(sum(int(k) * p for k, p in probs.items())),
            "legend": {str(i): level for i, level in enumerate(question.criteria)},
            "probabilities": probs,
            "confidence": confidence(result.probabilities),
        }
    if result.abstention is not None:
        out["abstained"] = result.abstained
        out["abstention"] = result.abstention.model_dump()
    return out


def with_budget(
    decisions: list[DecisionRequest], max_error: float | None, min_confidence: float | None
) -> list[DecisionRequest]:
    """Every question held to the request's error budget or minimum confidence (the headers
    ``X-Arbiter-Max-Error`` / ``X-Arbiter-Min-Confidence``: System One's body has no place)."""
    if max_error is None and min_confidence is None:
        return decisions
    update = {"max_error": max_error, "min_confidence": min_confidence}
    return [d.model_copy(update=update) for d in decisions]


def assemble(
    request: SystemOneRequest, outcomes: list[DecisionResult | ArbiterError], model_id: str
) -> dict[str, Any]:
    """The System One response, or a 422 naming the question a limit refused (a fault on the
    server's side is raised as itself: it is not the caller's to fix)."""
    refuse(request, outcomes)
    results = [o for o in outcomes if isinstance(o, DecisionResult)]
    # The state prefix is prefilled once for all questions: count it once.
    prefix = max((r.prompt.prefix_tokens for r in results), default=0)
    input_tokens = prefix + sum(r.prompt.input_tokens - r.prompt.prefix_tokens for r in results)
    return {
        "model": model_id,
        "answers": {
            qid: answer(question, result)
            for (qid, question), result in zip(request.questions.items(), results, strict=True)
        },
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }


def refuse(
    request: SystemOneRequest, outcomes: Sequence[DecisionResult | ArbiterError | None]
) -> None:
    """Raise the 422 naming every field a limit refused (None: not refused); a fault on the
    server's side is raised as itself. A state refused for every question is named once."""
    for outcome in outcomes:
        if isinstance(outcome, ArbiterError) and outcome.status >= 500:
            raise outcome
    failures: list[dict[str, Any]] = []
    for (qid, question), o in zip(request.questions.items(), outcomes, strict=True):
        if isinstance(o, ArbiterError):
            failure = _detail(location(qid, question, o.param), o.message)
            if failure not in failures:
                failures.append(failure)
    if failures:
        raise SystemOneInvalid(failures)


def check_model(requested: str, served_id: str) -> None:
    if requested not in (served_id, *ALIASES):
        raise SystemOneInvalid(
            [
                _detail(
                    ["model"],
                    f"unknown model {requested!r}; this server serves {served_id!r} "
                    f"(aliases: {', '.join(ALIASES)})",
                )
            ]
        )
