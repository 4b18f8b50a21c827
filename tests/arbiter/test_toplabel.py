"""The top-label map: Platt scaling of the top probability, fitted and applied."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from arbiter.engine.toplabel import TopLabel, fit


def test_honest_confidences_fit_close_to_the_identity() -> None:
    rng = np.random.default_rng(0)
    c = rng.uniform(0.2, 0.99, 4000)
    fitted = fit(c.tolist(), (rng.uniform(size=4000) < c).tolist())
    assert fitted.a == pytest.approx(1.0, abs=0.1) and fitted.b == pytest.approx(0.0, abs=0.1)


def test_a_known_map_is_recovered_and_makes_the_confidence_honest() -> None:
    rng = np.random.default_rng(1)
    c = rng.uniform(0.2, 0.9, 5000)
    true = TopLabel(2.0, 0.5)
    right = rng.uniform(size=5000) < np.array([true.confidence(x) for x in c])
    fitted = fit(c.tolist(), right.tolist())
    assert (fitted.a, fitted.b) == (pytest.approx(2.0, rel=0.1), pytest.approx(0.5, abs=0.1))
    assert fit([], []) == TopLabel()


@given(
    probs=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=10),
    a=st.floats(0.05, 5.0),
    b=st.floats(-5.0, 5.0),
)
def test_the_map_never_changes_the_choice_and_sums_to_one(
    probs: list[float], a: float, b: float
) -> None:
    p = np.asarray(probs) / np.sum(probs)
    out = np.asarray(TopLabel(a, b).apply(p.tolist()))
    assert out.sum() == pytest.approx(1.0)
    assert np.all(out >= 0)
    assert out[int(np.argmax(p))] >= out.max() - 1e-12
