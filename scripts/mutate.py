"""`make mutate`: undo each named fix, run the tests that guard it, expect them to fail, restore.

A test that passes with its fix removed guards nothing. Each mutation names the fix as the exact
text it adds, the text the code would read without it, and the tests that must then fail; they
are data, one TOML file per package beside its tests (``tests/<package>/mutations.toml``, read by
:func:`load`). Mutations run in copies of the tree (two at once by default), so the checkout
itself is never written.

    .venv/bin/python scripts/mutate.py              # every mutation
    .venv/bin/python scripts/mutate.py NAME ...     # some of them; --list names them all

Exit status 0 when every mutation was caught; 1 when one survived (or its text is gone: a fix
that moved must move in its TOML file too).
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"name", "note", "path", "fix", "without", "tests", "env", "seconds", "always"}


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    fix: str  # exactly once in the file
    without: str  # what the code reads without the fix
    tests: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # set for its tests (a smaller campaign, say)
    note: str = ""  # why these tests, where it is not plain
    seconds: float = 0.0  # how long it took on CI's 2 cores: the slowest start first
    always: bool = False  # in every --share (the proof that the campaign can fail)


def load(root: Path = ROOT) -> tuple[Mutation, ...]:
    """Every ``tests/*/mutations.toml``'s mutations, package by package; a key the runner does
    not know is refused (a misspelt ``tests`` would guard nothing)."""
    out: list[Mutation] = []
    for path in sorted(root.glob("tests/*/mutations.toml")):
        with path.open("rb") as f:
            entries = tomllib.load(f).get("mutation", [])
        for entry in entries:
            unknown = set(entry) - FIELDS
            if unknown:
                raise SystemExit(f"mutate: {path}: {entry.get('name')}: unknown {sorted(unknown)}")
            out.append(
                Mutation(
                    name=entry["name"],
                    path=entry["path"],
                    fix=entry["fix"],
                    without=entry["without"],
                    tests=tuple(entry["tests"]),
                    env=tuple((k, str(v)) for k, v in entry.get("env", {}).items()),
                    note=entry.get("note", ""),
                    seconds=float(entry.get("seconds", 0)),
                    always=bool(entry.get("always", False)),
                )
            )
    return tuple(out)


MUTATIONS = load()


def copy_tree(into: Path) -> Path:
    """A copy of the checkout to mutate (the checkout itself is never written): its own sources,
    the same virtual environment, which finds them first through PYTHONPATH (see `environment`)."""
    junk = shutil.ignore_patterns(".git", ".venv", ".mypy_cache", ".ruff_cache", "__pycache__")
    shutil.copytree(ROOT, into, ignore=junk, symlinks=True)
    return into


def environment(tree: Path, extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """PYTHONPATH puts the copy's packages before the editable install's finder (which points at
    the checkout), for pytest and for every child process a test starts."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutated file's bytecode is never cached
    env.update(extra)
    return env


def check_copy(tree: Path) -> None:
    """Refuse to run if the copy's code is not what its tests import: every mutation would
    survive, or worse, seem caught by the checkout's own code."""
    probe = "import arbiter, worker; print(arbiter.__file__); print(worker.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tree,
        env=environment(tree),
        capture_output=True,
        text=True,
        check=True,
    )
    for line in done.stdout.split():
        if not Path(line).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"mutate: the copy at {tree} imports {line}, not its own code")


def run_tests(tree: Path, mutation: Mutation, timeout_s: float) -> tuple[int, float]:
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    command += ["--timeout", str(int(timeout_s)), *mutation.tests]
    env = environment(tree, mutation.env)
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    return done.returncode, time.perf_counter() - started


def mutate(tree: Path, mutation: Mutation, timeout_s: float) -> tuple[str, float]:
    path = tree / mutation.path
    original = path.read_bytes()
    text = original.decode()
    if text.count(mutation.fix) != 1:
        return f"GONE (its text is in {mutation.path} {text.count(mutation.fix)} times)", 0.0
    try:
        path.write_text(text.replace(mutation.fix, mutation.without))
        code, seconds = run_tests(tree, mutation, timeout_s)
    finally:
        path.write_bytes(original)
    # pytest: 1 some test failed (the mutation is caught); 0 all passed (it survived); others:
    # the run itself broke (a test not found, an import error), which proves nothing.
    verdict = {0: "SURVIVED", 1: "caught"}.get(code, f"BROKEN (pytest exit {code})")
    return verdict, seconds


def run_all(chosen: list[Mutation], jobs: int, timeout_s: float) -> int:
    """Each job mutates its own copy of the tree, one mutation at a time, so two mutations never
    meet (the tests of one would see the other); the slowest go first, to end together."""
    order = sorted(chosen, key=lambda m: -m.seconds)
    waiting: queue.SimpleQueue[Mutation] = queue.SimpleQueue()
    for m in order:
        waiting.put(m)
    failed = 0
    lock = threading.Lock()

    def work(tree: Path) -> None:
        nonlocal failed
        while True:
            try:
                m = waiting.get_nowait()
            except queue.Empty:
                return
            verdict, seconds = mutate(tree, m, timeout_s)
            with lock:
                failed += verdict != "caught"
                print(f"{m.name:32} {verdict:10} {seconds:6.1f} s  {m.path}", flush=True)

    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch:
        trees = [copy_tree(Path(scratch) / f"tree-{i}") for i in range(jobs)]
        check_copy(trees[0])
        threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in trees]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print(f"{len(chosen) - failed} of {len(chosen)} mutations caught by their tests")
    return 1 if failed else 0


def share(chosen: list[Mutation], spec: str, parser: argparse.ArgumentParser) -> list[Mutation]:
    part, _, of = spec.partition("/")
    if not of.isdigit() or int(of) < 1 or not (part == "today" or part.isdigit()):
        parser.error(f"--share {spec!r}: expected K/N or today/N")
    n = int(of)
    k = time.gmtime().tm_yday % n if part == "today" else int(part) % n
    picked = [m for i, m in enumerate(chosen) if i % n == k or m.always]
    print(f"share {k}/{n}: {len(picked)} of {len(chosen)} mutations", flush=True)
    return picked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="name every mutation and its tests")
    parser.add_argument("--timeout", type=float, default=300, help="pytest --timeout per test")
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="mutations run at once, each in its own copy of the tree (default: 2, or 1 on 1 CPU)",
    )
    parser.add_argument(
        "--share",
        metavar="K/N",
        help="only every N-th mutation, from the K-th (K 'today': the day's number modulo N, so "
        "the CI runs of N days cover them all); the campaign's fail-every-shard always runs",
    )
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:32} {m.path}  ->  {', '.join(t.split('::')[-1] for t in m.tests)}")
        return 0
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutations: {', '.join(unknown)} (see --list)")
    chosen = [known[n] for n in args.names] if args.names else list(MUTATIONS)
    if args.share:
        chosen = share(chosen, args.share, parser)
    # A SIGTERM (a CI timeout) still removes the copies.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    return run_all(chosen, max(1, min(args.jobs, len(chosen))), args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
