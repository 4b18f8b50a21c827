"""`arbiter calibrate`'s fitting: the read policy, temperatures and abstention scores of one model.

From raw reads of labeled items in several orders (``reads``), split into a fit part and a
held-out part:

1. **The position prior** per option count, label-free, from the fit items' cyclic rotations
   (``rotation.fit_prior``).
2. **The margin** of adaptive rotation: among the margins on ``MARGINS`` whose replayed cost on
   the fit part is within ``max_cost`` of one read (prefilled tokens), the smallest whose
   cross-validated NLL is within ``tolerance`` of the best one's: the cheapest that reads about as
   well as any affordable. (Its flip rate is zero whatever the margin: every order of the same
   options starts from the same canonical order.)
3. Per read policy (adaptive, single), replayed on the fit part: **temperatures** by NLL (a global
   one; per question type and per type and option-count bucket where ``min_items`` items exist),
   the **top-label map** on the tempered top probabilities (``toplabel``), then the fit items'
   calibrated top probabilities and correctness: the **abstention** scores.
4. The same replayed on the held-out part, against the raw single read at T = 1 (what Arbiter did
   before): accuracy, NLL, Brier, ECE, flips, orders read, the risk-coverage points and the
   fitted abstention thresholds' error and coverage.

The temperature search is 1-D over log T: a grid, then a golden-section refinement in the best
grid cell (the NLL is smooth and unimodal in log T for all practical purposes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from arbiter.engine import toplabel
from arbiter.engine.abstention import Abstention
from arbiter.engine.calibration import Calibration, PolicyCalibration, Temperatures, bucket
from arbiter.engine.probabilities import logsumexp, softmax
from arbiter.engine.rotation import Read, ReadPolicy, fit_prior
from arbiter.engine.toplabel import TopLabel
from evaluation import metrics
from evaluation.policy import Replayed, cost_ratio, flip_rate, mean_reads, replay_all
from evaluation.reads import reads_of

LOG_T_RANGE = (math.log(0.02), math.log(50.0))
MARGINS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0, 1000.0)  # 1000: every round
BUDGETS = (0.01, 0.05, 0.1)
# What a default decision may cost against one read (prefilled tokens, each decision cold): the
# margin is the best the fit part affords within it (at most 1.5x).
DEFAULT_MAX_COST = 1.5


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


def fit_temperatures(
    logits: Sequence[Sequence[float]],
    labels: Sequence[int],
    types: Sequence[str | None],
    min_items: int = 25,
    reads: Sequence[int] | None = None,
) -> Temperatures:
    """A global temperature; one per question type, per type and bucket, per bucket of any type,
    and (with ``reads``) per number of orders read and per type, bucket and orders read, each
    where at least ``min_items`` items exist."""
    global_t = fit_temperature(logits, labels)
    counts = reads if reads is not None else [None] * len(logits)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, (row, kind, k) in enumerate(zip(logits, types, counts, strict=True)):
        b = bucket(len(row))
        if kind is not None:
            groups.setdefault(("type", kind), []).append(i)
            groups.setdefault(("bucket", f"{kind}:{b}"), []).append(i)
            if k is not None:
                groups.setdefault(("bucket", f"{kind}:{b}:r{k}"), []).append(i)
        groups.setdefault(("bucket", f"any:{b}"), []).append(i)
        if k is not None:
            groups.setdefault(("bucket", f"r{k}"), []).append(i)
    by_type: dict[str, float] = {}
    by_bucket: dict[str, float] = {}
    for (level, name), rows in sorted(groups.items()):
        if len(rows) < min_items:
            continue
        t = fit_temperature([logits[i] for i in rows], [labels[i] for i in rows])
        (by_type if level == "type" else by_bucket)[name] = t
    return Temperatures(global_t, by_type, by_bucket)


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


def _question_type(record: dict[str, Any]) -> str | None:
    """The calibration's type of a record (a plain decision has none)."""
    kind = record["question_type"]
    return None if kind == "decision" else str(kind)


def scored(
    records: Sequence[dict[str, Any]],
    replayed: Sequence[Replayed | None],
    temperatures: Temperatures | None,
    top: TopLabel | None = None,
) -> list[dict[str, Any]]:
    """Eval-like rows (probabilities, correct, label index) of replayed records; ``temperatures``
    None: T = 1; ``top``: the top-label map after the temperature."""
    rows = []
    for record, rep in zip(records, replayed, strict=True):
        if rep is None:
            continue
        t = (
            temperatures.for_decision(_question_type(record), len(rep.logits), rep.reads)
            if temperatures is not None
            else 1.0
        )
        probs = softmax(rep.logits, t).tolist()
        if top is not None:
            probs = top.apply(probs)
        rows.append(
            {
                "probabilities": probs,
                "option_logits": rep.logits.tolist(),
                "label_index": record["label_index"],
                "correct": int(np.argmax(probs)) == record["label_index"],
                "question_type": record["question_type"],
                "latency_s": None,
                "reads": rep.reads,
            }
        )
    return rows


