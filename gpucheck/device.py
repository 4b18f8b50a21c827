"""The GPU check on the accelerator machine: everything from the carried folder, nothing from a
network; a CUDA build of llama.cpp, then the shared stages (:mod:`gpucheck.checks`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gpucheck import build, carry, checks, plan, report, source
from gpucheck.pipeline import DEVICE, RESERVE_S, Paths, Stages, machine


def run(out: Path) -> int:
    """Run the check on the device; 0 when every stage passed."""
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
    stages = Stages("device", paths, DEVICE)
    stages.results["machine"] = machine(gpu=True)
    stages.results["budget_s"] = DEVICE.budget_s
    stages.stage("wheels", lambda: checks.install_wheels(stages))

    def build_cuda() -> str:
        src = source.extract(paths.carry / carry.SOURCE_NAME, work / "src")
        libs = build.find_cuda()
        times = build.build(
            src,
            work / "build",
            paths.llama,
            cuda=libs,
            log=out / "build.log",
            timeout=stages.left() - RESERVE_S,
        )
        offload = stages.run(
            [paths.python, "-c", "import llama_cpp; print(llama_cpp.llama_supports_gpu_offload())"],
            stages.env(),
        ).stdout.strip()
        if offload != "True":
            raise RuntimeError("the CUDA build reports no GPU offload")
        stages.results["build"] = {**times, "cuda": libs.notes, "cmake_cuda": libs.cmake_args()}
        took = f"configure {times['configure_s']:.0f} s, build {times['build_s']:.0f} s"
        return "; ".join([took, *libs.notes])

    stages.stage("build", build_cuda, min_s=120)
    checks.run_all(stages)
    failed = stages.failed()
    print(report.markdown(stages.results))
    print("gpu-check: " + ("all stages ok" if not failed else f"not ok: {', '.join(failed)}"))
    return 1 if failed else 0
