"""`arbiter eval` and `arbiter calibrate`: labeled decisions scored serially, then measured.

Both run a task file (``adapter.eval_tasks``) one decision at a time, either against the in-process
engine or a running endpoint (``--url``: ``POST {url}/invocations`` with ``{"decision": ...}``), so
the latency figures are per-decision round trips. A decision that fails (an error answer, a timeout,
an unreadable response) is kept as a failure and counts as wrong.

`arbiter eval` writes ``eval-report.json`` (metrics overall and per file, tier, family and question
type), ``eval-records.jsonl`` (one line per item) and ``reliability.png``, and prints a Markdown
summary. With ``--order-samples K`` every item is also scored with K option orders
(``arbiter.engine.ordering``) and the report counts how many answers flip against the plain order.

`arbiter calibrate` fits temperatures (``arbiter.engine.calibration``) on part of the file, reports NLL,
Brier and ECE before (T=1) and after on the held-out rest, and writes the calibration file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from adapter import eval_metrics
from adapter.eval_tasks import EvalItem, TaskFileError, load
from arbiter.engine import calibration
from arbiter.engine.probabilities import softmax
from arbiter.schema import DecisionRequest

Outcome = tuple[dict[str, Any] | None, dict[str, Any] | None]  # (result, error)


class Backend(Protocol):
    name: str

    def decide(self, request: DecisionRequest) -> Outcome: ...

    def close(self) -> None: ...


class EngineBackend:
    """The in-process engine (``ARBITER_*`` settings, or ``--model``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = f"in-process ({engine.model_info.file})"

    def decide(self, request: DecisionRequest) -> Outcome:
        from arbiter.errors import ArbiterError

        try:
            outcome = self.engine.score([request])[0]
        except ArbiterError as exc:
            return None, exc.to_dict()
        if isinstance(outcome, ArbiterError):
            return None, outcome.to_dict()
        return outcome.model_dump(mode="json"), None

    def close(self) -> None:
        self.engine.close()


class HttpBackend:
    """A running Arbiter endpoint: one ``POST /invocations`` per decision."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.name = self.url

    def decide(self, request: DecisionRequest) -> Outcome:
        body = json.dumps({"decision": request.model_dump(mode="json", exclude_none=True)})
        req = urllib.request.Request(
            f"{self.url}/invocations",
            data=body.encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as response:
                raw = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return None, _http_error(exc)
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            return None, {"type": "connection_error", "code": "unreachable", "message": str(exc)}
        except json.JSONDecodeError as exc:
            return None, {"type": "api_error", "code": "bad_response", "message": str(exc)}
        result = raw.get("result") if isinstance(raw, dict) else None
        if not isinstance(result, dict) or "probabilities" not in result:
            return None, {
                "type": "api_error",
                "code": "bad_response",
                "message": 'the response has no "result" with probabilities',
            }
        return result, None

    def close(self) -> None:
        return None


def _http_error(exc: urllib.error.HTTPError) -> dict[str, Any]:
    try:
        raw = json.loads(exc.read())
    except (json.JSONDecodeError, OSError, ValueError):
        raw = None
    error = raw.get("error") if isinstance(raw, dict) else None
    if isinstance(error, dict):
        return {**error, "status": exc.code}
    return {
        "type": "api_error",
        "code": f"http_{exc.code}",
        "message": str(exc),
        "status": exc.code,
    }


def _record(
    item: EvalItem, result: dict[str, Any] | None, error: Any, elapsed: float
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": item.id,
        "file": item.file,
        "tier": item.tier,
        "family": item.family,
        "split": item.split,
        "question_type": item.question_type,
        "label": item.label,
        "label_index": item.label_index,
        "latency_s": elapsed,
        "choice": None,
        "correct": False,
        "probabilities": None,
        "option_logits": None,
        "error": error,
    }
    if result is None:
        return record
    ids = [o.id for o in item.request.options]
    if list(result.get("option_ids", [])) != ids:
        record["error"] = {
            "type": "api_error",
            "code": "bad_response",
            "message": "option ids differ",
        }
        return record
    record.update(
        choice=result["choice"],
        correct=result["choice"] == item.label,
        probabilities=[float(p) for p in result["probabilities"]],
        option_logits=[float(x) for x in result["option_logits"]],
        allowed_mass=result.get("allowed_mass"),
        prompt_version=(result.get("prompt") or {}).get("version"),
        probability_status=result.get("probability_status"),
        model=result.get("model"),
    )
    return record


def run(
    items: Sequence[EvalItem],
    backend: Backend,
    order_samples: int | None = None,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Score every item serially. With ``order_samples`` > 1, also the plain order (baseline)."""
    from tqdm import tqdm

    k = order_samples if order_samples and order_samples > 1 else None
    records: list[dict[str, Any]] = []
    baseline: list[dict[str, Any]] | None = [] if k else None
    total = len(items) * (2 if k else 1)
    with tqdm(total=total, unit="decision", file=sys.stderr, disable=not progress) as bar:
        for item in items:
            plain = item.request.model_copy(update={"order_samples": None})
            if baseline is not None:
                baseline.append(_timed(item, plain, backend))
                bar.update(1)
            request = item.request.model_copy(update={"order_samples": k}) if k else plain
            records.append(_timed(item, request, backend))
            bar.update(1)
    return records, baseline


def _timed(item: EvalItem, request: DecisionRequest, backend: Backend) -> dict[str, Any]:
    started = time.perf_counter()
    result, error = backend.decide(request)
    return _record(item, result, error, time.perf_counter() - started)


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


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _row(name: str, m: dict[str, Any]) -> str:
    lat = m["latency"]
    return (
        f"| {name} | {m['n']} | {m['failures']} | {_fmt(m['accuracy'])} | {_fmt(m['brier'])} "
        f"| {_fmt(m['ece'])} | {_fmt(lat['p50_ms'], 0)} | {_fmt(lat['p95_ms'], 0)} "
        f"| {_fmt(lat['p99_ms'], 0)} | {_fmt(lat['max_ms'], 0)} |"
    )


def markdown(rep: dict[str, Any]) -> str:
    lines = [
        f"Eval of {', '.join(rep['files'])} on {rep['backend']} "
        f"(prompt {rep['prompt_version']}, order samples {rep['order_samples']})",
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
            f"{_fmt(order['baseline']['accuracy'])} -> {_fmt(rep['overall']['accuracy'])}; first "
            f"option chosen {_fmt(order['first_option_share_baseline'], 2)} -> "
            f"{_fmt(order['first_option_share'], 2)}.",
        ]
    return "\n".join(lines)


def _open_backend(args: argparse.Namespace) -> Backend:
    if args.url:
        return HttpBackend(args.url, timeout=args.timeout)
    from arbiter.engine import open_engine

    return EngineBackend(open_engine(model=args.model))


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


def cmd_eval(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    items = _items(args)
    if items is None:
        return 2
    backend = _open_backend(args)
    try:
        records, baseline = run(items, backend, args.order_samples, progress=not args.quiet)
    finally:
        backend.close()
    rep = report(records, baseline, [Path(f) for f in args.files], backend.name, args.order_samples)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    curves = {"model": _curve(records)}
    if baseline is not None:
        curves = {"given order": _curve(baseline), f"{args.order_samples} orders": _curve(records)}
    png = eval_metrics.reliability_diagram(curves, outdir / "reliability.png", "Reliability")
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


def _curve(records: Sequence[dict[str, Any]]) -> tuple[list[float], list[bool]]:
    scored = [r for r in records if r["probabilities"] is not None]
    return [max(r["probabilities"]) for r in scored], [bool(r["correct"]) for r in scored]


# -- calibrate ---------------------------------------------------------------------------------


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
        "brier": eval_metrics.brier(probs, labels),
        "ece": eval_metrics.ece([max(p) for p in probs], correct),
        "accuracy": eval_metrics.accuracy(correct),
    }


def calibrate_records(
    records: Sequence[dict[str, Any]],
    holdout: float = 0.3,
    seed: int = 0,
    holdout_split: str | None = None,
    min_items: int = 8,
) -> tuple[calibration.Calibration, dict[str, Any]]:
    """Fit on one part of the scored records, measure on the rest; the calibration and a report."""
    usable = [r for r in records if r["option_logits"] is not None]
    fit_rows, held = split_items(usable, holdout, seed, holdout_split)
    if not fit_rows:
        raise ValueError("nothing left to fit on: lower --holdout or add items")
    global_t, by_type = calibration.fit(
        [r["option_logits"] for r in fit_rows],
        [r["label_index"] for r in fit_rows],
        [r["question_type"] if r["question_type"] != "decision" else None for r in fit_rows],
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
    cal = calibration.Calibration(
        global_temperature=global_t,
        by_type=by_type,
        model_sha256=model.get("sha256"),
        model_file=model.get("file"),
        extra={"prompt_version": prompt_version, "report": summary},
    )
    return cal, summary


def cmd_calibrate(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    items = _items(args)
    if items is None:
        return 2
    backend = _open_backend(args)
    try:
        records, _ = run(items, backend, None, progress=not args.quiet)
    finally:
        backend.close()
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
    usable = [r for r in records if r["option_logits"] is not None]
    _, held_rows = split_items(usable, args.holdout, args.seed, args.holdout_split)
    png = None
    if held_rows:

        def curve(temp: Callable[[dict[str, Any]], float]) -> tuple[list[float], list[bool]]:
            probs = [softmax(r["option_logits"], temp(r)).tolist() for r in held_rows]
            return [max(p) for p in probs], [
                int(np.argmax(p)) == r["label_index"] for p, r in zip(probs, held_rows, strict=True)
            ]

        png = eval_metrics.reliability_diagram(
            {
                "raw (T=1)": curve(lambda r: 1.0),
                "calibrated": curve(
                    lambda r: cal.temperature_for(
                        r["question_type"] if r["question_type"] != "decision" else None
                    )
                ),
            },
            path.with_suffix(".png"),
            "Held-out reliability",
        )
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
            f"| {name} | {m['n']} | {_fmt(m['nll'])} | {_fmt(m['brier'])} | {_fmt(m['ece'])} "
            f"| {_fmt(m['accuracy'])} |",
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
        choices=range(1, 9),
        metavar="K",
        help="also score K option orders (1..8) and count answers that flip",
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
