"""An eval's report: metrics overall and per file, tier, family and question type; the flip rate
between the given and the reversed order; the risk-coverage points and the served abstention
thresholds held to; and the Markdown `arbiter eval` prints (one configuration, or two side by
side)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from evaluation import metrics as eval_metrics

BUDGETS = (0.01, 0.05, 0.1)


def _grouped(records: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(str(r[key]) if r[key] is not None else "-", []).append(r)
    return {name: summarize(rows) for name, rows in sorted(groups.items())}


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``metrics.summarize`` plus what thresholding needs: the oracle share automatable at each
    budget (a threshold chosen on these answers) and the mean number of orders read."""
    out = eval_metrics.summarize(records)
    confidences, correct = curve(records)
    out["automatable"] = {
        str(e): eval_metrics.automatable(confidences, correct, e) for e in BUDGETS
    }
    reads = [r.get("orders_read", 1) for r in records if r["probabilities"] is not None]
    out["mean_orders_read"] = float(np.mean(reads)) if reads else None
    return out


def flips(records: Sequence[dict[str, Any]], reversed_: Sequence[dict[str, Any]]) -> dict[str, Any]:
    compared = [
        (a, b)
        for a, b in zip(records, reversed_, strict=True)
        if a["choice"] is not None and b["choice"] is not None
    ]
    changed = sum(a["choice"] != b["choice"] for a, b in compared)
    return {
        "compared": len(compared),
        "flips": changed,
        "flip_rate": changed / len(compared) if compared else None,
        "first_option_share": _first_share(records),
        "first_option_share_reversed": _first_share_reversed(reversed_),
    }


