"""The GPU check's stages that the device and the rehearsal share, after the build: the wheels
installed, the model generated, the engine tests, the engine bench on each device, and the
agreement of two engine processes. Each runs under :class:`~gpucheck.pipeline.Stages`, which times
and records it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

from gpucheck import carry, plan, report, wheels
from gpucheck.pipeline import Stages, json_line

TEST_FILES = (
    "tests/arbiter/test_engine.py",
    "tests/arbiter/test_engine_faults.py",
    "tests/arbiter/test_systemone.py",
)
SEED = 270


def install_wheels(stages: Stages) -> str:
    p = stages.paths
    version = subprocess.run(
        [p.python, "-c", "import sys; print(*sys.version_info[:2])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    chosen = wheels.select(p.carry / carry.WHEELS_DIR, (int(version[0]), int(version[1])))
    if p.site.exists():
        shutil.rmtree(p.site)
    stages.run(wheels.install_command(p.python, chosen, p.site), dict(os.environ))
    return f"{len(chosen)} wheels into {p.site}"


def synthesize(stages: Stages) -> str:
    p = stages.paths
    if p.model.is_file() and p.model.with_suffix(".json").is_file():
        made = json.loads(p.model.with_suffix(".json").read_text())
        made["cached"] = True
    else:
        result = stages.run(
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
            stages.env(),
        )
        made = json_line(result.stdout, "matches_real_tensor_table")
        p.model.with_suffix(".json").write_text(json.dumps(made))
    manifest = json.loads((p.carry / carry.MANIFEST_NAME).read_text())
    made["source"] = manifest["skeleton"]["source"]
    stages.results["model"] = made
    return f"{made['bytes']} bytes, types {made['types']}"


def tests(stages: Stages) -> str:
    gpu = stages.settings.gpu
    log = stages.paths.out / "tests.log"
    env = stages.env(gpu_layers=-1 if gpu else 0)
    env["ARBITER_TEST_MODEL"] = str(stages.paths.model)
    # Random weights put no mass on the labels: the read check at load would refuse them.
    env["ARBITER_READ_CHECK"] = "warn"
    args = [
        stages.paths.python,
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
        stages.run(args, env, log=log, limit=stages.settings.tests_limit_s)
    finally:
        text = log.read_text() if log.exists() else ""
        summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", text, re.MULTILINE)
        stages.results["tests"] = {
            "summary": summary[-1] if summary else "no summary (see tests.log)",
            "where": "every layer on the GPU" if gpu else "CPU build (rehearsal)",
            "files": list(TEST_FILES),
        }
    summary_line: str = stages.results["tests"]["summary"]
    return summary_line


def bench(stages: Stages, leg: str) -> str:
    gpu = leg == "gpu"
    env = stages.env(gpu_layers=-1 if gpu else 0, hide_gpu=not gpu and stages.settings.gpu)
    repeats = stages.settings.repeats
    if stages.left() < 240:  # a slow build left less time than planned: fewer, not none
        repeats = min(repeats, 3 if stages.left() >= 150 else 1)
    result = stages.run(
        [
            stages.paths.python,
            "-m",
            "arbiter",
            "bench",
            "engine",
            "--json",
            "--model",
            str(stages.paths.model),
            "--repeats",
            str(repeats),
            "--long-prompt",
            str(stages.settings.long_prompt),
        ],
        env,
    )
    data = json_line(result.stdout, "single_150")
    data["repeats"] = repeats
    stages.results["bench"][leg] = data
    return ", ".join(
        f"{k} {data[k]['engine_p50_ms']:.1f} ms"
        for k in ("single_150", "single_600", "single_long")
        if k in data
    )


def agreement(stages: Stages) -> str:
    """Two engine processes over the same decisions: CPU first (the reference), then GPU."""
    work, gpu = stages.paths.work, stages.settings.gpu
    legs = (("cpu", 0, gpu), ("gpu", -1, False) if gpu else ("cpu-again", 0, False))
    dumps = []
    for name, layers, hide in legs:
        target = work / f"agreement-{name}.npz"
        stages.run(
            [
                stages.paths.python,
                "-m",
                "bench.agreement",
                "dump",
                str(target),
                "--model",
                str(stages.paths.model),
                "--long-prompt",
                str(stages.settings.long_prompt),
                "--questions",
                str(stages.settings.questions),
            ],
            stages.env(gpu_layers=layers, hide_gpu=hide),
        )
        dumps.append(target)
    result = stages.run(
        [stages.paths.python, "-m", "bench.agreement", "compare", *map(str, dumps)],
        stages.env(),
    )
    data = json_line(result.stdout, "max_abs_option_logit")
    data["legs"] = "GPU vs CPU" if gpu else "CPU vs CPU, two processes (rehearsal)"
    stages.results["agreement"] = data
    if not data["within_tolerance"]:
        raise RuntimeError(f"option logits differ by {data['max_abs_option_logit']:.3f}")
    return f"max |option logit diff| {data['max_abs_option_logit']:.4f}"


def run_all(stages: Stages) -> None:
    """The part the device and the rehearsal share: model, tests, benches, agreement."""
    stages.stage("model", lambda: synthesize(stages), needs=("build", "wheels"), min_s=60)
    stages.stage("tests", lambda: tests(stages), needs=("model",), min_s=90)
    if stages.settings.gpu:
        stages.stage("bench-gpu", lambda: bench(stages, "gpu"), needs=("model",), min_s=60)
    stages.stage("bench-cpu", lambda: bench(stages, "cpu"), needs=("model",), min_s=90)
    stages.stage("agreement", lambda: agreement(stages), needs=("model",), min_s=45)
    for leg, data in stages.results["bench"].items():
        verdict = report.parallel_verdict(data)
        if verdict:
            stages.results.setdefault("parallel_branches", {})[leg] = verdict
    stages.write()
