"""`arbiter calibrate`'s fitting: temperatures per question type, measured on held-out items.

Fitting minimizes the mean negative log-likelihood of the labels under softmax(logits / T), one T per
question type (``noul``, ``choice``, ``score``; decisions without a type use the global T) plus one
global T over everything. The search is 1-D over log T: a grid, then a golden-section refinement in
the best grid cell (the NLL is smooth and unimodal in log T for all practical purposes). The result
is a ``Calibration`` (``arbiter.engine.calibration``), which the engine applies when serving.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from arbiter.engine.calibration import QUESTION_TYPES, Calibration
from arbiter.engine.probabilities import logsumexp, softmax
from evaluation import metrics

LOG_T_RANGE = (math.log(0.02), math.log(50.0))


def _padded(logits: Sequence[Sequence[float]]) -> np.ndarray:
    """Rows of different lengths as one (N, max) array padded with -inf."""
    width = max(len(row) for row in logits)
    out = np.full((len(logits), width), -np.inf)
    for i, row in enumerate(logits):
        out[i, : len(row)] = row
    return out


def nll(
    logits: Sequence[Sequence[float]] | np.ndarray, labels: Sequence[int], temperature: float
) -> float:
    """Mean negative log-likelihood of ``labels`` under softmax(logits / temperature)."""
    z = logits if isinstance(logits, np.ndarray) else _padded(logits)
    scaled = z / temperature
    lse = logsumexp(scaled, axis=1)
    picked = scaled[np.arange(len(z)), np.asarray(labels)]
    return float(np.mean(lse - picked))


def fit_temperature(
    logits: Sequence[Sequence[float]], labels: Sequence[int], grid: int = 121, iterations: int = 60
) -> float:
    """The temperature minimizing the NLL, searched over log T in ``LOG_T_RANGE``."""
    if not len(logits):
        raise ValueError("no items to fit a temperature on")
    z = _padded(logits)
    y = list(labels)
    points = np.linspace(*LOG_T_RANGE, grid)
    losses = [nll(z, y, math.exp(p)) for p in points]
    best = int(np.argmin(losses))
    lo = points[max(best - 1, 0)]
    hi = points[min(best + 1, grid - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo + (1 - ratio) * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = nll(z, y, math.exp(a)), nll(z, y, math.exp(b))
    for _ in range(iterations):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = lo + (1 - ratio) * (hi - lo)
            fa = nll(z, y, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = nll(z, y, math.exp(b))
    return float(math.exp((lo + hi) / 2))


def fit(
    logits: Sequence[Sequence[float]],
    labels: Sequence[int],
    types: Sequence[str | None],
    min_items: int = 8,
) -> tuple[float, dict[str, float]]:
    """A global temperature, and one per question type that has at least ``min_items`` items."""
    global_t = fit_temperature(logits, labels)
    by_type: dict[str, float] = {}
    for kind in QUESTION_TYPES:
        rows = [i for i, t in enumerate(types) if t == kind]
        if len(rows) >= min_items:
            by_type[kind] = fit_temperature([logits[i] for i in rows], [labels[i] for i in rows])
    return global_t, by_type


def split_items(
    records: Sequence[dict[str, Any]], holdout: float, seed: int, holdout_split: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(fit, held-out): by a named ``split`` value, else a seeded random share."""
    if holdout_split is not None:
        held = [r for r in records if r["split"] == holdout_split]
        return [r for r in records if r["split"] != holdout_split], held
    order = np.random.default_rng(seed).permutation(len(records))
    n_held = round(holdout * len(records))
    held_idx = set(order[:n_held].tolist())
    fit = [r for i, r in enumerate(records) if i not in held_idx]
    return fit, [r for i, r in enumerate(records) if i in held_idx]