def abstention(
    records: Sequence[dict[str, Any]], calibration: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The served thresholds (``calibration.describe``) held to these answers: per budget, the
    share automated and the error among it (on a held-out part: the check of the bound)."""
    fitted = (calibration or {}).get("abstention")
    if not fitted:
        return None
    confidences, correct = curve(records)
    return {
        budget: eval_metrics.held_to(confidences, correct, threshold)
        for budget, threshold in fitted["thresholds"].items()
    }


def report(
    records: Sequence[dict[str, Any]],
    reversed_: Sequence[dict[str, Any]] | None,
    files: Sequence[Path],
    backend_name: str,
    order_samples: int | None,
    calibration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    first = next((r for r in records if r.get("model")), {})
    out: dict[str, Any] = {
        "files": [str(f) for f in files],
        "backend": backend_name,
        "model": first.get("model"),
        "prompt_version": first.get("prompt_version"),
        "prompt_profile_sha256": (first.get("model") or {}).get("prompt_profile_sha256"),
        "probability_status": first.get("probability_status"),
        "order_samples": order_samples,
        "calibration": calibration,
        "overall": {
            **summarize(records),
            "ece_resolution": eval_metrics.ece_resolution(*curve(records)),
        },
        "by_file": _grouped(records, "file"),
        "by_tier": _grouped(records, "tier"),
        "by_family": _grouped(records, "family"),
        "by_question_type": _grouped(records, "question_type"),
        "abstention": abstention(records, calibration),
    }
    if reversed_ is not None:
        out["order"] = flips(records, reversed_)
    return out


def _first_share(records: Sequence[dict[str, Any]]) -> float | None:
    scored = [r for r in records if r["probabilities"] is not None]
    if not scored:
        return None
    return sum(int(np.argmax(r["probabilities"])) == 0 for r in scored) / len(scored)


def _first_share_reversed(records: Sequence[dict[str, Any]]) -> float | None:
    """How often the first option as listed (the item's last, in a reversed request) won."""
    scored = [r for r in records if r["probabilities"] is not None]
    if not scored:
        return None
    last = [int(np.argmax(r["probabilities"])) == len(r["probabilities"]) - 1 for r in scored]
    return sum(last) / len(scored)


def _resolution(r: dict[str, Any] | None) -> str:
    if not r or r.get("floor") is None:
        return ""
    return (
        f" (90% CI {r['low']:.3f}-{r['high']:.3f}; a perfectly calibrated model: {r['floor']:.3f})"
    )


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _row(name: str, m: dict[str, Any]) -> str:
    lat = m["latency"]
    return (
        f"| {name} | {m['n']} | {m['failures']} | {fmt(m['accuracy'])} | {fmt(m['brier'])} "
        f"| {fmt(m['ece'])} | {fmt(m['automatable']['0.05'], 2)} | {fmt(lat['p50_ms'], 0)} "
        f"| {fmt(lat['p95_ms'], 0)} | {fmt(lat['max_ms'], 0)} |"
    )


def headline(rep: dict[str, Any]) -> dict[str, str]:
    """The figures an application acts on, as text (one column of the summary table)."""
    o = rep["overall"]
    correct = round((o["accuracy"] or 0) * o["n"])
    order = rep.get("order") or {}
    cells = {
        "correct": f"{correct}/{o['n']} ({fmt((o['accuracy'] or 0) * 100, 1)}%)",
        "answer changes when the options are reversed": (
            f"{order['flips']} of {order['compared']} ({fmt(order['flip_rate'] * 100, 1)}%)"
            if order.get("flip_rate") is not None
            else "–"
        ),
        "ECE (top label, 10 bins)": fmt(o["ece"]) + _resolution(o.get("ece_resolution")),
        "Brier": fmt(o["brier"]),
        "automatable at <= 1/5/10% error (best threshold on this set)": " / ".join(
            f"{o['automatable'][str(e)]:.0%}" for e in BUDGETS
        ),
        "orders read per decision": fmt(o["mean_orders_read"], 2),
        "latency p50 / p95 ms": f"{fmt(o['latency']['p50_ms'], 0)} / {fmt(o['latency']['p95_ms'], 0)}",
    }
    held = rep.get("abstention")
    if held:
        for budget, h in held.items():
            cells[f"fitted threshold at {float(budget):.0%}: automated, error"] = (
                f"{h['coverage']:.0%}, {fmt(h['error'])}" if h["automated"] else "0% (abstains)"
            )
    return cells


def markdown(rep: dict[str, Any]) -> str:
    lines = [
        f"Eval of {', '.join(rep['files'])} on {rep['backend']} "
        f"(prompt {rep['prompt_version']}, profile sha256 "
        f"{(rep.get('prompt_profile_sha256') or '?')[:12]}, probabilities "
        f"{rep.get('probability_status') or '?'}, order samples "
        f"{rep['order_samples'] or 'server policy'})",
        "",
        "| measure | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in headline(rep).items()),
        "",
        "| slice | n | failures | accuracy | Brier | ECE | at 5% | p50 ms | p95 ms | max ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
        _row("overall", rep["overall"]),
    ]
    for section, label in (
        ("by_file", "file"),
        ("by_tier", "tier"),
        ("by_family", "family"),
        ("by_question_type", "type"),
    ):
        groups = rep[section]
        if list(groups) == ["-"]:
            continue
        lines += [_row(f"{label}: {name}", m) for name, m in groups.items()]
    return "\n".join(lines)


def side_by_side(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> str:
    """Two configurations' headline figures in one table."""
    ha, hb = headline(a), headline(b)
    lines = [f"| measure | {names[0]} | {names[1]} |", "|---|---|---|"]
    for key in dict.fromkeys([*ha, *hb]):
        lines.append(f"| {key} | {ha.get(key, '–')} | {hb.get(key, '–')} |")
    for kind in sorted(set(a["by_question_type"]) | set(b["by_question_type"])):
        ma, mb = a["by_question_type"].get(kind), b["by_question_type"].get(kind)
        lines.append(
            f"| {kind}: accuracy, ECE, Brier | "
            + " | ".join(
                f"{fmt(m['accuracy'])}, {fmt(m['ece'])}, {fmt(m['brier'])}" if m else "–"
                for m in (ma, mb)
            )
            + " |"
        )
    return "\n".join(lines)


def curve(records: Sequence[dict[str, Any]]) -> tuple[list[float], list[bool]]:
    """Top probabilities and whether each was right: a reliability diagram's input."""
    scored = [r for r in records if r["probabilities"] is not None]
    return [max(r["probabilities"]) for r in scored], [bool(r["correct"]) for r in scored]
