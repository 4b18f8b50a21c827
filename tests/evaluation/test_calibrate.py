"""Temperature fitting (`arbiter calibrate`): a known temperature is recovered, per type and
globally, and measured on held-out items."""

from __future__ import annotations

import math

import numpy as np
import pytest

from arbiter.engine.calibration import Calibration
from evaluation import calibrate as fitting
from evaluation.calibrate import calibrate_records


def _synthetic(
    temperature: float, n: int, k: int, seed: int
) -> tuple[list[list[float]], list[int]]:
    """Logits z, labels drawn from softmax(z / temperature): T is the true temperature."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3.0, size=(n, k))
    scaled = logits / temperature
    p = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    labels = [int(rng.choice(k, p=row)) for row in p]
    return logits.tolist(), labels


@pytest.mark.parametrize("true_t", [0.5, 1.0, 2.5])
def test_fit_recovers_a_known_temperature(true_t: float) -> None:
    logits, labels = _synthetic(true_t, 4000, 4, seed=7)
    fitted = fitting.fit_temperature(logits, labels)
    assert fitted == pytest.approx(true_t, rel=0.1)
    # It is the NLL minimum: nudging it either way does not help.
    best = fitting.nll(logits, labels, fitted)
    assert best <= fitting.nll(logits, labels, fitted * 1.05)
    assert best <= fitting.nll(logits, labels, fitted / 1.05)


def test_fit_per_type_and_global_with_ragged_rows() -> None:
    a_logits, a_labels = _synthetic(3.0, 1500, 2, seed=1)
    b_logits, b_labels = _synthetic(0.6, 1500, 5, seed=2)
    global_t, by_type = fitting.fit(
        a_logits + b_logits, a_labels + b_labels, ["noul"] * 1500 + ["choice"] * 1500
    )
    assert by_type["noul"] == pytest.approx(3.0, rel=0.15)
    assert by_type["choice"] == pytest.approx(0.6, rel=0.15)
    assert "score" not in by_type  # no items: the global one is used
    assert 0.6 < global_t < 3.0
    c = Calibration(global_t, by_type)
    assert c.temperature_for("score") == global_t
    assert c.temperature_for(None) == global_t
    assert c.temperature_for("noul") == by_type["noul"]


def test_nll_by_hand() -> None:
    # softmax([0, ln 3]) = [0.25, 0.75]
    assert fitting.nll([[0.0, math.log(3)]], [1], 1.0) == pytest.approx(-math.log(0.75))
    assert fitting.nll([[0.0, math.log(3)]], [0], 1.0) == pytest.approx(-math.log(0.25))


def test_calibrate_records_reports_held_out_before_and_after() -> None:
    logits, labels = _synthetic(2.0, 600, 3, seed=3)
    records = [
        {
            "option_logits": z,
            "label_index": y,
            "question_type": "choice",
            "split": "test" if i % 4 == 0 else "train",
            "model": {"file": "m.gguf", "sha256": "ab" * 32},
            "prompt_version": "v",
        }
        for i, (z, y) in enumerate(zip(logits, labels, strict=True))
    ]
    records.append(
        {"option_logits": None, "label_index": 0, "question_type": "choice", "split": "x"}
    )
    c, summary = calibrate_records(records, holdout_split="test")
    assert summary["held_out_items"] == 150 and summary["fit_items"] == 450
    assert summary["failures"] == 1
    assert c.by_type["choice"] == pytest.approx(2.0, rel=0.2)
    held = summary["held_out"]
    assert held["after"]["nll"] < held["before"]["nll"]
    assert held["after"]["accuracy"] == held["before"]["accuracy"]  # never changes a choice
    assert c.model_sha256 == "ab" * 32
