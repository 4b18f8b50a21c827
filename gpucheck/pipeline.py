"""The GPU check's stages, run on the device (CUDA build) or rehearsed here (CPU build).

Each stage is timed and recorded; the results (``gpu-check.json`` and ``gpu-check.md``) are written
again after every stage, so a run stopped at its limit still returns what it measured. A stage
whose inputs failed is skipped, and so is one that would start too close to the deadline. The
engine's own commands run in subprocesses whose ``PYTHONPATH`` holds only the installed wheels,
the built ``llama_cpp``, llama.cpp's gguf-py and this checkout: nothing of this machine's venv.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucheck import build, carry, plan, report, source, wheels

TEST_FILES = (
    "tests/arbiter/test_engine.py",
    "tests/arbiter/test_engine_faults.py",
    "tests/arbiter/test_systemone.py",
)
SEED = 270
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


class Runner:
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
        # read check at load (issue 28) refuses it, and the bench and agreement legs with it.
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

    # -- stages shared by the device and the rehearsal ---------------------------------------------

    def install_wheels(self) -> str:
        p = self.paths
        version = subprocess.run(
            [p.python, "-c", "import sys; print(*sys.version_info[:2])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        chosen = wheels.select(p.carry / carry.WHEELS_DIR, (int(version[0]), int(version[1])))
        if p.site.exists():
            shutil.rmtree(p.site)
        self.run(wheels.install_command(p.python, chosen, p.site), dict(os.environ))
        return f"{len(chosen)} wheels into {p.site}"

    def synthesize(self) -> str:
        p = self.paths
        if p.model.is_file() and p.model.with_suffix(".json").is_file():
            made = json.loads(p.model.with_suffix(".json").read_text())
            made["cached"] = True
        else:
            result = self.run(
                [
                    p.python,
                    "-m",
                    "gpucheck.synth",
                    str(p.carry / carry.SKELETON_NAME),
                    str(p.model),
                    "--seed",
                    str(SEED),
                    "--threads",
                    str(os.cpu_count() or 2),
                ],
                self.env(),
            )
            made = json_line(result.stdout, "matches_real_tensor_table")
            p.model.with_suffix(".json").write_text(json.dumps(made))
        manifest = json.loads((p.carry / carry.MANIFEST_NAME).read_text())
        made["source"] = manifest["skeleton"]["source"]
        self.results["model"] = made
        return f"{made['bytes']} bytes, types {made['types']}"

    def tests(self) -> str:
        gpu = self.settings.gpu
        log = self.paths.out / "tests.log"
        env = self.env(gpu_layers=-1 if gpu else 0)
        env["ARBITER_TEST_MODEL"] = str(self.paths.model)
        # Random weights put no mass on the labels: the read check at load would refuse them.
        env["ARBITER_READ_CHECK"] = "warn"
        args = [
            self.paths.python,
            "-m",
            "pytest",
            "-c",
            str(plan.ROOT / "gpucheck" / "pytest.ini"),
            "--rootdir",
            str(plan.ROOT),
            "-q",
            "-rfE",
            *TEST_FILES,
        ]
        try:
            self.run(args, env, log=log, limit=self.settings.tests_limit_s)
        finally:
            text = log.read_text() if log.exists() else ""
            summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", text, re.MULTILINE)
            self.results["tests"] = {
                "summary": summary[-1] if summary else "no summary (see tests.log)",
                "where": "every layer on the GPU" if gpu else "CPU build (rehearsal)",
                "files": list(TEST_FILES),
            }
        summary_line: str = self.results["tests"]["summary"]
        return summary_line

    def bench(self, leg: str) -> str:
        gpu = leg == "gpu"
        env = self.env(gpu_layers=-1 if gpu else 0, hide_gpu=not gpu and self.settings.gpu)
        repeats = self.settings.repeats
        if self.left() < 240:  # a slow build left less time than planned: fewer, not none
            repeats = min(repeats, 3 if self.left() >= 150 else 1)
        result = self.run(
            [
                self.paths.python,
                "-m",
                "arbiter",
                "bench",
                "engine",
                "--json",
                "--model",
                str(self.paths.model),
                "--repeats",
                str(repeats),
                "--long-prompt",
                str(self.settings.long_prompt),
            ],
            env,
        )
        data = json_line(result.stdout, "single_150")
        data["repeats"] = repeats
        self.results["bench"][leg] = data
        return ", ".join(
            f"{k} {data[k]['engine_p50_ms']:.1f} ms"
            for k in ("single_150", "single_600", "single_long")
            if k in data
        )

    def agreement(self) -> str:
        """Two engine processes over the same decisions: CPU first (the reference), then GPU."""
        work, gpu = self.paths.work, self.settings.gpu
        legs = (("cpu", 0, gpu), ("gpu", -1, False) if gpu else ("cpu-again", 0, False))
        dumps = []
        for name, layers, hide in legs:
            target = work / f"agreement-{name}.npz"
            self.run(
                [
                    self.paths.python,
                    "-m",
                    "bench.agreement",
                    "dump",
                    str(target),
                    "--model",
                    str(self.paths.model),
                    "--long-prompt",
                    str(self.settings.long_prompt),
                    "--questions",
                    str(self.settings.questions),
                ],
                self.env(gpu_layers=layers, hide_gpu=hide),
            )
            dumps.append(target)
        result = self.run(
            [self.paths.python, "-m", "bench.agreement", "compare", *map(str, dumps)],
            self.env(),
        )
        data = json_line(result.stdout, "max_abs_option_logit")
        data["legs"] = "GPU vs CPU" if gpu else "CPU vs CPU, two processes (rehearsal)"
        self.results["agreement"] = data
        if not data["within_tolerance"]:
            raise RuntimeError(f"option logits differ by {data['max_abs_option_logit']:.3f}")
        return f"max |option logit diff| {data['max_abs_option_logit']:.4f}"

    def checks(self) -> None:
        """The part the device and the rehearsal share: model, tests, benches, agreement."""
        self.stage("model", self.synthesize, needs=("build", "wheels"), min_s=60)
        self.stage("tests", self.tests, needs=("model",), min_s=90)
        if self.settings.gpu:
            self.stage("bench-gpu", lambda: self.bench("gpu"), needs=("model",), min_s=60)
        self.stage("bench-cpu", lambda: self.bench("cpu"), needs=("model",), min_s=90)
        self.stage("agreement", self.agreement, needs=("model",), min_s=45)
        for leg, data in self.results["bench"].items():
            verdict = report.parallel_verdict(data)
            if verdict:
                self.results.setdefault("parallel_branches", {})[leg] = verdict
        self.write()

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


def device(out: Path) -> int:
    """On the accelerator machine: everything from the carried folder, nothing from a network."""
    work = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu-check"))
    paths = Paths(
        carry=plan.CARRY,
        work=work,
        out=out,
        python=sys.executable,
        site=work / "site",
        llama=work / "llama",
        gguf_py=work / "src" / "llama-src" / "vendor" / "llama.cpp" / "gguf-py",
        model=work / "model.gguf",
    )
    runner = Runner("device", paths, DEVICE)
    runner.results["machine"] = machine(gpu=True)
    runner.results["budget_s"] = DEVICE.budget_s
    runner.stage("wheels", runner.install_wheels)

    def build_cuda() -> str:
        src = source.extract(paths.carry / carry.SOURCE_NAME, work / "src")
        libs = build.find_cuda()
        times = build.build(
            src,
            work / "build",
            paths.llama,
            cuda=libs,
            log=out / "build.log",
            timeout=runner.left() - RESERVE_S,
        )
        offload = runner.run(
            [paths.python, "-c", "import llama_cpp; print(llama_cpp.llama_supports_gpu_offload())"],
            runner.env(),
        ).stdout.strip()
        if offload != "True":
            raise RuntimeError("the CUDA build reports no GPU offload")
        runner.results["build"] = {**times, "cuda": libs.notes, "cmake_cuda": libs.cmake_args()}
        took = f"configure {times['configure_s']:.0f} s, build {times['build_s']:.0f} s"
        return "; ".join([took, *libs.notes])

    runner.stage("build", build_cuda, min_s=120)
    runner.checks()
    failed = runner.failed()
    print(report.markdown(runner.results))
    print("gpu-check: " + ("all stages ok" if not failed else f"not ok: {', '.join(failed)}"))
    return 1 if failed else 0
