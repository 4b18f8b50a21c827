"""The numbers `arbiter eval` and `arbiter calibrate` report: accuracy, Brier, ECE, latency.

Pure numpy over per-item records, so each formula is unit-tested on hand-computed cases:

- accuracy: correct / all items; an item that failed (no valid answer) counts as wrong.
- Brier (multi-class): mean over scored items of sum_j (p_j - y_j)^2, y one-hot on the label;
  0 is perfect, 2 is the worst possible.
- ECE (top-label, 10 equal-width bins over the top probability): sum_b n_b/N * |acc_b - conf_b|;
  a top probability of exactly 1.0 falls in the last bin.
Brier and ECE need probabilities, so they are computed over the scored items only (``n_scored``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

N_BINS = 10
EDGE_TOLERANCE = 1e-9


def accuracy(correct: Sequence[bool]) -> float | None:
    return float(np.mean(np.asarray(correct, dtype=bool))) if len(correct) else None


def brier(probabilities: Sequence[Sequence[float]], labels: Sequence[int]) -> float | None:
    """Multi-class Brier score; rows may have different numbers of options."""
    if not len(probabilities):
        return None
    total = 0.0
    for probs, label in zip(probabilities, labels, strict=True):
        p = np.asarray(probs, dtype=np.float64)
        y = np.zeros_like(p)
        y[label] = 1.0
        total += float(np.sum((p - y) ** 2))
    return total / len(probabilities)


def reliability_bins(
    confidences: Sequence[float], correct: Sequence[bool], n_bins: int = N_BINS
) -> list[dict[str, Any]]:
    """Per equal-width bin of the top probability: count, mean confidence, accuracy."""
    conf = np.asarray(confidences, dtype=np.float64)
    hit = np.asarray(correct, dtype=np.float64)
    # A hair's tolerance below each edge: probabilities clipped to 1/n (0.5 for yes/no) come out
    # a few ulps either side of the edge, and which side depended on the numpy build.
    index = np.minimum(np.floor(conf * n_bins + EDGE_TOLERANCE).astype(int), n_bins - 1)
    bins = []
    for b in range(n_bins):
        mask = index == b
        n = int(mask.sum())
        bins.append(
            {
                "low": b / n_bins,
                "high": (b + 1) / n_bins,
                "count": n,
                "confidence": float(conf[mask].mean()) if n else None,
                "accuracy": float(hit[mask].mean()) if n else None,
            }
        )
    return bins


def ece(
    confidences: Sequence[float], correct: Sequence[bool], n_bins: int = N_BINS
) -> float | None:
    """Top-label expected calibration error over ``n_bins`` equal-width bins."""
    if not len(confidences):
        return None
    total = len(confidences)
    return float(
        sum(
            b["count"] / total * abs(b["accuracy"] - b["confidence"])
            for b in reliability_bins(confidences, correct, n_bins)
            if b["count"]
        )
    )


def risk_coverage(
    confidences: Sequence[float], correct: Sequence[bool]
) -> list[tuple[float, float]]:
    """(coverage, error among the covered) automating the k most confident answers, k = 1..N
    (ties broken by input order; what thresholding the top probability can reach)."""
    order = np.argsort(-np.asarray(confidences, dtype=np.float64), kind="stable")
    wrong = np.cumsum(~np.asarray(correct, dtype=bool)[order])
    k = np.arange(1, len(order) + 1)
    return [(float(c), float(e)) for c, e in zip(k / len(order), wrong / k, strict=True)]


def automatable(confidences: Sequence[float], correct: Sequence[bool], max_error: float) -> float:
    """The largest share of answers whose error stays at most ``max_error`` when the most
    confident are automated (an oracle threshold, chosen on these very answers)."""
    best = 0.0
    for coverage, error in risk_coverage(confidences, correct):
        if error <= max_error + 1e-12:
            best = coverage
    return best


def held_to(
    confidences: Sequence[float], correct: Sequence[bool], threshold: float | None
) -> dict[str, Any]:
    """What a fixed threshold does to these answers: the share automated and its error."""
    conf = np.asarray(confidences, dtype=np.float64)
    hit = np.asarray(correct, dtype=bool)
    accepted = conf >= threshold if threshold is not None else np.zeros(len(conf), dtype=bool)
    n = int(accepted.sum())
    return {
        "threshold": threshold,
        "automated": n,
        "coverage": n / len(conf) if len(conf) else 0.0,
        "error": float(np.mean(~hit[accepted])) if n else None,
    }


def ece_resolution(
    confidences: Sequence[float], correct: Sequence[bool], draws: int = 400, seed: int = 0
) -> dict[str, float | None]:
    """What an ECE over this many answers can tell: the ECE a perfectly calibrated model with
    these very confidences would show (the mean over ``draws`` of ECE with each answer right with
    its own probability: the estimator's floor at this size, never zero), and a bootstrap 90%
    interval of the measured ECE. An ECE near its floor is as calibrated as can be measured."""
    conf = np.asarray(confidences, dtype=np.float64)
    hit = np.asarray(correct, dtype=bool)
    if not len(conf):
        return {"floor": None, "low": None, "high": None}
    rng = np.random.default_rng(seed)
    floor = [
        ece(conf.tolist(), (rng.uniform(size=len(conf)) < conf).tolist()) or 0.0
        for _ in range(draws)
    ]
    boot = []
    for _ in range(draws):
        pick = rng.integers(0, len(conf), len(conf))
        boot.append(ece(conf[pick].tolist(), hit[pick].tolist()) or 0.0)
    low, high = np.percentile(boot, [5, 95])
    return {"floor": float(np.mean(floor)), "low": float(low), "high": float(high)}


def latency(seconds: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99/max in milliseconds (numpy's linear interpolation between order statistics)."""
    if not len(seconds):
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None}
    ms = 1000.0 * np.asarray(seconds, dtype=np.float64)
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {
        "p50_ms": float(p50),
        "p95_ms": float(p95),
        "p99_ms": float(p99),
        "max_ms": float(ms.max()),
    }


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Metrics over eval records: ``{"correct", "label_index", "probabilities"|None, "latency_s"}``."""
    scored = [r for r in records if r.get("probabilities") is not None]
    confidences = [max(r["probabilities"]) for r in scored]
    top_correct = [bool(r["correct"]) for r in scored]
    return {
        "n": len(records),
        "n_scored": len(scored),
        "failures": len(records) - len(scored),
        "accuracy": accuracy([bool(r["correct"]) for r in records]),
        "brier": brier([r["probabilities"] for r in scored], [r["label_index"] for r in scored]),
        "ece": ece(confidences, top_correct),
        "latency": latency([r["latency_s"] for r in records if r.get("latency_s") is not None]),
    }


def reliability_diagram(
    curves: Mapping[str, tuple[Sequence[float], Sequence[bool]]], path: Path, title: str
) -> Path:
    """A reliability diagram (accuracy vs confidence per bin, one line per curve) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(5.5, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    top.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1, label="perfect")
    width = 1.0 / N_BINS
    for offset, (name, (confidences, correct)) in enumerate(curves.items()):
        bins = [b for b in reliability_bins(confidences, correct) if b["count"]]
        score = ece(confidences, correct)
        label = f"{name} (ECE {score:.3f}, n={len(confidences)})" if score is not None else name
        top.plot(
            [b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", label=label
        )
        counts = [b["count"] for b in reliability_bins(confidences, correct)]
        share = width / max(1, len(curves))
        lefts = [i * width + offset * share for i in range(N_BINS)]
        bottom.bar(lefts, counts, width=share, align="edge", alpha=0.7, label=name)
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("accuracy")
    top.set_title(title)
    top.legend(loc="upper left", fontsize=8)
    bottom.set_xlabel("top-label probability")
    bottom.set_ylabel("items")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def risk_coverage_plot(
    curves: Mapping[str, tuple[Sequence[float], Sequence[bool]]], path: Path, title: str
) -> Path:
    """Error among automated answers against the share automated, one line per curve, with the
    1/5/10% budgets marked, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for name, (confidences, correct) in curves.items():
        points = risk_coverage(confidences, correct)
        if not points:
            continue
        at5 = automatable(confidences, correct, 0.05)
        ax.plot([c for c, _ in points], [e for _, e in points], label=f"{name} ({at5:.0%} at 5%)")
    for budget in (0.01, 0.05, 0.1):
        ax.axhline(budget, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, None)
    ax.set_xlabel("share automated (coverage)")
    ax.set_ylabel("error among automated")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
