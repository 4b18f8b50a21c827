"""System One mapping: questions to decisions, results to answers (real engine where it matters)."""

from __future__ import annotations

from typing import Any

import pytest

from arbiter import systemone
from arbiter.engine import Engine
from arbiter.schema import DecisionResult

STATE = {"ticket": "I was charged twice for March.", "customer": {"plan": "pro"}}


def _request(**questions: Any) -> systemone.SystemOneRequest:
    return systemone.parse_request({"model": "default", "state": STATE, "questions": questions})


def test_noul_maps_true_first_with_defaults_and_criteria() -> None:
    req = _request(
        a={"type": "noul", "instructions": "Is it about billing?"},
        b={"type": "noul", "criteria": {"true": "It is a refund request", "false": {"k": "v"}}},
    )
    a, b = systemone.to_decisions(req)
    assert [(o.id, o.description) for o in a.options] == [("true", "Yes"), ("false", "No")]
    assert a.question == "Is it about billing?"
    assert [o.description for o in b.options] == ["It is a refund request", '{"k": "v"}']


def test_choice_keeps_order_and_null_description_stands_alone() -> None:
    req = _request(
        q={"type": "choice", "criteria": {"zeta": None, "alpha": "Billing team", "mid": ""}}
    )
    (d,) = systemone.to_decisions(req)
    assert [o.id for o in d.options] == ["zeta", "alpha", "mid"]
    assert [o.description for o in d.options] == ["zeta", "alpha: Billing team", "mid"]


def test_score_levels_and_structured_instructions_keep_key_order() -> None:
    req = _request(
        s={
            "type": "score",
            "instructions": {"z": 1, "a": 2},
            "criteria": ["low", {"x": "mid"}, "high"],
        }
    )
    (d,) = systemone.to_decisions(req)
    assert d.question == '{"z": 1, "a": 2}'
    assert [o.id for o in d.options] == ["0", "1", "2"]
    assert d.options[1].description == '{"x": "mid"}'


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"model": "default", "state": "s", "questions": {}}, ["body", "questions"]),
        ({"state": "s", "questions": {"q": {"type": "noul"}}}, ["body", "model"]),
        (
            {"model": "default", "state": "", "questions": {"q": {"type": "noul"}}},
            ["body", "state"],
        ),
        (
            {
                "model": "default",
                "state": "s",
                "questions": {"q": {"type": "choice", "criteria": {"a": None}}},
            },
            ["body", "questions", "q", "criteria"],
        ),
        (
            {
                "model": "default",
                "state": "s",
                "questions": {"q": {"type": "score", "criteria": ["x"] * 256}},
            },
            ["body", "questions", "q", "criteria"],
        ),
        (
            {
                "model": "default",
                "state": "s",
                "questions": {"q": {"type": "noul", "criteria": {"maybe": "x"}}},
            },
            ["body", "questions", "q", "criteria", "maybe"],
        ),
        (
            {"model": "default", "state": "s", "questions": {"q": {"type": "box"}}},
            ["body", "questions", "q"],
        ),
    ],
)
def test_validation_errors_name_the_field(body: dict[str, Any], loc: list[Any]) -> None:
    with pytest.raises(systemone.SystemOneInvalid) as info:
        systemone.parse_request(body)
    assert info.value.detail[0]["loc"][: len(loc)] == loc, info.value.detail
    assert info.value.status == 422


def test_unknown_model_is_refused_and_aliases_are_accepted() -> None:
    systemone.check_model("jev-latest", "arbiter/x")
    systemone.check_model("default", "arbiter/x")
    systemone.check_model("arbiter/x", "arbiter/x")
    with pytest.raises(systemone.SystemOneInvalid) as info:
        systemone.check_model("gpt-9", "arbiter/x")
    assert info.value.detail[0]["loc"] == ["body", "model"]


def test_confidence_formula() -> None:
    assert systemone.confidence([0.5, 0.5]) == 0.0
    assert systemone.confidence([1.0, 0.0, 0.0]) == 1.0
    assert systemone.confidence([0.6, 0.3, 0.1]) == pytest.approx((3 * 0.6 - 1) / 2)


