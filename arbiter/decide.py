"""`arbiter decide FILE.jsonl`: score a JSON Lines file in-process, no server, one record per line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from arbiter.errors import ArbiterError
from arbiter.lines import Line, chunk_size, numbered_lines, score_lines

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def cmd_decide(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Score each line of a JSONL file; print one result or error line per input line."""
    out = out or sys.stdout  # at the call: a default bound at import kept an old stdout
    from tqdm import tqdm

    # The input first: a file that is not there is refused in one line (``arbiter.refusals``)
    # before llama.cpp is imported or a model loads.
    lines = list(numbered_lines(Path(args.file)))
    from arbiter.engine import open_engine
    from arbiter.errors import ModelLoadError

    try:
        engine = open_engine(model=args.model)
    except ModelLoadError as exc:  # a refused model, template or profile: one line, no traceback
        print(f"arbiter decide: {exc.message}", file=sys.stderr)
        return 2
    failures = 0
    with tqdm(total=len(lines), unit="decision", file=sys.stderr, disable=args.quiet) as bar:
        for start in range(0, len(lines), args.chunk):
            chunk: list[tuple[int, Line]] = list(lines[start : start + args.chunk])
            for data, outcome in score_lines(engine, chunk):
                failures += isinstance(outcome, ArbiterError)
                out.write(data.decode("utf-8"))
            bar.update(len(chunk))
    engine.close()
    return 1 if failures and failures == len(lines) else 0


def register(sub: Subcommands) -> None:
    decide = sub.add_parser("decide", help="score a JSONL file of decisions, print JSONL results")
    decide.add_argument("file", help="one decision {id, state, question, options} per line")
    decide.add_argument("--model", type=Path, default=None, help="a .gguf (else ARBITER_MODEL...)")
    decide.add_argument(
        "--chunk", type=chunk_size, default=64, help="decisions scored per engine call"
    )
    decide.add_argument("--quiet", action="store_true", help="no progress bar")
    decide.set_defaults(func=cmd_decide)