def measured(rows: Sequence[dict[str, Any]], fitted: Abstention | None = None) -> dict[str, Any]:
    """What an application needs of a set of answers: accuracy, NLL, Brier, ECE, the
    risk-coverage points and, with ``fitted`` abstention scores, their held-out error and
    coverage at each budget."""
    summary = metrics.summarize(rows)
    probs = [r["probabilities"] for r in rows]
    labels = [r["label_index"] for r in rows]
    confidences = [max(p) for p in probs]
    correct = [bool(r["correct"]) for r in rows]
    out: dict[str, Any] = {
        "n": len(rows),
        "accuracy": summary["accuracy"],
        "nll": -float(
            np.mean([math.log(max(p[y], 1e-300)) for p, y in zip(probs, labels, strict=True)])
        )
        if rows
        else None,
        "brier": summary["brier"],
        "ece": summary["ece"],
        "ece_floor": metrics.ece_resolution(confidences, correct, draws=200)["floor"],
        "automatable": {str(e): metrics.automatable(confidences, correct, e) for e in BUDGETS},
    }
    if fitted is not None:
        out["abstention"] = {
            str(e): metrics.held_to(confidences, correct, fitted.threshold(e)) for e in BUDGETS
        }
    return out


def _policy_reads(records: Sequence[dict[str, Any]], n: int) -> list[list[Read]]:
    out = []
    for record in records:
        if int(record["n"]) != n or not record["reads"]:
            continue
        reads = []
        for order, (logits, _mass) in reads_of(record).items():
            reads.append(Read(order, logits, 0.0))
        out.append(reads)
    return out


def fit_priors(records: Sequence[dict[str, Any]]) -> dict[int, np.ndarray]:
    priors = {}
    for n in sorted({int(r["n"]) for r in records}):
        prior = fit_prior(_policy_reads(records, n), n)
        if prior is not None:
            priors[n] = prior
    return priors


def _folds(records: Sequence[dict[str, Any]], k: int = 2) -> list[int]:
    """A fold per record, by a hash of its file and id (stable, whatever the order)."""
    import hashlib

    return [
        int(hashlib.sha256(f"{r.get('file')}/{r['id']}".encode()).hexdigest(), 16) % k
        for r in records
    ]


def _fitted(
    rows: Sequence[tuple[dict[str, Any], Replayed]], min_items: int, adaptive: bool
) -> Temperatures:
    return fit_temperatures(
        [p.logits.tolist() for _, p in rows],
        [r["label_index"] for r, _ in rows],
        [_question_type(r) for r, _ in rows],
        min_items,
        [p.reads for _, p in rows] if adaptive else None,
    )


def cross_validated(
    records: Sequence[dict[str, Any]], policy: ReadPolicy, min_items: int
) -> dict[str, Any]:
    """The policy replayed on ``records``, its temperatures fitted on one half and measured on
    the other (both ways): NLL and ECE, with and without the top-label map. What a choice made
    on the fit part can be judged by without looking at the held-out part."""
    replayed = replay_all(records, policy)
    kept = [(r, p) for r, p in zip(records, replayed, strict=True) if p is not None]
    folds = _folds([r for r, _ in kept])
    out: dict[str, list[float]] = {"nll": [], "ece": [], "ece_top": []}
    for fold in (0, 1):
        train = [x for x, f in zip(kept, folds, strict=True) if f != fold]
        test = [x for x, f in zip(kept, folds, strict=True) if f == fold]
        if not train or not test:
            continue
        temps = _fitted(train, min_items, policy.adaptive)
        tempered = scored([r for r, _ in train], [p for _, p in train], temps)
        top = toplabel.fit(
            [max(row["probabilities"]) for row in tempered],
            [bool(row["correct"]) for row in tempered],
        )
        rows = scored([r for r, _ in test], [p for _, p in test], temps)
        with_top = scored([r for r, _ in test], [p for _, p in test], temps, top)
        got = measured(rows)
        out["nll"].append(got["nll"])
        out["ece"].append(got["ece"])
        out["ece_top"].append(measured(with_top)["ece"])
    return {
        **{k: float(np.mean(v)) if v else None for k, v in out.items()},
        "mean_reads": mean_reads(replayed),
    }


def choose_margin(
    records: Sequence[dict[str, Any]],
    prior: dict[int, np.ndarray],
    tolerance: float = 0.005,
    min_items: int = 25,
    max_cost: float | None = DEFAULT_MAX_COST,
) -> tuple[float, list[dict[str, Any]]]:
    """The cheapest margin that reads about as well as any it can afford: per margin on
    ``MARGINS``, the policy replayed on ``records``, cross-validated (``cross_validated``) and
    costed against one read (``policy.cost_ratio``); among the margins within ``max_cost``, the
    smallest whose NLL is within ``tolerance`` of the best one's (none within: the cheapest).
    Labels pick it, so it is fitted on the fit part only. Returns the margin and the study of
    every margin tried."""
    study: list[dict[str, Any]] = []
    for margin in MARGINS:
        policy = ReadPolicy(True, margin, prior=prior)
        study.append(
            {
                "margin": margin,
                **cross_validated(records, policy, min_items),
                "cost": cost_ratio(records, policy),
            }
        )
    scored_rows = [row for row in study if row["nll"] is not None]
    if not scored_rows:
        return MARGINS[0], study
    affordable = [
        row
        for row in scored_rows
        if max_cost is None or row["cost"] is None or row["cost"] <= max_cost
    ]
    if not affordable:
        return float(scored_rows[0]["margin"]), study
    best = min(row["nll"] for row in affordable)
    chosen = next(row for row in affordable if row["nll"] <= best + tolerance)
    return float(chosen["margin"]), study


