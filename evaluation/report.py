"""An eval's report: metrics overall and per file, tier, family and question type, order flips,
and the Markdown summary `arbiter eval` prints."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from evaluation import metrics as eval_metrics


def _grouped(records: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(str(r[key]) if r[key] is not None else "-", []).append(r)
    return {name: eval_metrics.summarize(rows) for name, rows in sorted(groups.items())}


def report(
    records: Sequence[dict[str, Any]],
    baseline: Sequence[dict[str, Any]] | None,
    files: Sequence[Path],
    backend_name: str,
    order_samples: int | None,
) -> dict[str, Any]:
    first = next((r for r in records if r.get("model")), {})
    out: dict[str, Any] = {
        "files": [str(f) for f in files],
        "backend": backend_name,
        "model": first.get("model"),
        "prompt_version": first.get("prompt_version"),
        "prompt_profile_sha256": (first.get("model") or {}).get("prompt_profile_sha256"),
        "order_samples": order_samples or 1,
        "overall": eval_metrics.summarize(records),
        "by_file": _grouped(records, "file"),
        "by_tier": _grouped(records, "tier"),
        "by_family": _grouped(records, "family"),
        "by_question_type": _grouped(records, "question_type"),
    }
    if baseline is not None:
        compared = [
            (b, r)
            for b, r in zip(baseline, records, strict=True)
            if b["choice"] is not None and r["choice"] is not None
        ]
        flips = sum(b["choice"] != r["choice"] for b, r in compared)
        out["order"] = {
            "samples": order_samples,
            "baseline": eval_metrics.summarize(baseline),
            "compared": len(compared),
            "flips": flips,
            "flip_rate": flips / len(compared) if compared else None,
            "first_option_share_baseline": _first_share(baseline),
            "first_option_share": _first_share(records),
        }
    return out


def _first_share(records: Sequence[dict[str, Any]]) -> float | None:
    scored = [r for r in records if r["probabilities"] is not None]
    if not scored:
        return None
    return sum(int(np.argmax(r["probabilities"])) == 0 for r in scored) / len(scored)


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
        f"| {fmt(m['ece'])} | {fmt(lat['p50_ms'], 0)} | {fmt(lat['p95_ms'], 0)} "
        f"| {fmt(lat['p99_ms'], 0)} | {fmt(lat['max_ms'], 0)} |"
    )


def markdown(rep: dict[str, Any]) -> str:
    lines = [
        f"Eval of {', '.join(rep['files'])} on {rep['backend']} "
        f"(prompt {rep['prompt_version']}, profile sha256 "
        f"{(rep.get('prompt_profile_sha256') or '?')[:12]}, order samples {rep['order_samples']})",
        "",
        "| slice | n | failures | accuracy | Brier | ECE | p50 ms | p95 ms | p99 ms | max ms |",
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
    order = rep.get("order")
    if order:
        lines += [
            "",
            f"Order robustness: {order['flips']} of {order['compared']} answers flip between the "
            f"given order and {order['samples']} averaged orders; accuracy "
            f"{fmt(order['baseline']['accuracy'])} -> {fmt(rep['overall']['accuracy'])}; first "
            f"option chosen {fmt(order['first_option_share_baseline'], 2)} -> "
            f"{fmt(order['first_option_share'], 2)}.",
        ]
    return "\n".join(lines)


def curve(records: Sequence[dict[str, Any]]) -> tuple[list[float], list[bool]]:
    """Top probabilities and whether each was right: a reliability diagram's input."""
    scored = [r for r in records if r["probabilities"] is not None]
    return [max(r["probabilities"]) for r in scored], [bool(r["correct"]) for r in scored]
