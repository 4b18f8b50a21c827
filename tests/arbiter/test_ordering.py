"""Order robustness: K option orders over one state, logits aligned by option id and averaged."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from arbiter.engine import Engine, ordering
from arbiter.errors import TooManyOptions
from arbiter.schema import DecisionRequest, DecisionResult
from tests.fakes import decision


def _ok(outcome: object) -> DecisionResult:
    assert isinstance(outcome, DecisionResult), outcome
    return outcome


def test_permutations_given_reversed_then_distinct_seeded() -> None:
    orders = ordering.permutations(5, 8, seed=3)
    assert orders[0] == (0, 1, 2, 3, 4)
    assert orders[1] == (4, 3, 2, 1, 0)
    assert len(orders) == 8 and len(set(orders)) == 8
    assert orders == ordering.permutations(5, 8, seed=3)  # deterministic
    assert ordering.permutations(2, 8, seed=0) == [(0, 1), (1, 0)]  # only 2! orders exist
    three = ordering.permutations(3, 8, seed=0)
    assert len(three) == 6 and len(set(three)) == 6
    assert ordering.permutations(4, 1, seed=0) == [(0, 1, 2, 3)]


def test_order_samples_is_validated() -> None:
    with pytest.raises(ValidationError):
        decision().model_copy(update={}).model_validate(
            {**decision().model_dump(), "order_samples": 9}
        )
    assert DecisionRequest.model_validate({**decision().model_dump(), "order_samples": 8})


def test_expand_and_merge_align_by_option_id() -> None:
    request = decision("d", options=[("a", "A"), ("b", "B"), ("c", "C")]).model_copy(
        update={"order_samples": 2}
    )
    expanded, plan = ordering.expand([request, decision("plain")])
    assert plan is not None and plan.slots == [[0, 1], [2]]
    assert [o.id for o in expanded[1].options] == ["c", "b", "a"]
    assert expanded[1].state == request.state  # same state: one shared prefix

    def fake(req: DecisionRequest, logits: list[float]) -> DecisionResult:
        base = {
            "id": req.id,
            "option_ids": [o.id for o in req.options],
            "probabilities": [1 / len(logits)] * len(logits),
            "option_logits": logits,
            "choice": req.options[0].id,
            "allowed_mass": 0.5,
            "temperature": 1.0,
            "probability_status": "raw",
            "prefix_cache": "off",
            "prompt": {"sha256": "s", "version": "v1", "input_tokens": 10, "prefix_tokens": 4},
            "timing": {"tokenize_s": 0.1, "prefill_s": 1.0, "readout_s": 0.1, "total_s": 1.2},
            "model": {
                "file": "m",
                "bytes": 1,
                "sha256": "x",
                "architecture": "a",
                "quantization": "q",
                "description": "d",
                "context_tokens": 1,
                "threads": 1,
                "n_gpu_layers": 0,
                "chat_template": False,
                "llama_cpp_python_version": "v",
                "llama_cpp_build": "b",
            },
        }
        return DecisionResult.model_validate(base)

    # Position bias: whatever comes first gets +2. Given: a=3,b=1,c=0; reversed: c=2,b=1,a=1.
    outcomes = [fake(expanded[0], [3.0, 1.0, 0.0]), fake(expanded[1], [2.0, 1.0, 1.0])]
    outcomes.append(fake(expanded[2], [0.0, 1.0]))
    merged = ordering.merge([request, decision("plain")], outcomes, plan, 1.0)
    first = _ok(merged[0])
    assert first.option_ids == ["a", "b", "c"]
    assert first.option_logits == pytest.approx([2.0, 1.0, 1.0])
    assert first.choice == "a"
    assert first.prompt.version == "v1+order-2"
    assert first.prompt.input_tokens == 4 + 6 + 6  # the shared prefix once, two suffixes
    assert first.timing.prefill_s == 1.0
    assert sum(first.probabilities) == pytest.approx(1.0)
    assert _ok(merged[1]).option_logits == [0.0, 1.0]  # untouched
    # A failed variant fails its decision only.
    failed = ordering.merge(
        [request, decision("plain")], [outcomes[0], TooManyOptions("x"), outcomes[2]], plan, 1.0
    )
    assert isinstance(failed[0], TooManyOptions) and isinstance(failed[1], DecisionResult)


def test_engine_order_samples_average_the_orders_scored_alone(engine: Engine) -> None:
    """With the real model: K=2 is the mean of the given and the reversed decision, by option id."""
    options = [("access", "Account access and login"), ("billing", "Billing and invoices")]
    single = {"order_samples": 1}  # each order read alone, not adaptively
    given = decision("o1", options=options).model_copy(update=single)
    reversed_ = decision("o1r", options=options[::-1]).model_copy(update=single)
    engine.cache.clear()
    a = _ok(engine.score([given])[0])
    engine.cache.clear()
    b = _ok(engine.score([reversed_])[0])
    engine.cache.clear()
    both = _ok(engine.score([given.model_copy(update={"order_samples": 2})])[0])
    by_id_b = dict(zip(b.option_ids, b.option_logits, strict=True))
    expected = [(a.option_logits[i] + by_id_b[o]) / 2 for i, o in enumerate(a.option_ids)]
    assert both.option_ids == ["access", "billing"]
    assert both.option_logits == pytest.approx(expected, abs=1e-3)
    assert both.prompt.version.endswith("+order-2")
    assert both.choice == ["access", "billing"][int(np.argmax(expected))]
    # The first-position bias of the base model shows: each alone prefers its first option more.
    assert a.option_logits[0] - a.option_logits[1] != pytest.approx(
        by_id_b["access"] - by_id_b["billing"], abs=1e-3
    )
