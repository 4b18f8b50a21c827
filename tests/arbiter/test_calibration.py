"""A calibration file: saved, loaded, refused for another model, applied by the engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from arbiter.engine import Engine
from arbiter.engine import calibration as cal
from arbiter.errors import ModelLoadError
from arbiter.schema import DecisionResult
from arbiter.settings import EngineSettings
from tests.fakes import decision


def test_file_round_trip_and_refusals(tmp_path: Path) -> None:
    path = cal.Calibration(1.7, {"noul": 2.0}, "ff" * 32, "m.gguf").save(tmp_path / "c.json")
    loaded = cal.Calibration.load(path)
    assert (loaded.global_temperature, loaded.by_type) == (1.7, {"noul": 2.0})
    with pytest.raises(ModelLoadError, match=r"fitted on m\.gguf"):
        loaded.check_model("00" * 32, "other.gguf")
    raw = json.loads(path.read_text())
    for bad in (-1, 0, 1e-310, 5e-324, 101, True, "2"):
        raw["temperatures"]["noul"] = bad
        path.write_text(json.dumps(raw))
        with pytest.raises(ModelLoadError, match=r"from 0\.01 to 100"):
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
