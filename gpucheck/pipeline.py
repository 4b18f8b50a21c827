"""How the GPU check runs its stages, on the device (CUDA build) or rehearsed here (CPU build).

Each stage is timed and recorded; the results (``gpu-check.json`` and ``gpu-check.md``) are written
again after every stage, so a run stopped at its limit still returns what it measured. A stage
whose inputs failed is skipped, and so is one that would start too close to the deadline. The
engine's own commands run in subprocesses whose ``PYTHONPATH`` holds only the installed wheels,
the built ``llama_cpp``, llama.cpp's gguf-py and this checkout: nothing of this machine's venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucheck import plan, report

RESERVE_S = 15  # kept back from every subprocess's limit, to write the results


@dataclass
class Paths:
    """Where one run keeps its inputs and products."""

    carry: Path
    work: Path
    out: Path
    python: str  # the interpreter that runs the engine (device: its python3)
    site: Path  # the carried wheels, installed
    llama: Path  # holds the built llama_cpp package
    gguf_py: Path
    model: Path


@dataclass
class Settings:
    """What to measure; the device's figures, or smaller ones for the 2-core rehearsal."""

    gpu: bool
    repeats: int  # `bench engine --repeats`, cut down when the deadline comes near
    long_prompt: int  # tokens of the long-prompt row
    questions: int  # questions on one state in the agreement check
    budget_s: float
    tests_limit_s: float = 240  # the engine tests (48; 77-100 s on this shared 2-core machine)


DEVICE = Settings(gpu=True, repeats=5, long_prompt=4000, questions=8, budget_s=plan.DEVICE_BUDGET_S)
# A shared 2-core machine can be several times slower than an idle one: generous limits.
REHEARSAL = Settings(
    gpu=False, repeats=1, long_prompt=1000, questions=2, budget_s=3600, tests_limit_s=1200
)


def json_line(stdout: str, key: str) -> dict[str, Any]:
    """The JSON object printed on a line of its own that has ``key`` (libraries may print too)."""
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict) and key in data:
                return data
    raise RuntimeError(f"no result with {key!r} in the output")


class Stages:
    """Runs stages in order, records them, and rewrites the results after each."""

    def __init__(self, mode: str, paths: Paths, settings: Settings) -> None:
        self.paths = paths
        self.settings = settings
        self.deadline = time.monotonic() + settings.budget_s
        self.results: dict[str, Any] = {"mode": mode, "stages": [], "bench": {}}
        self.ok: set[str] = set()
        paths.out.mkdir(parents=True, exist_ok=True)
        self.log = paths.out / "pipeline.log"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def stage(
        self, name: str, fn: Callable[[], Any], *, needs: tuple[str, ...] = (), min_s: float = 0
    ) -> bool:
        started = time.monotonic()
        missing = [n for n in needs if n not in self.ok]
        note = ""
        if missing:
            status, note = "skipped", f"needs {', '.join(missing)}"
        elif self.left() < min_s:
            status, note = "skipped", f"{self.left():.0f} s left, needs {min_s:.0f}"
        else:
            print(f"== {name} ({self.left():.0f} s left)", flush=True)
            try:
                note = fn() or ""
                status = "ok"
                self.ok.add(name)
            except Exception as exc:  # recorded; the stages that need it are skipped
                status, note = "failed", f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - started
        self.results["stages"].append(
            {"name": name, "status": status, "seconds": round(seconds, 1), "note": str(note)}
        )
        print(f"   {name}: {status} in {seconds:.1f} s {note}"[:400], flush=True)
        self.write()
        return status == "ok"

    def write(self) -> None:
        out = self.paths.out
        (out / "gpu-check.json").write_text(json.dumps(self.results, indent=2) + "\n")
        (out / "gpu-check.md").write_text(report.markdown(self.results))

    # -- subprocesses ------------------------------------------------------------------------------

    def env(self, *, gpu_layers: int = 0, hide_gpu: bool = False) -> dict[str, str]:
        p = self.paths
        env = {k: v for k, v in os.environ.items() if not k.startswith("ARBITER_")}
        env["PYTHONPATH"] = os.pathsep.join(map(str, (p.site, p.llama, p.gguf_py, plan.ROOT)))
        env["ARBITER_N_GPU_LAYERS"] = str(gpu_layers)
        # The model is generated with random weights, which put no mass on the option labels: the
        # read check at load refuses it, and the bench and agreement legs with it.
        env["ARBITER_READ_CHECK"] = "off"
        env["PYTHONUNBUFFERED"] = "1"
        if hide_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def run(
        self, args: list[str], env: dict[str, str], *, log: Path | None = None, limit: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args``; stderr (and stdout with ``log``) appended to a log file; fails on rc."""
        timeout = max(5.0, min(limit, self.left() - RESERVE_S))
        with (log or self.log).open("a") as handle:
            handle.write(f"\n$ {' '.join(args)}\n")
            handle.flush()
            result = subprocess.run(
                args,
                env=env,
                cwd=plan.ROOT,
                stdout=handle if log else subprocess.PIPE,
                stderr=handle,
                text=True,
                timeout=timeout,
            )
        if result.returncode != 0:
            what = " ".join([Path(args[0]).name, *args[1:4]])
            raise RuntimeError(f"{what}... exited {result.returncode}")
        return result

    def failed(self) -> list[str]:
        return [s["name"] for s in self.results["stages"] if s["status"] != "ok"]


# -- the device --------------------------------------------------------------------------------------


def _output(args: list[str]) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(gpu: bool) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "arch": os.uname().machine,
    }
    if gpu:
        info["gpu"] = _output(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        )
        nvcc = _output(["nvcc", "--version"]).splitlines()
        info["nvcc"] = nvcc[-1] if nvcc else ""
    return info
