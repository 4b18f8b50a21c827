"""Abstention thresholds (SGR with Clopper-Pearson bounds): the bound by hand, the threshold's
monotonicity, and the guarantee itself on generated data."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from arbiter.engine.abstention import Abstention, abstains, clopper_pearson_upper


def test_clopper_pearson_by_hand() -> None:
    # No error in n: the upper bound solves (1 - p)^n = delta.
    for n in (1, 10, 100):
        assert clopper_pearson_upper(0, n, 0.05) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-6)
    # One error in 20 at delta 0.05: P(Bin(20, p) <= 1) = 0.05 at p = 0.2161 (tables).
    assert clopper_pearson_upper(1, 20, 0.05) == pytest.approx(0.2161, abs=1e-3)
    assert clopper_pearson_upper(0, 0, 0.05) == 1.0
    assert clopper_pearson_upper(5, 5, 0.05) == 1.0


def _draw(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Confidences (1 - 0.7 u^2, u uniform: most of them high), and correctness honest about them
    (right with that probability)."""
    confidence = 1 - 0.7 * rng.uniform(size=m) ** 2
    return confidence, rng.uniform(size=m) < confidence


def test_threshold_is_monotone_in_the_budget_and_none_when_unreachable() -> None:
    rng = np.random.default_rng(0)
    conf, hit = _draw(rng, 400)
    fitted = Abstention.of(conf.tolist(), hit.tolist())
    thresholds = [fitted.threshold(e) for e in (0.02, 0.05, 0.1, 0.2, 0.4)]
    known = [t for t in thresholds if t is not None]
    assert known == sorted(known, reverse=True)  # a looser budget automates more
    assert Abstention.of([0.9] * 10, [True] * 10).threshold(0.01) is None  # 10 items prove nothing
    assert abstains(0.5, None) and abstains(0.5, 0.6) and not abstains(0.7, 0.6)


def test_round_trip() -> None:
    fitted = Abstention.of([0.2, 0.9, 0.5], [False, True, True])
    again = Abstention.from_dict(fitted.to_dict())
    assert again == fitted
    assert fitted.confidences == (0.9, 0.5, 0.2)
    with pytest.raises(ValueError):
        Abstention.from_dict({"confidences": [2.0], "correct": [1], "delta": 0.05})


@pytest.mark.parametrize("budget", [0.05, 0.1])
def test_the_error_of_automated_decisions_stays_in_budget(budget: float) -> None:
    """The guarantee: over many fit sets, the threshold's true error among what it automates is
    over the budget in at most delta of them (0.05; here 100 draws of 2,000, so ~5 + slack)."""
    rng = np.random.default_rng(1)
    over = reachable = 0
    for _ in range(100):
        conf, hit = _draw(rng, 2000)
        threshold = Abstention.of(conf.tolist(), hit.tolist()).threshold(budget)
        if threshold is None:
            continue
        reachable += 1
        # The true error above the threshold: E[0.7 u^2 | 0.7 u^2 <= 1 - t] = (1 - t) / 3.
        true_error = (1 - threshold) / 3
        over += true_error > budget
    assert reachable > 80
    assert over <= math.ceil(0.05 * reachable) + 3


@given(
    st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=0, max_size=60),
    st.floats(0.01, 0.5),
)
def test_threshold_never_accepts_a_set_whose_bound_exceeds_the_budget(
    pairs: list[tuple[float, bool]], budget: float
) -> None:
    fitted = Abstention.of([c for c, _ in pairs], [h for _, h in pairs])
    threshold = fitted.threshold(budget)
    if threshold is None:
        return
    accepted = [h for c, h in pairs if c >= threshold]
    errors = sum(not h for h in accepted)
    tests = max(1, math.ceil(math.log2(len(pairs))))
    assert clopper_pearson_upper(errors, len(accepted), 0.05 / tests) <= budget
