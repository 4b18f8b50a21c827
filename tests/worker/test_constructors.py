"""The worker's parts are built from what they share (:class:`worker.context.WorkerContext`, a
:class:`worker.tries.Receive`, a :class:`worker.protection.Bounds`), not from long argument lists
that repeat each other: no ``__init__`` under ``worker/`` takes more than six parameters."""

from __future__ import annotations

import ast

from tests import ROOT

MOST = 6


def test_no_worker_constructor_takes_more_than_six_parameters() -> None:
    long = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    count = len(args.posonlyargs) + len(args.args) - 1 + len(args.kwonlyargs)
                    if count > MOST:
                        long.append(f"{path.relative_to(ROOT)}: {node.name} takes {count}")
    assert long == []