def calibrate_reads(
    records: Sequence[dict[str, Any]],
    holdout: float = 0.3,
    seed: int = 0,
    holdout_split: str | None = None,
    min_items: int = 25,
    margin: float | None = None,
    tolerance: float = 0.005,
    max_cost: float | None = DEFAULT_MAX_COST,
) -> tuple[Calibration, dict[str, Any], dict[str, tuple[list[float], list[bool]]]]:
    """Fit on one part of the read records, measure on the rest: the calibration, a report, and
    the held-out reliability curves (raw single reads at T = 1, and each calibrated policy)."""
    usable = [r for r in records if r["reads"]]
    fit_rows, held = split_items(usable, holdout, seed, holdout_split)
    if not fit_rows:
        raise ValueError("nothing left to fit on: lower --holdout or add items")
    prior = fit_priors(fit_rows)
    study: list[dict[str, Any]] = []
    if margin is None:
        margin, study = choose_margin(fit_rows, prior, tolerance, min_items, max_cost)
    raw = ReadPolicy(False)
    before_rows = scored(held, replay_all(held, raw), None)
    flips_before = flip_rate(held, raw)
    policies: dict[str, PolicyCalibration] = {}
    curves = {"raw (one read, T=1)": _curve(before_rows)}
    report: dict[str, Any] = {
        "items": len(records),
        "failures": len(records) - len(usable),
        "fit_items": len(fit_rows),
        "held_out_items": len(held),
        "split": {"holdout_split": holdout_split}
        if holdout_split
        else {"holdout": holdout, "seed": seed},
        "margin": margin,
        "margin_study": study,
        "position_prior": {str(n): np.exp(p).round(4).tolist() for n, p in prior.items()},
        "held_out_before": {
            **measured(before_rows),
            "flips": flips_before[0],
            "compared": flips_before[1],
            "mean_reads": 1.0,
        },
    }
    for name, adaptive in (("adaptive", True), ("single", False)):
        policy = ReadPolicy(adaptive, margin, prior=prior)
        fit_replayed = replay_all(fit_rows, policy)
        kept = [(r, p) for r, p in zip(fit_rows, fit_replayed, strict=True) if p is not None]
        temps = fit_temperatures(
            [p.logits.tolist() for _, p in kept],
            [r["label_index"] for r, _ in kept],
            [_question_type(r) for r, _ in kept],
            min_items,
            [p.reads for _, p in kept] if adaptive else None,
        )
        tempered = scored(fit_rows, fit_replayed, temps)
        check = cross_validated(fit_rows, policy, min_items)
        top: TopLabel | None = None
        if (
            check["ece_top"] is not None
            and check["ece"] is not None
            and check["ece_top"] < check["ece"]
        ):
            top = toplabel.fit(
                [max(r["probabilities"]) for r in tempered], [bool(r["correct"]) for r in tempered]
            )
        fit_scored = scored(fit_rows, fit_replayed, temps, top)
        abstention = Abstention.of(
            [max(r["probabilities"]) for r in fit_scored], [bool(r["correct"]) for r in fit_scored]
        )
        held_replayed = replay_all(held, policy)
        held_scored = scored(held, held_replayed, temps, top)
        flips = flip_rate(held, policy)
        summary = {
            "temperatures": temps.to_dict(),
            "top_label": top.to_dict() if top is not None else None,
            "fit_cross_validated": check,
            "fit": measured(fit_scored),
            "held_out_temperature_only": measured(scored(held, held_replayed, temps)),
            "held_out": {
                **measured(held_scored, abstention),
                "flips": flips[0],
                "compared": flips[1],
                "mean_reads": mean_reads(held_replayed),
                "cost": cost_ratio(held, policy),
                "by_question_type": _by_type(held_scored),
            },
        }
        policies[name] = PolicyCalibration(temps, abstention, summary, top)
        report[name] = summary
        curves[f"calibrated ({name})"] = _curve(held_scored)
    model = next((r["model"] for r in records if r.get("model")), None) or {}
    cal = Calibration(
        policies,
        prior,
        margin,
        model_sha256=model.get("sha256"),
        model_file=model.get("file"),
        profile_sha256=model.get("prompt_profile_sha256"),
    )
    return cal, report, curves


def _curve(rows: Sequence[dict[str, Any]]) -> tuple[list[float], list[bool]]:
    return [max(r["probabilities"]) for r in rows], [bool(r["correct"]) for r in rows]


def _by_type(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(str(row["question_type"]), []).append(row)
    return {k: measured(v) for k, v in sorted(groups.items())}
