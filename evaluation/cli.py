"""`arbiter eval` and `arbiter calibrate`: labeled decisions scored, then measured.

`arbiter eval` runs task files (``evaluation.tasks``) one decision at a time, either against the
in-process engine or a running endpoint (``--url``: ``POST {url}/invocations``), so the latency
figures are per-decision round trips, and each decision again with its options reversed (the flip
rate). A decision that fails counts as wrong. It writes ``eval-report.json`` (metrics overall and
per file, tier, family and question type; flips; the served abstention thresholds held to),
``eval-records.jsonl``, ``reliability.png`` and ``risk-coverage.png``, and prints a Markdown
summary. ``--compare`` runs a second configuration (other ``ARBITER_*`` settings in-process, or
another endpoint) and prints both side by side.

`arbiter calibrate` reads every item in several option orders (``evaluation.reads``), fits the
position prior, the adaptive margin, temperatures and abstention scores on one part
(``evaluation.calibrate``), reports them on the held-out rest, and writes the calibration file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from arbiter.schema import MAX_ORDER_SAMPLES
from arbiter.settings import EngineSettings, engine_from_environment
from evaluation.backends import Backend, EngineBackend, HttpBackend
from evaluation.calibrate import DEFAULT_MAX_COST, calibrate_reads
from evaluation.metrics import reliability_diagram, risk_coverage_plot
from evaluation.reads import collect
from evaluation.report import curve, fmt, markdown, report, side_by_side
from evaluation.run import run
from evaluation.tasks import EvalItem, TaskFileError, load


def overrides(text: str) -> dict[str, str]:
    """``ARBITER_ORDER_POLICY=single,ARBITER_SHIPPED_CALIBRATION=false`` as settings fields."""
    fields = EngineSettings.model_fields
    out = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        field = name.strip().removeprefix("ARBITER_").lower()
        if not sep or field not in fields:
            raise ValueError(f"{name!r} is not an engine setting (ARBITER_NAME=value)")
        out[field] = value.strip()
    return out


def _engine_settings(args: argparse.Namespace, changes: dict[str, Any]) -> EngineSettings:
    base = engine_from_environment()
    forced: dict[str, Any] = {}
    if args.model is not None:
        forced["model"] = args.model
    if args.profile is not None:
        forced["prompt_profile"] = args.profile
    return EngineSettings.model_validate({**base.model_dump(), **forced, **changes})


def _open_backend(args: argparse.Namespace, compare: str | None = None) -> Backend:
    if compare is not None and compare.startswith(("http://", "https://")):
        return HttpBackend(compare, timeout=args.timeout)
    if args.url and compare is None:
        return HttpBackend(args.url, timeout=args.timeout)
    from arbiter.engine import open_engine

    return EngineBackend(open_engine(_engine_settings(args, overrides(compare) if compare else {})))


def _items(args: argparse.Namespace) -> list[EvalItem] | None:
    try:
        items = load([Path(f) for f in args.files])
    except (OSError, TaskFileError) as exc:
        print(f"arbiter: {exc}", file=sys.stderr)
        return None
    split = getattr(args, "split", None)
    if split is not None:
        items = [i for i in items if i.split == split]
    if not items:
        print("arbiter: no labeled items in the given files", file=sys.stderr)
        return None
    return items


def _refused(args: argparse.Namespace) -> str | None:
    if args.url and args.profile:
        return (
            "--profile applies to the in-process engine; a running endpoint serves the profile "
            "it was started with (ARBITER_PROMPT_PROFILE)"
        )
    compare = getattr(args, "compare", None)
    if compare and not compare.startswith(("http://", "https://")):
        if args.url:
            return "--compare with --url takes another endpoint's URL"
        try:
            overrides(compare)
        except ValueError as exc:
            return str(exc)
    return None


def _evaluate(
    args: argparse.Namespace, items: list[EvalItem], outdir: Path, compare: str | None
) -> dict[str, Any]:
    backend = _open_backend(args, compare)
    try:
        calibration = backend.calibration()
        records, reversed_ = run(
            items, backend, args.order_samples, not args.no_reversed, progress=not args.quiet
        )
    finally:
        backend.close()
    rep = report(
        records,
        reversed_,
        [Path(f) for f in args.files],
        backend.name + (f" [{compare}]" if compare else ""),
        args.order_samples,
        calibration,
    )
    outdir.mkdir(parents=True, exist_ok=True)
    png = reliability_diagram({"model": curve(records)}, outdir / "reliability.png", "Reliability")
    risk = risk_coverage_plot(
        {"model": curve(records)}, outdir / "risk-coverage.png", "Risk-coverage"
    )
    records_path = outdir / "eval-records.jsonl"
    with records_path.open("w", encoding="utf-8") as handle:
        for i, r in enumerate(records):
            row = {k: v for k, v in r.items() if k != "model"}
            if reversed_ is not None:
                row["reversed_choice"] = reversed_[i]["choice"]
            handle.write(json.dumps(row) + "\n")
    rep["outputs"] = {
        "report": str(outdir / "eval-report.json"),
        "records": str(records_path),
        "reliability": str(png),
        "risk_coverage": str(risk),
    }
    (outdir / "eval-report.json").write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
    return rep


def cmd_eval(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    refused = _refused(args)
    if refused:
        print(f"arbiter: {refused}", file=sys.stderr)
        return 2
    items = _items(args)
    if items is None:
        return 2
    outdir = Path(args.out)
    rep = _evaluate(args, items, outdir, None)
    print(markdown(rep), file=out)
    print(f"\nwrote {', '.join(rep['outputs'].values())}", file=out)
    if args.compare:
        other = _evaluate(args, items, outdir / "compare", args.compare)
        print(f"\n{args.compare}:\n", file=out)
        print(markdown(other), file=out)
        print("\nSide by side:\n", file=out)
        print(side_by_side(rep, other, ("this configuration", args.compare)), file=out)
    failed = rep["overall"]["failures"]
    return 1 if failed == len(items) else 0


def cmd_calibrate(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    refused = _refused(args)
    if refused:
        print(f"arbiter: {refused}", file=sys.stderr)
        return 2
    items = _items(args)
    if items is None:
        return 2
    if args.from_reads:
        try:
            records = _read_records(Path(args.from_reads), items)
        except (OSError, ValueError) as exc:
            print(f"arbiter: {exc}", file=sys.stderr)
            return 2
    else:
        collected = _collect(args, items)
        if collected is None:
            return 2
        records = collected
    try:
        cal, summary, curves = calibrate_reads(
            records,
            args.holdout,
            args.seed,
            args.holdout_split,
            args.min_items,
            args.margin,
            args.margin_tolerance,
            args.max_cost,
        )
    except ValueError as exc:
        print(f"arbiter: {exc}", file=sys.stderr)
        return 2
    cal.extra["files"] = [str(f) for f in args.files]
    cal.extra["report"] = summary
    path = cal.save(Path(args.output))
    png = path.with_suffix(".png")
    if summary["held_out_items"]:
        reliability_diagram(curves, png, "Held-out reliability")
    print(calibration_summary(summary), file=out)
    print(f"\nwrote {path} and {png}\nserve with it: ARBITER_CALIBRATION={path}", file=out)
    return 0


def _collect(args: argparse.Namespace, items: list[EvalItem]) -> list[dict[str, Any]] | None:
    """Raw reads of every item: an endpoint's, or an engine's with no calibration applied. With
    ``--reads FILE``, the reads it already holds are kept (only missing orders are read), each
    item's record is appended to ``FILE.partial`` as it completes (a stopped run resumes there),
    and the file is written whole at the end."""
    reads = Path(args.reads) if args.reads else None
    done: dict[tuple[str, str], dict[str, Any]] = {}
    partial = reads.with_name(reads.name + ".partial") if reads else None
    for path in (reads, partial):
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    done[(record["file"], record["id"])] = record
    raw = {"shipped_calibration": "false", "calibration": None, "order_policy": "single"}
    if args.url:
        backend: Backend = HttpBackend(args.url, timeout=args.timeout)
    else:
        from arbiter.engine import open_engine

        backend = EngineBackend(open_engine(_engine_settings(args, raw)))
    held = args.holdout_split

    def keep(record: dict[str, Any]) -> None:
        if partial is not None:
            with partial.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")

    try:
        # The held-out items (when named) are measured, not fitted on: no rotations for a prior.
        records = collect(
            items,
            backend,
            lambda item: held is None or item.split != held,
            not args.quiet,
            done,
            keep,
        )
    except RuntimeError as exc:
        print(f"arbiter: {exc}", file=sys.stderr)
        return None
    finally:
        backend.close()
    if reads is not None and partial is not None:
        reads.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        partial.unlink(missing_ok=True)
    return records


def _read_records(path: Path, items: list[EvalItem]) -> list[dict[str, Any]]:
    """Reads written by an earlier ``--reads``, for the items of the given files (their labels
    and splits are the files', so a file edited since is refitted as it is now)."""
    by_key = {(i.file, i.id): i for i in items}
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        item = by_key.get((record["file"], record["id"]))
        if item is None:
            continue
        record.update(
            label=item.label,
            label_index=item.label_index,
            split=item.split,
            option_ids=[o.id for o in item.request.options],
        )
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no reads of the given files' items")
    return records


def _cost(m: dict[str, Any]) -> str:
    cost = m.get("cost", 1.0 if m.get("mean_reads") == 1.0 else None)
    return f"{cost:.2f}x" if cost is not None else "–"


def _abstention_table(summary: dict[str, Any]) -> list[str]:
    """Each budget's threshold, fitted on the fit part, held to the held-out part: the share
    automated there and its error (within the budget, if the bound held)."""
    lines = [
        "| error budget | policy | threshold (fitted) | held-out automated | held-out error |",
        "|---|---|---|---|---|",
    ]
    for name in ("adaptive", "single"):
        for budget, held in (summary[name]["held_out"].get("abstention") or {}).items():
            threshold = held["threshold"]
            lines.append(
                f"| {float(budget):.0%} | {name} "
                f"| {fmt(threshold) if threshold is not None else 'none (abstains on all)'} "
                f"| {held['coverage']:.0%} ({held['automated']}) | {fmt(held['error'])} |"
            )
    return lines


def calibration_summary(summary: dict[str, Any]) -> str:
    """The held-out part before (one raw read at T = 1) and after, per read policy."""
    lines = [
        f"Calibration on {summary['fit_items']} items, measured on {summary['held_out_items']} "
        f"held out ({summary['failures']} failures skipped); adaptive margin "
        f"{summary['margin']:g}",
        "",
        "| held-out | accuracy | NLL | Brier | ECE | flips | orders read | cost (tokens) "
        "| at 5% (best) | fitted 5%: automated, error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [("before (raw, one read)", summary["held_out_before"])]
    rows += [(name, summary[name]["held_out"]) for name in ("single", "adaptive")]
    for name, m in rows:
        flips = f"{m['flips']}/{m['compared']}" if m.get("compared") else "–"
        fitted = (m.get("abstention") or {}).get("0.05")
        held = f"{fitted['coverage']:.0%}, {fmt(fitted['error'])}" if fitted else "–"
        lines.append(
            f"| {name} | {fmt(m['accuracy'])} | {fmt(m['nll'])} | {fmt(m['brier'])} "
            f"| {fmt(m['ece'])} | {flips} | {fmt(m['mean_reads'], 2)} "
            f"| {_cost(m)} | {m['automatable']['0.05']:.0%} | {held} |"
        )
    lines += ["", *_abstention_table(summary)]
    held = summary["held_out_before"]
    after = summary["adaptive"]["held_out"]
    if held["nll"] is not None and after["nll"] is not None and after["nll"] > held["nll"]:
        lines.append(
            f"\nwarning: the held-out NLL got worse ({held['nll']:.3f} -> {after['nll']:.3f}): "
            "too few items to fit on, or a split that differs from the fit; use more labeled "
            "decisions"
        )
    return "\n".join(lines)


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
    ev = sub.add_parser(
        "eval", help="accuracy, calibration, flips and coverage on labeled decisions"
    )
    _common(ev)
    ev.add_argument(
        "--order-samples",
        type=int,
        default=None,
        choices=range(1, MAX_ORDER_SAMPLES + 1),
        metavar="K",
        help=f"read every decision in K option orders (1..{MAX_ORDER_SAMPLES}; 1: the given "
        "order only); unset: the server's read policy",
    )
    ev.add_argument("--split", default=None, help='only items whose "split" is this (e.g. heldout)')
    ev.add_argument(
        "--no-reversed", action="store_true", help="skip the reversed-order reads (no flip rate)"
    )
    ev.add_argument(
        "--compare",
        default=None,
        metavar="CONFIG",
        help="also run ARBITER_NAME=value,... (in-process) or another endpoint URL, side by side",
    )
    ev.add_argument("--out", default="eval-out", help="directory for the report files")
    ev.set_defaults(func=cmd_eval)

    cal = sub.add_parser(
        "calibrate",
        help="fit the position prior, temperatures and abstention scores on labeled decisions",
    )
    _common(cal)
    cal.add_argument("--output", "-o", default="calibration.json", help="calibration file to write")
    cal.add_argument("--holdout", type=float, default=0.3, help="share held out (random split)")
    cal.add_argument("--seed", type=int, default=0, help="seed of the random split")
    cal.add_argument(
        "--holdout-split", default=None, help='hold out items whose "split" is this (e.g. heldout)'
    )
    cal.add_argument(
        "--min-items", type=int, default=25, help="fit a temperature per type/bucket from this many"
    )
    cal.add_argument(
        "--margin",
        type=float,
        default=None,
        help="adaptive rotation's margin (logits); unset: the cheapest within --margin-tolerance",
    )
    cal.add_argument(
        "--margin-tolerance",
        type=float,
        default=0.005,
        help="the fit NLL above the best margin's that a cheaper margin may have (default 0.005)",
    )
    cal.add_argument(
        "--max-cost",
        type=float,
        default=DEFAULT_MAX_COST,
        help="the most a default decision may cost against one read, in prefilled tokens "
        f"(default {DEFAULT_MAX_COST:g}): the margin is the best the fit part affords",
    )
    cal.add_argument("--reads", default=None, help="also write the raw reads (JSON Lines) here")
    cal.add_argument(
        "--from-reads", default=None, help="fit on reads an earlier --reads wrote (no model run)"
    )
    cal.set_defaults(func=cmd_calibrate)
