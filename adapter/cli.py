"""The ``arbiter`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from adapter.errors import ArbiterError, InvalidDecision, MalformedRequest
from adapter.schema import DecisionRequest


def _error_record(line: int, raw_id: Any, error: ArbiterError) -> dict[str, Any]:
    return {"line": line, "id": raw_id, "error": error.to_dict()}


def validation_error(exc: ValidationError, prefix: str | None = None) -> InvalidDecision:
    """The first pydantic error as a typed error naming its field (``options.2.id``)."""
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    param = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or None)
    message = first["msg"]
    if param:
        message = f"{param}: {message}"
    return InvalidDecision(message, param=param, code="invalid_field")


def parse_decision_line(line: str) -> DecisionRequest:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MalformedRequest(f"line is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidDecision("line must be a JSON object (one decision)", code="invalid_type")
    try:
        return DecisionRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc


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
            chunk = lines[start : start + args.chunk]
            parsed: list[tuple[int, DecisionRequest | ArbiterError, Any]] = []
            for number, line in chunk:
                try:
                    request = parse_decision_line(line)
                    parsed.append((number, request, request.id))
                except ArbiterError as exc:
                    parsed.append((number, exc, _raw_id(line)))
            requests = [r for _, r, _ in parsed if isinstance(r, DecisionRequest)]
            outcomes = iter(engine.score(requests))
            for number, item, raw_id in parsed:
                outcome = next(outcomes) if isinstance(item, DecisionRequest) else item
                if isinstance(outcome, ArbiterError):
                    failures += 1
                    record = _error_record(number, raw_id, outcome)
                else:
                    record = {"line": number, "id": raw_id, "result": outcome.model_dump()}
                out.write(json.dumps(record) + "\n")
            bar.update(len(chunk))
    engine.close()
    return 1 if failures and failures == len(lines) else 0


def _raw_id(line: str) -> Any:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError:
        return None
    return raw.get("id") if isinstance(raw, dict) else None


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
