"""Metric math on hand-computed cases: accuracy, multi-class Brier, top-label ECE, latency."""

from __future__ import annotations

from pathlib import Path

import pytest

from evaluation import metrics as m


def test_accuracy_counts_failures_as_wrong() -> None:
    assert m.accuracy([True, False, True, True]) == 0.75
    assert m.accuracy([]) is None


def test_brier_multiclass_by_hand() -> None:
    # (0.7-1)^2 + 0.2^2 + 0.1^2 = 0.09 + 0.04 + 0.01 = 0.14
    # (0.5)^2 + (0.5-1)^2 = 0.5 (a two-option row next to a three-option one)
    assert m.brier([[0.7, 0.2, 0.1], [0.5, 0.5]], [0, 1]) == pytest.approx((0.14 + 0.5) / 2)
    assert m.brier([[1.0, 0.0]], [0]) == 0.0
    assert m.brier([[0.0, 1.0]], [0]) == 2.0  # the worst possible
    assert m.brier([], []) is None


def test_ece_top_label_ten_bins_by_hand() -> None:
    # bin 9 [0.9, 1.0]: confidences 0.95, 1.0 (1.0 lands in the last bin), both right:
    #   acc 1.0, conf 0.975 -> gap 0.025, weight 2/5
    # bin 6 [0.6, 0.7): 0.6, 0.65, wrong and right: acc 0.5, conf 0.625 -> gap 0.125, weight 2/5
    # bin 3 [0.3, 0.4): 0.35, wrong: acc 0, conf 0.35 -> gap 0.35, weight 1/5
    conf = [0.95, 1.0, 0.6, 0.65, 0.35]
    correct = [True, True, False, True, False]
    expected = 2 / 5 * 0.025 + 2 / 5 * 0.125 + 1 / 5 * 0.35
    assert m.ece(conf, correct) == pytest.approx(expected)
    bins = m.reliability_bins(conf, correct)
    assert [b["count"] for b in bins] == [0, 0, 0, 1, 0, 0, 2, 0, 0, 2]
    assert bins[9]["confidence"] == pytest.approx(0.975)
    assert m.ece([], []) is None


def test_ece_is_zero_when_confidence_matches_accuracy() -> None:
    assert m.ece([0.75] * 4, [True, True, True, False]) == pytest.approx(0.0)


def test_latency_percentiles() -> None:
    lat = m.latency([0.001 * i for i in range(1, 101)])  # 1..100 ms
    assert lat["p50_ms"] == pytest.approx(50.5)
    assert lat["p95_ms"] == pytest.approx(95.05)
    assert lat["p99_ms"] == pytest.approx(99.01)
    assert lat["max_ms"] == pytest.approx(100.0)
    assert m.latency([])["p50_ms"] is None


def test_summarize_keeps_failures_out_of_brier_and_ece() -> None:
    records = [
        {"correct": True, "label_index": 0, "probabilities": [0.8, 0.2], "latency_s": 0.1},
        {"correct": False, "label_index": 1, "probabilities": [0.6, 0.4], "latency_s": 0.3},
        {"correct": False, "label_index": 0, "probabilities": None, "latency_s": 0.2},
    ]
    s = m.summarize(records)
    assert (s["n"], s["n_scored"], s["failures"]) == (3, 2, 1)
    assert s["accuracy"] == pytest.approx(1 / 3)
    # (0.2^2 + 0.2^2) and (0.6^2 + 0.6^2)
    assert s["brier"] == pytest.approx((0.08 + 0.72) / 2)
    # bin 8: conf 0.8 right (gap 0.2); bin 6: conf 0.6 wrong (gap 0.6)
    assert s["ece"] == pytest.approx(0.5 * 0.2 + 0.5 * 0.6)
    assert s["latency"]["max_ms"] == pytest.approx(300.0)


def test_reliability_diagram_is_a_png(tmp_path: Path) -> None:
    path = m.reliability_diagram(
        {"a": ([0.9, 0.55, 0.7], [True, False, True]), "b": ([0.6], [True])},
        tmp_path / "sub" / "rel.png",
        "test",
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_probability_a_few_ulps_under_an_edge_is_binned_with_the_edge() -> None:
    # Yes/no probabilities clipped to 1/2 come out as 0.49999999999999994 or 0.5 depending on the
    # numpy build; ECE must not (the shipped calibrations' figures moved with numpy 2.4).
    under = m.reliability_bins([0.49999999999999994, 0.5, 0.5000000000000001], [1, 0, 1])
    assert [b["count"] for b in under][5] == 3
    assert m.ece([0.49999999999999994], [True]) == m.ece([0.5], [True])
