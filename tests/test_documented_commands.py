"""Every `arbiter ...` command README.md and docs/*.md name, run from the project's built wheel
(``tests.documented``: a package the wheel leaves out, a module that reads a file only the checkout
has, or a documented command that no longer exists fails here).

The command lines are collected from the documents' code (fenced blocks and inline spans), so
the test follows the README as it is rewritten and the commands other branches add: each one
runs with ``--help``; ``decide`` and ``prompt`` also run for real on the bundled model, and ``bench
peers`` builds its workload on it. Their blocks run whole in tests/test_documented_examples.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests import ROOT
from tests.documented import Installed, code, documents

pytestmark = pytest.mark.real_model

_WORD = re.compile(r"[a-z][a-z0-9-]*")

# Run inside the wheel's environment: the CLI's tree of subcommands, read from its parsers.
_TREE = """
import argparse, json
from arbiter.cli import build_parser

def tree(parser):
    return {
        name: tree(sub)
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    }

print(json.dumps(tree(build_parser())))
"""


# -- the documents' command lines ------------------------------------------------------------------


def command_lines(text: str) -> Iterator[list[str]]:
    """The words after each ``arbiter`` (or ``.../arbiter``) in the code of ``text``."""
    for chunk in code(text):
        for line in chunk.splitlines():
            words = line.split()
            for i, word in enumerate(words):
                if word == "arbiter" or word.endswith("/arbiter"):
                    yield [w.rstrip(",;:)") for w in words[i + 1 :]]


def resolve(words: list[str], tree: dict[str, Any]) -> list[tuple[str, ...]] | str:
    """The subcommand paths ``words`` name (``a|b`` and ``a/b`` name both), or why none."""
    paths: list[tuple[str, ...]] = [()]
    level: dict[str, Any] | None = tree
    for word in words:
        names = re.split(r"[|/]", word)
        if not level or not all(_WORD.fullmatch(n) for n in names):
            break
        unknown = [n for n in names if n not in level]
        if unknown:
            return f"names {unknown[0]!r}, which is none of {sorted(level)}"
        if len(names) > 1:
            return [(*paths[0], n) for n in names]  # alternatives end the line's path
        paths = [(*paths[0], word)]
        level = level[word]
    return paths if paths != [()] else []


def documented(tree: dict[str, Any]) -> tuple[set[tuple[str, ...]], list[str]]:
    """Every subcommand path the documents name, and each line that names one that is not."""
    found: set[tuple[str, ...]] = set()
    wrong: list[str] = []
    for doc in documents():
        for words in command_lines(doc.read_text()):
            paths = resolve(words, tree)
            if isinstance(paths, str):
                wrong.append(f"{doc.relative_to(ROOT)}: `arbiter {' '.join(words[:4])}` {paths}")
            else:
                found.update(paths)
    return found, wrong


def test_the_collector_reads_code_not_prose() -> None:
    tree = {"bench": {"engine": {}, "peers": {}}, "serve": {}, "models": {"list": {}}}
    text = (
        "Run arbiter serve in prose, then `arbiter serve --port 1`.\n"
        "```bash\n.venv/bin/arbiter bench peers --only-study   # arbiter bench engine\n```\n"
        "`arbiter bench engine|peers`, `arbiter models list`, `arbiter serve for the`, `arbiter`\n"
    )
    found = {p for words in command_lines(text) for p in resolve(words, tree) or []}
    assert found == {("serve",), ("bench", "peers"), ("bench", "engine"), ("models", "list")}
    assert resolve(["bench", "frob"], tree) == "names 'frob', which is none of ['engine', 'peers']"
    assert resolve(["frob"], tree) == "names 'frob', which is none of ['bench', 'models', 'serve']"


def test_every_documented_command_runs_from_the_wheel(installed: Installed) -> None:
    tree = json.loads(
        subprocess.run(
            [str(installed.python), "-c", _TREE],
            cwd=installed.cwd,
            env=installed.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    found, wrong = documented(tree)
    assert wrong == []
    assert len(found) >= 10, found  # the collector found the documents' commands at all
    paths = sorted(found)
    with ThreadPoolExecutor(4) as pool:
        runs = pool.map(lambda path: installed.run(*path, "--help", timeout=120), paths)
        done = dict(zip(paths, runs, strict=True))
    failed = {
        " ".join(path): (d.returncode, d.stderr[-600:])
        for path, d in done.items()
        if d.returncode != 0 or "usage: arbiter" not in d.stdout
    }
    assert failed == {}


def test_decide_and_prompt_run_from_the_wheel(installed: Installed) -> None:
    decisions = installed.cwd / "decisions.jsonl"
    lines = (ROOT / "examples" / "decisions.jsonl").read_text().splitlines()[:2]
    decisions.write_text("\n".join(lines) + "\n")
    done = installed.run("decide", str(decisions), "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["id"] for r in records] == [json.loads(line)["id"] for line in lines]
    assert all(abs(sum(r["result"]["probabilities"]) - 1) < 1e-6 for r in records), records
    done = installed.run("prompt", str(decisions))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(lines[0])["question"] in done.stdout


def test_bench_peers_runs_from_the_wheel(installed: Installed) -> None:
    """`arbiter bench peers` imported the GPU check's modules, which the wheel leaves out. Its
    workload is built on the bundled model here and every module it runs is imported; the study
    itself (about 50 CPU seconds at its smallest) and the llama-server build are left out."""
    done = installed.run("bench", "peers", "--only-study", "--no-study", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["model"] == "gemma-3-270m-q4_k_m.gguf" and report["rows"] == {}
