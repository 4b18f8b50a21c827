"""Temperature calibration: fitting recovers a known temperature; the engine applies a file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from arbiter.engine import Engine
from arbiter.engine import calibration as cal
from arbiter.errors import ModelLoadError
from arbiter.schema import DecisionResult
from arbiter.settings import EngineSettings
from evaluation import calibrate as fitting
from evaluation.calibrate import calibrate_records
from tests.conftest import decision


def _synthetic(
    temperature: float, n: int, k: int, seed: int
) -> tuple[list[list[float]], list[int]]:
    """Logits z, labels drawn from softmax(z / temperature): T is the true temperature."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3.0, size=(n, k))
    scaled = logits / temperature
    p = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    labels = [int(rng.choice(k, p=row)) for row in p]
    return logits.tolist(), labels


@pytest.mark.parametrize("true_t", [0.5, 1.0, 2.5])
def test_fit_recovers_a_known_temperature(true_t: float) -> None:
    logits, labels = _synthetic(true_t, 4000, 4, seed=7)
    fitted = fitting.fit_temperature(logits, labels)
    assert fitted == pytest.approx(true_t, rel=0.1)
    # It is the NLL minimum: nudging it either way does not help.
    best = fitting.nll(logits, labels, fitted)
    assert best <= fitting.nll(logits, labels, fitted * 1.05)
    assert best <= fitting.nll(logits, labels, fitted / 1.05)


def test_fit_per_type_and_global_with_ragged_rows() -> None:
    a_logits, a_labels = _synthetic(3.0, 1500, 2, seed=1)
    b_logits, b_labels = _synthetic(0.6, 1500, 5, seed=2)
    global_t, by_type = fitting.fit(
        a_logits + b_logits, a_labels + b_labels, ["noul"] * 1500 + ["choice"] * 1500
    )
    assert by_type["noul"] == pytest.approx(3.0, rel=0.15)
    assert by_type["choice"] == pytest.approx(0.6, rel=0.15)
    assert "score" not in by_type  # no items: the global one is used
    assert 0.6 < global_t < 3.0
    c = cal.Calibration(global_t, by_type)
    assert c.temperature_for("score") == global_t
    assert c.temperature_for(None) == global_t
    assert c.temperature_for("noul") == by_type["noul"]


def test_nll_by_hand() -> None:
    # softmax([0, ln 3]) = [0.25, 0.75]
    assert fitting.nll([[0.0, math.log(3)]], [1], 1.0) == pytest.approx(-math.log(0.75))
    assert fitting.nll([[0.0, math.log(3)]], [0], 1.0) == pytest.approx(-math.log(0.25))


def test_calibrate_records_reports_held_out_before_and_after() -> None:
    logits, labels = _synthetic(2.0, 600, 3, seed=3)
    records = [
        {
            "option_logits": z,
            "label_index": y,
            "question_type": "choice",
            "split": "test" if i % 4 == 0 else "train",
            "model": {"file": "m.gguf", "sha256": "ab" * 32},
            "prompt_version": "v",
        }
        for i, (z, y) in enumerate(zip(logits, labels, strict=True))
    ]
    records.append(
        {"option_logits": None, "label_index": 0, "question_type": "choice", "split": "x"}
    )
    c, summary = calibrate_records(records, holdout_split="test")
    assert summary["held_out_items"] == 150 and summary["fit_items"] == 450
    assert summary["failures"] == 1
    assert c.by_type["choice"] == pytest.approx(2.0, rel=0.2)
    held = summary["held_out"]
    assert held["after"]["nll"] < held["before"]["nll"]
    assert held["after"]["accuracy"] == held["before"]["accuracy"]  # never changes a choice
    assert c.model_sha256 == "ab" * 32


def test_file_round_trip_and_refusals(tmp_path: Path) -> None:
    path = cal.Calibration(1.7, {"noul": 2.0}, "ff" * 32, "m.gguf").save(tmp_path / "c.json")
    loaded = cal.Calibration.load(path)
    assert (loaded.global_temperature, loaded.by_type) == (1.7, {"noul": 2.0})
    with pytest.raises(ModelLoadError, match=r"fitted on m\.gguf"):
        loaded.check_model("00" * 32, "other.gguf")
    raw = json.loads(path.read_text())
    raw["temperatures"]["noul"] = -1
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="positive"):
        cal.Calibration.load(path)
    path.write_text("{}")
    with pytest.raises(ModelLoadError, match="arbiter-calibration-v1"):
        cal.Calibration.load(path)


def test_engine_applies_calibration(engine: Engine, tmp_path: Path) -> None:
    """Calibrated results: status, temperature per type, same choice; a request's own T wins."""
    path = cal.Calibration(2.0, {"noul": 4.0}, engine.sha256, engine.model_info.file).save(
        tmp_path / "cal.json"
    )
    calibrated = Engine(engine.settings.model_copy(update={"calibration": path}))
    try:
        plain = decision("c1")
        typed = plain.model_copy(update={"id": "c2", "question_type": "noul"})
        own = plain.model_copy(update={"id": "c3", "temperature": 0.5})
        raw = engine.score([plain])[0]
        got = calibrated.score([plain, typed, own])
        assert all(isinstance(r, DecisionResult) for r in [raw, *got])
        r_plain, r_typed, r_own = got  # type: ignore[misc]
        assert raw.probability_status == "raw"  # type: ignore[union-attr]
        assert (r_plain.probability_status, r_plain.temperature) == ("calibrated", 2.0)
        assert (r_typed.probability_status, r_typed.temperature) == ("calibrated", 4.0)
        assert (r_own.probability_status, r_own.temperature) == ("raw", 0.5)
        for r in got:
            assert r.choice == raw.choice  # type: ignore[union-attr]
        z = np.array(r_plain.option_logits)
        expected = np.exp(z / 2.0 - np.max(z / 2.0))
        assert r_plain.probabilities == pytest.approx((expected / expected.sum()).tolist())
    finally:
        calibrated.close()


def test_engine_refuses_a_calibration_for_another_model(engine: Engine, tmp_path: Path) -> None:
    path = cal.Calibration(2.0, {}, "00" * 32, "other.gguf").save(tmp_path / "cal.json")
    with pytest.raises(ModelLoadError, match=r"other\.gguf"):
        Engine(EngineSettings(**{**engine.settings.model_dump(), "calibration": path}))
