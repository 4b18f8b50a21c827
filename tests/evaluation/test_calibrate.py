"""`arbiter calibrate`'s fitting: a known temperature is recovered, per type and bucket; on
generated reads with a known position bias the prior is found, the flips fall, the held-out NLL
improves and the fitted abstention threshold keeps its budget on held-out items."""

from __future__ import annotations

import math

import numpy as np
import pytest

from arbiter.engine.calibration import Temperatures
from arbiter.engine.probabilities import softmax
from arbiter.engine.rotation import ReadPolicy
from evaluation import calibrate as fitting
from evaluation.policy import cost_ratio, replay_all
from evaluation.reads import key, orders_for


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
    best = fitting.nll(logits, labels, fitted)
    assert best <= fitting.nll(logits, labels, fitted * 1.05)
    assert best <= fitting.nll(logits, labels, fitted / 1.05)


def test_fit_per_type_bucket_and_global_with_ragged_rows() -> None:
    a_logits, a_labels = _synthetic(3.0, 1500, 2, seed=1)
    b_logits, b_labels = _synthetic(0.6, 1500, 5, seed=2)
    c_logits, c_labels = _synthetic(1.5, 20, 3, seed=3)  # too few for their own
    temps = fitting.fit_temperatures(
        a_logits + b_logits + c_logits,
        a_labels + b_labels + c_labels,
        ["noul"] * 1500 + ["choice"] * 1520,
        min_items=25,
    )
    assert temps.by_type["noul"] == pytest.approx(3.0, rel=0.15)
    assert temps.by_bucket["choice:5-7"] == pytest.approx(0.6, rel=0.15)
    assert "choice:3-4" not in temps.by_bucket  # 20 items: the type's is used
    assert temps.for_decision("choice", 3) == temps.by_type["choice"]
    assert temps.for_decision("score", 9) == temps.global_temperature
    assert isinstance(Temperatures.from_dict(temps.to_dict(), path=None), Temperatures)  # type: ignore[arg-type]


def test_nll_by_hand() -> None:
    # softmax([0, ln 3]) = [0.25, 0.75]
    assert fitting.nll([[0.0, math.log(3)]], [1], 1.0) == pytest.approx(-math.log(0.75))


def _reads_records(count: int, seed: int, temperature: float = 2.0) -> list[dict[str, object]]:
    """Items whose reads are content + a strong first-position bias; labels drawn from the
    content at ``temperature``. Split in half, fit/heldout."""
    rng = np.random.default_rng(seed)
    records = []
    bias = {n: np.array([2.5] + [0.0] * (n - 1)) for n in (2, 3, 4)}
    for i in range(count):
        n = (2, 3, 4)[i % 3]
        content = rng.normal(0, 3.0, n)
        label = int(rng.choice(n, p=softmax(content, temperature)))
        ids = [
            f"o{(7 * j) % n}{j}" for j in range(n)
        ]  # a canonical order that is not the given one
        reads = {}
        for order in orders_for(ids):
            z = content[list(order)] + bias[n]
            reads[key(order)] = {"logits": z.tolist(), "mass": 0.9}
        records.append(
            {
                "id": f"i{i}",
                "file": "f.jsonl",
                "n": n,
                "option_ids": ids,
                "reads": reads,
                "label_index": label,
                "question_type": "choice",
                "split": "heldout" if i % 2 else "fit",
                "model": {
                    "file": "m.gguf",
                    "sha256": "ab" * 32,
                    "prompt_profile_sha256": "cd" * 32,
                },
            }
        )
    return records


def test_calibrate_reads_fits_the_prior_the_margin_temperatures_and_thresholds() -> None:
    records = _reads_records(1200, seed=4)
    cal, report, curves = fitting.calibrate_reads(records, holdout_split="heldout")
    assert (report["fit_items"], report["held_out_items"]) == (600, 600)
    # The prior: position 0 is e^2.5 times as likely as any other, whatever the option.
    for n, prior in cal.position_prior.items():
        assert prior[0] - prior[1] == pytest.approx(2.5, abs=1e-6), n
    before = report["held_out_before"]
    adaptive = report["adaptive"]["held_out"]
    # Raw single reads flip whenever the bias beats the content; corrected reads never do.
    assert before["flips"] > 0.2 * before["compared"]
    assert adaptive["flips"] == 0 and report["single"]["held_out"]["flips"] == 0
    assert adaptive["accuracy"] > before["accuracy"]
    assert adaptive["nll"] < before["nll"]
    assert report["adaptive"]["temperatures"]["global"] == pytest.approx(2.0, rel=0.2)
    # The fitted 10% threshold keeps its budget on the held-out half (with room for noise).
    held = adaptive["abstention"]["0.1"]
    assert held["automated"] > 0 and held["error"] <= 0.1 + 0.03
    assert cal.model_sha256 == "ab" * 32 and cal.profile_sha256 == "cd" * 32
    assert cal.margin in fitting.MARGINS
    assert set(curves) == {"raw (one read, T=1)", "calibrated (adaptive)", "calibrated (single)"}


def test_the_margin_is_the_best_the_cost_affords() -> None:
    """An item prefills its state once and each order's suffix: with half of every prompt in the
    suffix, reading every round costs up to 2.5x one read. Under ``max_cost`` the margin chosen
    costs at most that on the fit part; without a bound a costlier margin is on offer."""
    records = _reads_records(600, seed=5)
    for record in records:
        record.update(tokens=200, prefix_tokens=100)
    fit = [r for r in records if r["split"] == "fit"]
    prior = fitting.fit_priors(fit)
    margin, study = fitting.choose_margin(fit, prior, max_cost=1.3)
    chosen = next(row for row in study if row["margin"] == margin)
    assert chosen["cost"] <= 1.3
    replayed = replay_all(fit, ReadPolicy(True, margin, prior=prior))
    by_hand = sum(100 + 100 * p.reads for p in replayed if p is not None) / (200 * len(fit))
    assert chosen["cost"] == pytest.approx(by_hand)
    assert max(row["cost"] for row in study) > 1.3  # the bound did choose
    _, free = fitting.choose_margin(fit, prior, max_cost=None)
    assert [row["cost"] for row in free] == [row["cost"] for row in study]
    # Reads recorded without their token counts cost nothing known: no bound applies.
    for record in fit:
        record["prefix_tokens"] = None
    assert cost_ratio(fit, ReadPolicy(True, margin, prior=prior)) is None
