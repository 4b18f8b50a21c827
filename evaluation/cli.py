"""`arbiter eval` and `arbiter calibrate`: labeled decisions scored serially, then measured.

Both run task files (``evaluation.tasks``) one decision at a time, either against the in-process
engine or a running endpoint (``--url``: ``POST {url}/invocations`` with ``{"decision": ...}``), so
the latency figures are per-decision round trips. A decision that fails (an error answer, a timeout,
an unreadable response) is kept as a failure and counts as wrong.

`arbiter eval` writes ``eval-report.json`` (metrics overall and per file, tier, family and question
type), ``eval-records.jsonl`` (one line per item) and ``reliability.png``, and prints a Markdown
summary. With ``--order-samples K`` every item is also scored with K option orders
(``arbiter.engine.ordering``) and the report counts how many answers flip against the plain order.

`arbiter calibrate` fits temperatures (``evaluation.calibrate``) on part of the file, reports NLL,
Brier and ECE before (T=1) and after on the held-out rest, and writes the calibration file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from arbiter.schema import MAX_ORDER_SAMPLES
from evaluation.backends import Backend, EngineBackend, HttpBackend
from evaluation.calibrate import calibrate_records, held_out_curves
from evaluation.metrics import reliability_diagram
from evaluation.report import curve, fmt, markdown, report
from evaluation.run import run
from evaluation.tasks import EvalItem, TaskFileError, load


def _open_backend(args: argparse.Namespace) -> Backend:
    if args.url:
        return HttpBackend(args.url, timeout=args.timeout)
    from arbiter.engine import open_engine

    return EngineBackend(open_engine(model=args.model, profile=args.profile))


def _items(args: argparse.Namespace) -> list[EvalItem] | None:
    try:
        items = load([Path(f) for f in args.files])
    except (OSError, TaskFileError) as exc:
        print(f"arbiter: {exc}", file=sys.stderr)
        return None
    if not items:
        print("arbiter: no labeled items in the given files", file=sys.stderr)
        return None
    return items


def _scored(
    args: argparse.Namespace, order_samples: int | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str] | None:
    """Every item of the task files scored on the chosen backend: the records, the plain-order
    baseline (with ``order_samples``) and the backend's name; None when the files are unusable."""
    items = _items(args)
    if items is None:
        return None
    if args.url and args.profile:
        print(
            "arbiter: --profile applies to the in-process engine; a running endpoint serves the "
            "profile it was started with (ARBITER_PROMPT_PROFILE)",
            file=sys.stderr,
        )
        return None
    backend = _open_backend(args)
    try:
        records, baseline = run(items, backend, order_samples, progress=not args.quiet)
    finally:
        backend.close()
    return records, baseline, backend.name


def cmd_eval(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    scored = _scored(args, args.order_samples)
    if scored is None:
        return 2
    records, baseline, backend_name = scored
    rep = report(records, baseline, [Path(f) for f in args.files], backend_name, args.order_samples)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    curves = {"model": curve(records)}
    if baseline is not None:
        curves = {"given order": curve(baseline), f"{args.order_samples} orders": curve(records)}
    png = reliability_diagram(curves, outdir / "reliability.png", "Reliability")
    records_path = outdir / "eval-records.jsonl"
    with records_path.open("w", encoding="utf-8") as handle:
        for i, r in enumerate(records):
            row = {k: v for k, v in r.items() if k != "model"}
            if baseline is not None:
                row["baseline_choice"] = baseline[i]["choice"]
            handle.write(json.dumps(row) + "\n")
    rep["outputs"] = {
        "report": str(outdir / "eval-report.json"),
        "records": str(records_path),
        "reliability": str(png),
    }
    (outdir / "eval-report.json").write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
    print(markdown(rep), file=out)
    print(f"\nwrote {rep['outputs']['report']}, {records_path}, {png}", file=out)
    failed = rep["overall"]["failures"]
    return 1 if failed == len(records) else 0


def cmd_calibrate(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    scored = _scored(args, None)
    if scored is None:
        return 2
    records = scored[0]
    try:
        cal, summary = calibrate_records(
            records, args.holdout, args.seed, args.holdout_split, args.min_items
        )
    except ValueError as exc:
        print(f"arbiter: {exc}", file=sys.stderr)
        return 2
    cal.extra["files"] = [str(f) for f in args.files]
    path = cal.save(Path(args.output))
    held = summary["held_out"]
    curves = held_out_curves(records, cal, args.holdout, args.seed, args.holdout_split)
    png = None
    if curves:
        png = reliability_diagram(curves, path.with_suffix(".png"), "Held-out reliability")
    temps = ", ".join(f"{k} {v:.3f}" for k, v in summary["temperatures"].items()) or "none"
    print(
        f"Calibration on {summary['fit_items']} items, measured on {summary['held_out_items']} "
        f"held out ({summary['failures']} failures skipped)\n\n"
        f"global T = {summary['global_temperature']:.3f}; per type: {temps}\n\n"
        "| held-out | n | NLL | Brier | ECE | accuracy |\n|---|---|---|---|---|---|",
        file=out,
    )
    for name in ("before", "after"):
        m = held[name]
        print(
            f"| {name} | {m['n']} | {fmt(m['nll'])} | {fmt(m['brier'])} | {fmt(m['ece'])} "
            f"| {fmt(m['accuracy'])} |",
            file=out,
        )
    before, after = held["before"]["nll"], held["after"]["nll"]
    if before is not None and after is not None and after > before:
        print(
            f"\nwarning: the held-out NLL got worse ({before:.3f} -> {after:.3f}): too few items "
            "to fit on, or a split that differs from the fit; use more labeled decisions",
            file=out,
        )
    print(f"\nwrote {path}" + (f" and {png}" if png else ""), file=out)
    print(f"serve with it: ARBITER_CALIBRATION={path}", file=out)
    return 0


# -- CLI ---------------------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", help="labeled task files (Arbiter or JevBench JSONL)")
    parser.add_argument(
        "--url", default=None, help="a running endpoint (else the in-process engine)"
    )
    parser.add_argument("--model", type=Path, default=None, help="in-process: a .gguf")
    parser.add_argument(
        "--profile",
        default=None,
        help="in-process: a prompt profile (file or built-in name), to compare profiles on one file",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="--url: seconds per request")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def register(sub: Any) -> None:
    """Add ``eval`` and ``calibrate`` to the ``arbiter`` subcommands."""
    ev = sub.add_parser("eval", help="accuracy, calibration and latency on labeled decisions")
    _common(ev)
    ev.add_argument(
        "--order-samples",
        type=int,
        default=None,
        choices=range(1, MAX_ORDER_SAMPLES + 1),
        metavar="K",
        help=f"also score K option orders (1..{MAX_ORDER_SAMPLES}) and count answers that flip",
    )
    ev.add_argument("--out", default="eval-out", help="directory for the report files")
    ev.set_defaults(func=cmd_eval)

    cal = sub.add_parser(
        "calibrate", help="fit temperatures per question type on labeled decisions"
    )
    _common(cal)
    cal.add_argument("--output", "-o", default="calibration.json", help="calibration file to write")
    cal.add_argument("--holdout", type=float, default=0.3, help="share held out (random split)")
    cal.add_argument("--seed", type=int, default=0, help="seed of the random split")
    cal.add_argument(
        "--holdout-split", default=None, help='hold out items whose "split" is this (e.g. test)'
    )
    cal.add_argument(
        "--min-items", type=int, default=8, help="fit a per-type temperature from this many items"
    )
    cal.set_defaults(func=cmd_calibrate)
