"""The ``arbiter`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from adapter.lines import Line, score_lines


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


def cmd_decide(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Score each line of a JSONL file; print one result or error line per input line."""
    from tqdm import tqdm

    from adapter.engine import open_engine

    engine = open_engine(model=args.model)
    lines = list(_lines(Path(args.file)))
    failures = 0
    with tqdm(total=len(lines), unit="decision", file=sys.stderr, disable=args.quiet) as bar:
        for start in range(0, len(lines), args.chunk):
            chunk: list[tuple[int, Line]] = list(lines[start : start + args.chunk])
            for record in score_lines(engine, chunk):
                failures += "error" in record
                out.write(json.dumps(record) + "\n")
            bar.update(len(chunk))
    engine.close()
    return 1 if failures and failures == len(lines) else 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from bench.engine_bench import main as bench_main

    return bench_main(args)


def cmd_bench_models(args: argparse.Namespace) -> int:
    from bench.models_bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arbiter", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    decide = sub.add_parser("decide", help="score a JSONL file of decisions, print JSONL results")
    decide.add_argument("file", help="one decision {id, state, question, options} per line")
    decide.add_argument("--model", type=Path, default=None, help="a .gguf (else ARBITER_MODEL...)")
    decide.add_argument("--chunk", type=int, default=64, help="decisions scored per engine call")
    decide.add_argument("--quiet", action="store_true", help="no progress bar")
    decide.set_defaults(func=cmd_decide)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="suite", required=True)
    engine = bench_sub.add_parser("engine", help="engine latency vs the llama_decode floor")
    engine.add_argument("--model", type=Path, default=None)
    engine.add_argument("--json", action="store_true", help="print JSON (last line: the ratios)")
    engine.add_argument("--repeats", type=int, default=5)
    engine.add_argument(
        "--long-prompt", type=int, default=0, metavar="N", help="add a ~N-token single-decision row"
    )
    engine.set_defaults(func=cmd_bench_engine)
    models = bench_sub.add_parser("models", help="compare the bundled candidate models")
    models.add_argument("--file", default="examples/labeled.jsonl", help="labeled decisions")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=cmd_bench_models)
    from worker.cli import register as register_worker_commands  # work, submit, local, bench worker

    register_worker_commands(sub, bench_sub)
    from adapter.evaluation import register as register_eval_commands  # eval, calibrate

    register_eval_commands(sub)
    from bench.all_bench import register as register_bench_all  # bench all

    register_bench_all(bench_sub)
    from adapter.serve import register as register_serve_commands  # serve, bench http

    register_serve_commands(sub, bench_sub)
    from infra.cli import register as register_infra_commands  # package-model, deploy

    register_infra_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
