"""The ``arbiter`` command (``python -m arbiter``): the composition root.

Each package registers its own subcommands (its ``register(subparsers)``); this is the one module of
the core that imports the entry points, and it imports only the package of the command being run, so
``arbiter serve`` loads neither the worker nor the benchmarks. ``arbiter --help`` loads them all.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# Subcommand -> the module whose ``register`` adds it (with its siblings).
COMMANDS = {
    "decide": "arbiter.decide",
    "prompt": "arbiter.show_prompt",
    "models": "arbiter.model_store",
    "serve": "adapter.cli",
    "entrypoint": "adapter.cli",
    "openapi": "adapter.cli",
    "work": "worker.cli",
    "submit": "worker.cli",
    "local": "worker.cli",
    "check-fanout": "worker.cli",
    "eval": "evaluation.cli",
    "calibrate": "evaluation.cli",
    "bench": "bench.cli",
    "package-model": "infra.cli",
    "deploy": "infra.cli",
    "runtime": "emulator.cli",
    "transform": "emulator.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``command``'s package registered, or every package's when it is None (or
    not a known command: argparse then lists them all)."""
    parser = argparse.ArgumentParser(
        prog="arbiter", description="Decision models served with llama.cpp."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    known = COMMANDS.get(command or "")
    for module in dict.fromkeys([known] if known else COMMANDS.values()):
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A refusal (a missing model, a bad setting or profile, no AWS credentials:
    :mod:`arbiter.refusals`) is one line on stderr and status 2, as argparse's own; a bug keeps
    its traceback."""
    import sys

    from arbiter.refusals import refusal

    args_in = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_in if not a.startswith("-")), None)
    args = build_parser(command).parse_args(args_in)
    # Logs go to stderr from the first line: commands such as decide write their answers on stdout.
    from arbiter.logging import configure

    configure()
    try:
        return int(args.func(args) or 0)
    except Exception as exc:
        line = refusal(exc)
        if line is None:
            raise
        print(f"arbiter {args.command}: {line}", file=sys.stderr)
        return 2
