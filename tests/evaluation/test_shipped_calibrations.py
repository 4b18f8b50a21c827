"""The calibrations catalog models ship (arbiter/data/calibrations/) are what `arbiter calibrate
--from-reads` fits today from the raw reads kept beside the labeled decisions
(evaluation/data/reads/), so docs/evaluation.md's figures can be reproduced without the model, and
a change to the fit that is not followed by refitting the shipped files is seen here."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from arbiter.cli import main
from tests import ROOT

SHIPPED = sorted((ROOT / "arbiter" / "data" / "calibrations").glob("*.json"))
READS = ROOT / "evaluation" / "data" / "reads"


def _close(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            _close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, int | float) and math.isclose(
            got, want, rel_tol=1e-6, abs_tol=1e-9
        ), (
            where,
            got,
            want,
        )
    else:
        assert got == want, (where, got, want)


def test_each_catalog_model_ships_a_calibration_with_its_reads() -> None:
    assert len(SHIPPED) >= 2
    for path in SHIPPED:
        assert (READS / f"{path.stem}.jsonl").is_file(), path.name


@pytest.mark.parametrize("shipped", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_the_shipped_calibration_is_refitted_from_its_reads(
    shipped: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    want = json.loads(shipped.read_text(encoding="utf-8"))
    out = tmp_path / "refit.json"
    argv = ["calibrate", *want["files"], "--holdout-split", "heldout"]
    argv += ["--from-reads", str(READS / f"{shipped.stem}.jsonl"), "-o", str(out), "--quiet"]
    assert main(argv) == 0
    got = json.loads(out.read_text(encoding="utf-8"))
    for key in ("model", "prompt_profile_sha256", "order", "policies"):
        _close(got[key], want[key], key)
    printed = capsys.readouterr().out
    assert "| adaptive |" in printed  # the held-out table docs/evaluation.md quotes
