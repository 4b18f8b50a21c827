"""`arbiter bench orders`: what order robustness costs, against a single-order read in the same run.

Each labeled decision is scored cold (no prefix cache) twice on one engine, in alternating order
so drift falls on both sides alike: once as Arbiter read every decision before (``order_samples:
1``, the given order only) and once with the defaults (adaptive rotation: more orders on the same
prefill only while the leader is unclear). It prints the time ratio overall and by length tier,
and how many orders the defaults read; both sides' answers are checked against the labels, so
the cost sits beside what it buys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from arbiter.engine import Engine, open_engine
from arbiter.schema import DecisionResult
from arbiter.settings import engine_from_environment
from bench.common import DECISIONS, shown
from bench.figures import Progress, Ratio, check
from evaluation.tasks import EvalItem, load

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {"file": str(DECISIONS), "limit": 3}


def _items(args: argparse.Namespace) -> list[EvalItem]:
    files = (
        sorted(Path(args.file).glob("*.jsonl")) if Path(args.file).is_dir() else [Path(args.file)]
    )
    items = [i for i in load(files) if not args.split or i.split == args.split]
    if args.limit:
        step = max(1, len(items) // args.limit)  # spread over the files, not the first one
        items = items[::step][: args.limit]
    return items


def _timed(engine: Engine, item: EvalItem, single: bool) -> tuple[float, DecisionResult]:
    request = item.request.model_copy(update={"order_samples": 1 if single else None})
    started = time.perf_counter()
    outcome = engine.score([request])[0]
    elapsed = time.perf_counter() - started
    if not isinstance(outcome, DecisionResult):
        raise RuntimeError(f"{item.id}: {outcome}")
    return elapsed, outcome


def main(args: argparse.Namespace) -> int:
    items = _items(args)
    if not items:
        print("arbiter bench orders: no labeled items", file=sys.stderr)
        return 2
    settings = engine_from_environment().model_copy(update={"prefix_cache_mb": 0.0})
    if args.model is not None:
        settings = settings.model_copy(update={"model": args.model})
    engine = open_engine(settings)
    rows: list[dict[str, Any]] = []
    progress = Progress("orders")
    try:
        _timed(engine, items[0], True)  # warm-up
        for k, item in enumerate(items):
            sides = (True, False) if k % 2 == 0 else (False, True)
            got = {single: _timed(engine, item, single) for single in sides}
            (t1, r1), (ta, ra) = got[True], got[False]
            rows.append(
                {
                    "id": item.id,
                    "tier": item.tier or "-",
                    "single_s": t1,
                    "default_s": ta,
                    "orders_read": ra.orders_read,
                    "single_correct": r1.choice == item.label,
                    "default_correct": ra.choice == item.label,
                }
            )
            progress(f"{k + 1} of {len(items)} decisions")
    finally:
        engine.close()
    report = _report(rows, engine.model_info.file, shown(args.file))
    # The defaults read at least the given order: they cannot take less time than one read.
    report["warnings"] = check(
        [
            Ratio(
                "defaults_vs_single",
                report["overall"]["ratio_total"],
                tuple(r["default_s"] / r["single_s"] for r in rows),
                floor=1.0,
            )
        ]
    )
    if args.json:
        print(json.dumps(report))
    else:
        print(_table(report))
    return 0


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    single = sum(r["single_s"] for r in rows)
    default = sum(r["default_s"] for r in rows)
    return {
        "n": len(rows),
        "ratio_total": default / single if single else None,
        "ratio_median": statistics.median(r["default_s"] / r["single_s"] for r in rows),
        "mean_orders_read": statistics.fmean(r["orders_read"] for r in rows),
        "single_accuracy": statistics.fmean(r["single_correct"] for r in rows),
        "default_accuracy": statistics.fmean(r["default_correct"] for r in rows),
        "single_s": single,
        "default_s": default,
    }


def _report(rows: list[dict[str, Any]], model: str, file: str) -> dict[str, Any]:
    tiers = sorted({r["tier"] for r in rows})
    return {
        "model": model,
        "file": file,
        "overall": _summary(rows),
        "by_tier": {t: _summary([r for r in rows if r["tier"] == t]) for t in tiers},
    }


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"Order robustness's cost on {report['model']} ({report['file']}): the defaults "
        "(adaptive rotation) against one read in the given order, each decision cold, "
        "alternating",
        "",
        "| slice | n | time, defaults / single | median per decision | orders read "
        "| accuracy single -> defaults |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in [("overall", report["overall"]), *report["by_tier"].items()]:
        lines.append(
            f"| {name} | {s['n']} | {s['ratio_total']:.2f}x | {s['ratio_median']:.2f}x "
            f"| {s['mean_orders_read']:.2f} | {s['single_accuracy']:.3f} -> "
            f"{s['default_accuracy']:.3f} |"
        )
    return "\n".join(lines)