def test_answers_from_the_real_engine_share_one_state(engine: Engine) -> None:
    req = _request(
        billing={"type": "noul", "instructions": "Is this about billing?"},
        team={
            "type": "choice",
            "instructions": "Which team?",
            "criteria": {"billing": None, "tech": None},
        },
        urgency={
            "type": "score",
            "instructions": "How urgent?",
            "criteria": ["low", "medium", "high"],
        },
    )
    decisions = systemone.to_decisions(req)
    outcomes = engine.score(decisions)
    body = systemone.assemble(req, outcomes, "arbiter/gemma")
    answers = body["answers"]
    assert list(answers) == ["billing", "team", "urgency"]
    assert set(answers["billing"]) == {"type", "noul"} and 0 < answers["billing"]["noul"] < 1
    assert answers["team"]["choice"] in {"billing", "tech"}
    assert sum(answers["team"]["probabilities"].values()) == pytest.approx(1.0)
    probs = answers["urgency"]["probabilities"]
    assert list(probs) == ["0", "1", "2"]
    assert answers["urgency"]["score"] == pytest.approx(sum(int(k) * p for k, p in probs.items()))
    assert answers["urgency"]["legend"] == {"0": "low", "1": "medium", "2": "high"}
    results = [o for o in outcomes if isinstance(o, DecisionResult)]
    prefix = results[0].prompt.prefix_tokens
    assert all(r.prompt.prefix_tokens == prefix for r in results)
    assert body["usage"] == {
        "input_tokens": prefix + sum(r.prompt.input_tokens - prefix for r in results),
        "output_tokens": 0,
    }
    assert body["usage"]["input_tokens"] < sum(r.prompt.input_tokens for r in results)


def test_a_server_side_failure_is_not_reported_as_the_callers_422() -> None:
    from arbiter.errors import EngineFailure, TooManyOptions
    from tests.fakes import uniform_result

    req = _request(a={"type": "noul"}, b={"type": "noul"})
    a, _ = systemone.to_decisions(req)
    with pytest.raises(EngineFailure):
        systemone.assemble(req, [uniform_result(a), EngineFailure("boom")], "arbiter/x")
    with pytest.raises(systemone.SystemOneInvalid) as info:
        systemone.assemble(req, [uniform_result(a), TooManyOptions("many", param="options")], "m")
    assert info.value.detail[0]["loc"] == ["body", "questions", "b", "criteria"]
    with pytest.raises(systemone.SystemOneInvalid) as info:
        systemone.assemble(
            req, [uniform_result(a), TooManyOptions("long", param="options.1.description")], "m"
        )
    assert info.value.detail[0]["loc"] == ["body", "questions", "b", "criteria", "false"]


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "state",
    ["Order \ud800 arrived", {"k": ["ok", "\udfff"]}, {"deep": _nested(80)}],
    ids=["surrogate", "surrogate in JSON", "nested 80 deep"],
)
def test_a_bad_state_is_named_at_body_state(state: Any) -> None:
    """The state is one top-level field: it used to be reported at questions.<id>.criteria."""
    body = {"model": "default", "state": state, "questions": {"a": {"type": "noul"}}}
    request = systemone.parse_request(body)
    with pytest.raises(systemone.SystemOneInvalid) as info:
        systemone.to_decisions(request)
    assert info.value.detail[0]["loc"] == ["body", "state"]


def test_a_state_too_long_for_every_question_is_named_once_at_body_state() -> None:
    from arbiter.errors import ContextLengthExceeded

    req = _request(a={"type": "noul"}, b={"type": "choice", "criteria": {"x": None, "y": "Y"}})
    too_long = ContextLengthExceeded("the prompt is 9000 tokens", param="state")
    with pytest.raises(systemone.SystemOneInvalid) as info:
        systemone.assemble(req, [too_long, too_long], "m")
    assert [d["loc"] for d in info.value.detail] == [["body", "state"]]
    long_option = ContextLengthExceeded("long", param="options.1.description")
    with pytest.raises(systemone.SystemOneInvalid) as info:
        systemone.refuse(req, [None, long_option])
    assert info.value.detail[0]["loc"] == ["body", "questions", "b", "criteria", "y"]