def scored_metrics(
    records: Sequence[dict[str, Any]], temperature: Callable[[dict[str, Any]], float]
) -> dict[str, Any]:
    """NLL, Brier, ECE and accuracy of logit records under a per-record temperature."""
    if not records:
        return {"n": 0, "nll": None, "brier": None, "ece": None, "accuracy": None}
    probs = [softmax(r["option_logits"], temperature(r)).tolist() for r in records]
    labels = [r["label_index"] for r in records]
    top = [int(np.argmax(p)) for p in probs]
    nll = -float(np.mean([math.log(max(p[y], 1e-300)) for p, y in zip(probs, labels, strict=True)]))
    correct = [t == y for t, y in zip(top, labels, strict=True)]
    return {
        "n": len(records),
        "nll": nll,
        "brier": metrics.brier(probs, labels),
        "ece": metrics.ece([max(p) for p in probs], correct),
        "accuracy": metrics.accuracy(correct),
    }


def calibrate_records(
    records: Sequence[dict[str, Any]],
    holdout: float = 0.3,
    seed: int = 0,
    holdout_split: str | None = None,
    min_items: int = 8,
) -> tuple[Calibration, dict[str, Any]]:
    """Fit on one part of the scored records, measure on the rest; the calibration and a report."""
    usable = [r for r in records if r["option_logits"] is not None]
    fit_rows, held = split_items(usable, holdout, seed, holdout_split)
    if not fit_rows:
        raise ValueError("nothing left to fit on: lower --holdout or add items")
    global_t, by_type = fit(
        [r["option_logits"] for r in fit_rows],
        [r["label_index"] for r in fit_rows],
        [_question_type(r) for r in fit_rows],
        min_items=min_items,
    )

    def fitted(r: dict[str, Any]) -> float:
        return by_type.get(r["question_type"], global_t)

    summary = {
        "items": len(records),
        "failures": len(records) - len(usable),
        "fit_items": len(fit_rows),
        "held_out_items": len(held),
        "split": {"holdout_split": holdout_split}
        if holdout_split
        else {"holdout": holdout, "seed": seed},
        "global_temperature": global_t,
        "temperatures": by_type,
        "held_out": {
            "before": scored_metrics(held, lambda r: 1.0),
            "after": scored_metrics(held, fitted),
        },
        "fit": {
            "before": scored_metrics(fit_rows, lambda r: 1.0),
            "after": scored_metrics(fit_rows, fitted),
        },
    }
    model = next((r["model"] for r in records if r.get("model")), None) or {}
    prompt_version = next((r["prompt_version"] for r in records if r.get("prompt_version")), None)
    cal = Calibration(
        global_temperature=global_t,
        by_type=by_type,
        model_sha256=model.get("sha256"),
        model_file=model.get("file"),
        extra={
            "prompt_version": prompt_version,
            "prompt_profile_sha256": model.get("prompt_profile_sha256"),
            "report": summary,
        },
    )
    return cal, summary


def held_out_curves(
    records: Sequence[dict[str, Any]],
    cal: Calibration,
    holdout: float = 0.3,
    seed: int = 0,
    holdout_split: str | None = None,
) -> dict[str, tuple[list[float], list[bool]]]:
    """Reliability curves of the held-out items, raw (T=1) and calibrated; {} when none."""
    usable = [r for r in records if r["option_logits"] is not None]
    _, held = split_items(usable, holdout, seed, holdout_split)
    if not held:
        return {}

    def curve(temperature: Callable[[dict[str, Any]], float]) -> tuple[list[float], list[bool]]:
        probs = [softmax(r["option_logits"], temperature(r)) for r in held]
        top = [float(p.max()) for p in probs]
        hits = [int(np.argmax(p)) == r["label_index"] for p, r in zip(probs, held, strict=True)]
        return top, hits

    return {
        "raw (T=1)": curve(lambda r: 1.0),
        "calibrated": curve(lambda r: cal.temperature_for(_question_type(r))),
    }


def _question_type(record: dict[str, Any]) -> str | None:
    """The calibration's type of a record (a plain decision has none)."""
    kind = record["question_type"]
    return None if kind == "decision" else str(kind)
