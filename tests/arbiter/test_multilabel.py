"""Multi-label questions: each option a yes/no question of its own over the one state, prefilled
once, merged into per-option probabilities and the options that hold."""

from __future__ import annotations

import pytest

from arbiter.engine import Engine, multilabel
from arbiter.errors import TooManyOptions
from arbiter.schema import DecisionResult
from tests.fakes import decision, uniform_result

LABELS = [
    ("billing", "A billing problem"),
    ("login", "A login problem"),
    ("ship", "A delivery problem"),
]


def _multi(id: str = "m1") -> object:
    return decision(
        id, state="I was charged twice and now I cannot log in.", options=LABELS
    ).model_copy(
        update={
            "question_type": "multi_label",
            "question": "Which problems does the customer report?",
        }
    )


def test_expand_and_merge() -> None:
    request = _multi()
    plain = decision("p")
    expanded, plan = multilabel.expand([request, plain])  # type: ignore[list-item]
    assert plan is not None and plan.slots == [[0, 1, 2], [3]]
    assert [d.question_type for d in expanded[:3]] == ["noul"] * 3
    assert all([o.id for o in d.options] == ["true", "false"] for d in expanded[:3])
    assert all(d.state == request.state for d in expanded[:3])  # type: ignore[attr-defined]
    assert "A login problem" in expanded[1].question
    parts = []
    for d, p_yes in zip(expanded[:3], (0.9, 0.7, 0.1), strict=True):
        r = uniform_result(d).model_copy(update={"probabilities": [p_yes, 1 - p_yes]})
        parts.append(r)
    merged = multilabel.merge([request, plain], [*parts, uniform_result(plain)], plan)  # type: ignore[list-item]
    first = merged[0]
    assert isinstance(first, DecisionResult)
    assert first.option_ids == ["billing", "login", "ship"]
    assert first.probabilities == pytest.approx([0.9, 0.7, 0.1])
    assert (first.choice, first.choices) == ("billing", ["billing", "login"])
    assert first.prompt.version.endswith("+multi-label")
    failed = multilabel.merge(
        [request, plain],
        [parts[0], TooManyOptions("x"), parts[2], uniform_result(plain)],
        plan,  # type: ignore[list-item]
    )
    assert isinstance(failed[0], TooManyOptions) and isinstance(failed[1], DecisionResult)


def test_engine_reads_each_label_on_one_prefill(engine: Engine) -> None:
    got = engine.score([_multi()])[0]  # type: ignore[list-item]
    assert isinstance(got, DecisionResult), got
    assert got.option_ids == ["billing", "login", "ship"]
    assert all(0 < p < 1 for p in got.probabilities)
    assert got.choices == [
        i for i, p in zip(got.option_ids, got.probabilities, strict=True) if p >= 0.5
    ]
    assert got.orders_read >= 3  # one yes/no read (or two, adaptively) per option
    # The state is prefilled once: the tokens counted are one prefix and each option's suffix.
    alone = engine.score(
        [decision("x", state=_multi().state, options=[("true", "Yes"), ("false", "No")])]
    )[0]  # type: ignore[attr-defined]
    assert isinstance(alone, DecisionResult)
    assert got.prompt.prefix_tokens == alone.prompt.prefix_tokens
    assert got.prompt.input_tokens < 3 * got.orders_read * alone.prompt.input_tokens
