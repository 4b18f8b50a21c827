"""Every `arbiter ...` command README.md and docs/*.md name, run from the project's built wheel.

The wheel is built from the working tree's files (tracked and untracked-but-not-ignored, as a
commit would have them) and installed into a fresh virtual environment with no pip, no editable
finder and no checkout on its path: the dev environment's site-packages lends the installed
dependencies through a ``.pth`` line (so nothing is downloaded), and every command runs with its
working directory outside the checkout. A package the wheel leaves out, a module that reads a
file only the checkout has, or a documented command that no longer exists fails here.

The command lines are collected from the documents' code (fenced blocks and inline spans), so
the test follows the README as it is rewritten and the commands other branches add: each one
runs with ``--help``; ``decide`` and ``prompt`` also run for real on the bundled model, and ``bench
peers`` builds its workload on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import ROOT
from tests.environ import environ_without

pytestmark = pytest.mark.real_model

DOCUMENTS = ("README.md", "docs/*.md")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE = re.compile(r"(`+)(.+?)\1", re.S)
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


@dataclass(frozen=True)
class Installed:
    """The wheel's environment: its interpreter, its ``arbiter`` script, a directory outside the
    checkout to run in, and the environment to run with."""

    python: Path
    arbiter: Path
    cwd: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.arbiter), *args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _working_tree_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def _build_wheel(work: Path) -> Path:
    source = work / "source"
    for name in _working_tree_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    dist = work / "dist"
    options = ["-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist)]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", *options, str(source)],
        check=True,
        capture_output=True,
    )
    [wheel] = dist.glob("arbiter-*.whl")
    return wheel


def _isolated_env(venv: Path) -> dict[str, str]:
    """The caller's environment without anything that would point back at the checkout or set the
    engine up differently (ARBITER_*, SageMaker's SM_*, PYTHON*)."""
    env = environ_without("ARBITER_", "SM_", "PYTHON", "VIRTUAL_ENV")
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "/usr/bin:/bin")])
    env["VIRTUAL_ENV"] = str(venv)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    work = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(work)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    options = ["-q", "--no-deps", "--no-index", "--no-compile"]
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", *options, str(wheel)],
        check=True,
        capture_output=True,
    )
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # The dependencies, lent: a path line in a .pth puts the directory on sys.path, but the .pth
    # files inside it (the editable install's finder among them) are not run.
    lent = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "zz_lent_dependencies.pth").write_text("".join(f"{p}\n" for p in lent))
    cwd = work / "run"
    cwd.mkdir()
    env = _isolated_env(venv)
    where = subprocess.run(
        [str(python), "-c", "import arbiter, sys; print(arbiter.__file__)"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv), f"arbiter came from {where}, not the wheel"
    return Installed(python, venv / "bin" / "arbiter", cwd, env)


# -- the documents' command lines ------------------------------------------------------------------


def _documents() -> list[Path]:
    return sorted({p for pattern in DOCUMENTS for p in ROOT.glob(pattern)})


def _code(text: str) -> Iterator[str]:
    """The documents' code: fenced blocks, then the inline spans of the rest."""
    for block in _FENCE.finditer(text):
        yield block.group(0)
    for span in _INLINE.finditer(_FENCE.sub("", text)):
        yield span.group(2)


def command_lines(text: str) -> Iterator[list[str]]:
    """The words after each ``arbiter`` (or ``.../arbiter``) in the code of ``text``."""
    for chunk in _code(text):
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
    for doc in _documents():
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
