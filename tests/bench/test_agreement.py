"""The GPU check's agreement stage (bench/agreement.py), run here as the rehearsal runs it: two
processes' worth of dumps of the same decisions, compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests import ROOT


def test_two_runs_on_the_cpu_agree_and_the_compare_says_so(
    default_gguf: Path, tmp_path: Path
) -> None:
    dumps = [tmp_path / "a.npz", tmp_path / "b.npz"]
    model = ["--model", str(default_gguf), "--long-prompt", "0", "--questions", "2"]
    for target in dumps:
        done = _agreement("dump", str(target), *model)
        assert json.loads(done.stdout.splitlines()[-1])["decisions"] == 4  # 150, 600, 2 questions
    done = _agreement("compare", *map(str, dumps))
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["within_tolerance"] and report["same_choice"] == 1.0
    assert report["max_abs_option_logit"] <= report["tolerance"]


def _agreement(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.agreement", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
