"""Prepare the carried folder and rehearse the device run here, on a CPU build of the same tree.

The rehearsal is the device run with three substitutions: llama.cpp is built for the CPU (the
same trimmed tree and CMake options, CUDA off); the engine runs in a *device-like* environment (a
fresh venv of the device's Python version holding only packages the device image has, plus the
carried wheels installed by the same command); and there is no GPU leg (the agreement stage
compares two CPU processes instead). Builds, the venv and the generated model are cached under
``~/.cache/arbiter/gpu-check``, keyed by their inputs, so a second rehearsal is quick.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpucheck import build, carry, checks, pipeline, plan, source


def prepare() -> dict[str, object]:
    """Assemble ``.gpu-carry`` and check that the call's files fit; raises if they do not."""
    from arbiter.models import bundled_model

    manifest = carry.assemble(plan.CARRY, bundled_model().path, plan.CACHE / "src")
    size = carry.travel_size(plan.ROOT, plan.DEVICE_CARRY)
    manifest["travel"] = size
    (plan.CARRY / carry.MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    mib = 2**20
    print(
        f"travels: working tree {size['working_tree_bytes'] / mib:.1f} MiB + carried "
        f"{sum(size['carried_bytes'].values()) / mib:.1f} MiB = {size['total_bytes'] / mib:.1f} "
        f"MiB of {size['limit_bytes'] / mib:.0f} MiB (margin {size['margin_bytes'] / mib:.0f} MiB)"
    )
    if not size["fits"]:
        raise SystemExit("gpu-check: what travels is too large for the device call")
    return manifest


def _base_python() -> str:
    """An interpreter of the device's Python version if this machine has one, else this one."""
    major, minor = plan.DEVICE_PYTHON
    name = f"python{major}.{minor}"
    candidates = sorted(
        glob.glob(os.path.expanduser(f"~/.pyenv/versions/{major}.{minor}*/bin/{name}"))
    )
    candidates += [found] if (found := shutil.which(name)) else []
    for candidate in candidates:  # a pyenv shim is on PATH but may not run this version
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    return getattr(sys, "_base_executable", sys.executable)


def device_like_python() -> str:
    """A venv with only the device image's packages that the check uses (cached)."""
    base = _base_python()
    venv = plan.CACHE / "device-venv"
    want = json.dumps([base, *plan.DEVICE_IMAGE_PACKAGES])
    stamp = venv / ".gpu-check"
    python = str(venv / "bin" / "python")
    if stamp.is_file() and stamp.read_text() == want and os.access(python, os.X_OK):
        return python
    subprocess.run([base, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--upgrade", "pip", *plan.DEVICE_IMAGE_PACKAGES],
        check=True,
    )
    stamp.write_text(want)
    return python


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def rehearse(out: Path) -> int:
    prepare()
    tarball = plan.CARRY / carry.SOURCE_NAME
    src = source.extract(tarball, plan.CACHE / "src" / f"src-{source.digest(tarball)}")
    llama_key = _key(source.digest(tarball), *build.cpu_args())
    skeleton_key = source.digest(plan.CARRY / carry.SKELETON_NAME)
    work = plan.CACHE / "rehearse"
    work.mkdir(parents=True, exist_ok=True)
    paths = pipeline.Paths(
        carry=plan.CARRY,
        work=work,
        out=out,
        python=device_like_python(),
        site=work / "site",
        llama=plan.CACHE / f"llama-cpu-{llama_key}",
        gguf_py=carry.gguf_py_dir(src),
        model=plan.CACHE / f"model-{skeleton_key}-{checks.SEED}-{llama_key}.gguf",
    )
    stages = pipeline.Stages("rehearsal", paths, pipeline.REHEARSAL)
    stages.results["machine"] = pipeline.machine(gpu=False)
    stages.stage("wheels", lambda: checks.install_wheels(stages))

    def build_cpu() -> str:
        if (paths.llama / "llama_cpp" / "lib" / "libllama.so").exists():
            return f"cached: {paths.llama}"
        build_dir = work / f"build-{llama_key}"
        times = build.build(src, build_dir, paths.llama, cuda=None, log=out / "build.log")
        shutil.rmtree(build_dir, ignore_errors=True)
        return f"configure {times['configure_s']:.0f} s, build {times['build_s']:.0f} s"

    stages.stage("build", build_cpu)
    checks.run_all(stages)
    failed = stages.failed()
    print((out / "gpu-check.md").read_text())
    print(device_call())
    print("gpu-check --rehearse: " + ("all stages ok" if not failed else f"not ok: {failed}"))
    return 1 if failed else 0


def device_call() -> str:
    """The device tool call that runs the check, as docs/gpu-check.md gives it."""
    return (
        "The device call (once `scripts/gpu-check --prepare` has written .gpu-carry/):\n"
        f"  command:   {plan.DEVICE_COMMAND}\n"
        f"  carry:     {json.dumps(list(plan.DEVICE_CARRY))}\n"
        f"  timeout_s: {plan.DEVICE_TIMEOUT_S}\n"
        f"  results:   $OUT/gpu-check.md, gpu-check.json, tests.log, build.log, pipeline.log"
    )
