"""`make bench-smoke`: every `arbiter bench` suite at its smallest size, so none falls out of step.

A bench that is only run when someone needs its figures rots: `bench abuse` still expected the 422
that chat's refusals had stopped being, and `bench engine --lora random` needed a package `make
run` does not install. Here each suite runs with ``--smoke`` (its module's ``SMOKE`` sizes) in its
own process, one after another, on the bundled models: the environment's ``ARBITER_*`` settings
are left out and the catalog store is an empty folder, so an installed 1.5B model is never loaded.
`bench all` runs the engine, HTTP and worker suites at their smoke sizes itself, and `make soak`
runs the soak in CI. A suite fails the run when it exits non-zero (it crashed, or a check of the
server's behaviour failed); performance targets are not judged at this size, and the warnings of
figures that cannot be true are printed, not counted.

    python -m bench.smoke [--suites abuse,faults] [--timeout 600]
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

from bench.cli import SUITES
from bench.common import ROOT

# Suites this run leaves to another (so CI runs each once), and which.
RUN_BY = {
    "engine": "bench all",
    "http": "bench all",
    "worker": "bench all",
    "soak": "make soak (CI runs it for 2 minutes)",
}


def _cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run(suite: str, env: dict[str, str], timeout_s: float) -> tuple[int, float, float]:
    """``arbiter bench SUITE --smoke``, its output passed through; (status, seconds, CPU seconds of
    it and the servers it started, a figure the machine's other load does not inflate). A suite
    past ``timeout_s`` is killed with every server it started (its own process group): status 124."""
    started, cpu = time.monotonic(), _cpu_s()
    command = [sys.executable, "-m", "arbiter", "bench", suite, "--smoke"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = 124
    return code, time.monotonic() - started, _cpu_s() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.smoke", description=__doc__)
    parser.add_argument("--suites", default="", help="comma list (default: every suite)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per suite")
    args = parser.parse_args(argv)
    chosen = [s for s in args.suites.split(",") if s] or [s for s in SUITES if s not in RUN_BY]
    unknown = sorted(set(chosen) - set(SUITES))
    if unknown:
        parser.error(f"no such suite: {', '.join(unknown)}")
    results: list[tuple[str, int, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="arbiter-bench-smoke-") as store:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ARBITER_", "SM_"))}
        env["ARBITER_MODEL_STORE"] = store
        for suite in chosen:
            print(f"[bench-smoke] {suite} ...", file=sys.stderr, flush=True)
            results.append((suite, *run(suite, env, args.timeout)))
    for suite in SUITES:
        if suite in RUN_BY and suite not in chosen:
            print(f"[bench-smoke] {suite}: run by {RUN_BY[suite]}")
    for suite, code, seconds, cpu in results:
        status = "ok" if code == 0 else f"FAILED ({code})"
        print(f"[bench-smoke] {suite}: {status} in {seconds:.0f} s ({cpu:.0f} s of CPU)")
    total = sum(seconds for _, _, seconds, _ in results)
    cpu = sum(cpu for *_, cpu in results)
    failed = [suite for suite, code, *_ in results if code != 0]
    print(
        f"[bench-smoke] {len(results) - len(failed)} of {len(results)} suites ok in {total:.0f} s "
        f"({cpu:.0f} s of CPU)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
