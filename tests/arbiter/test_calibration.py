"""A calibration file: saved and loaded (v2 and v1), refused for another model or profile, found
when a catalog model ships it, and applied by the engine with its reads, temperatures and
abstention; adaptive rotation on the real model reads exactly what single reads would."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from arbiter.engine import Engine, open_engine
from arbiter.engine import calibration as cal
from arbiter.engine.abstention import Abstention
from arbiter.engine.rotation import Read, ReadPolicy, canonical, rounds
from arbiter.errors import InvalidDecision, ModelLoadError
from arbiter.model_store import CATALOG
from arbiter.profiles import DEFAULT_PROFILE, builtin_bytes
from arbiter.schema import DecisionResult
from arbiter.settings import EngineSettings
from tests.fakes import decision

OPTIONS3 = [("access", "Account access and login"), ("billing", "Billing"), ("ship", "Shipping")]


def _ok(outcome: object) -> DecisionResult:
    assert isinstance(outcome, DecisionResult), outcome
    return outcome


def _calibration(
    sha256: str = "ff" * 32,
    profile: str | None = None,
    temps: cal.Temperatures | None = None,
    prior: dict[int, np.ndarray] | None = None,
    abstention: Abstention | None = None,
) -> cal.Calibration:
    temps = temps or cal.Temperatures(2.0, {"noul": 4.0}, {"choice:3-4": 3.0})
    return cal.Calibration(
        {
            "adaptive": cal.PolicyCalibration(temps, abstention),
            "single": cal.PolicyCalibration(temps),
        },
        prior or {},
        margin=1.5,
        model_sha256=sha256,
        model_file="m.gguf",
        profile_sha256=profile,
    )


def test_file_round_trip_and_refusals(tmp_path: Path) -> None:
    prior = {3: np.log(np.array([0.5, 0.3, 0.2]))}
    fitted = Abstention.of([0.9, 0.8, 0.4], [True, True, False])
    path = _calibration(profile="ab" * 32, prior=prior, abstention=fitted).save(tmp_path / "c.json")
    loaded = cal.Calibration.load(path)
    assert loaded.margin == 1.5
    assert loaded.position_prior[3] == pytest.approx(prior[3], abs=1e-6)
    assert loaded.policy("adaptive").abstention == fitted
    assert loaded.temperature_for("choice", 3) == 3.0  # type and bucket
    assert loaded.temperature_for("choice", 6) == 2.0  # no bucket, no type: the global one
    assert loaded.temperature_for("noul", 2) == 4.0
    assert loaded.temperature_for(None, 3) == 2.0
    with pytest.raises(ModelLoadError, match=r"fitted on m\.gguf"):
        loaded.check_model("00" * 32, "other.gguf")
    with pytest.raises(ModelLoadError, match="another prompt profile"):
        loaded.check_model("ff" * 32, "m.gguf", "cd" * 32)
    loaded.check_model("ff" * 32, "m.gguf", "ab" * 32)
    raw = json.loads(path.read_text())
    for bad in (-1, 0, 1e-310, 101, True, "2"):
        raw["policies"]["adaptive"]["temperatures"]["by_type"]["noul"] = bad
        path.write_text(json.dumps(raw))
        with pytest.raises(ModelLoadError, match=r"from 0\.01 to 100"):
            cal.Calibration.load(path)
    raw["policies"]["adaptive"]["temperatures"]["by_type"]["noul"] = 1.0
    raw["order"]["position_prior"]["3"] = [0.1, 0.2]
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="one finite value per position"):
        cal.Calibration.load(path)
    path.write_text("{}")
    with pytest.raises(ModelLoadError, match="arbiter-calibration-v2"):
        cal.Calibration.load(path)


def test_a_version_1_file_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "v1.json"
    path.write_text(
        json.dumps(
            {
                "format": "arbiter-calibration-v1",
                "model": {"file": "m.gguf", "sha256": "ff" * 32},
                "global_temperature": 1.7,
                "temperatures": {"noul": 2.0},
            }
        )
    )
    loaded = cal.Calibration.load(path)
    assert loaded.temperature_for("noul", 2, "single") == 2.0
    assert loaded.temperature_for("choice", 4) == 1.7
    assert loaded.position_prior == {} and loaded.policy("adaptive").abstention is None


def test_engine_applies_calibration(engine: Engine, tmp_path: Path) -> None:
    """Calibrated results: status, temperature per type and bucket, same choice; a request's own
    T wins; the prior corrects each read by position."""
    prior = {3: np.log(np.array([0.6, 0.3, 0.1]))}
    path = _calibration(engine.sha256, engine.profile.sha256, prior=prior).save(tmp_path / "c.json")
    calibrated = open_engine(engine.settings.model_copy(update={"calibration": path}))
    try:
        single = {"order_samples": 1}
        plain = decision("c1", options=OPTIONS3).model_copy(update=single)
        typed = plain.model_copy(update={"id": "c2", "question_type": "noul"})
        own = plain.model_copy(update={"id": "c3", "temperature": 0.5})
        raw = _ok(engine.score([plain])[0])
        got = [_ok(o) for o in calibrated.score([plain, typed, own])]
        r_plain, r_typed, r_own = got
        assert raw.probability_status == "raw"
        assert (r_plain.probability_status, r_plain.temperature) == ("calibrated", 2.0)
        assert (r_typed.probability_status, r_typed.temperature) == ("calibrated", 4.0)
        assert (r_own.probability_status, r_own.temperature) == ("raw", 0.5)
        # The read is corrected by the prior of the position each option sat in.
        assert r_plain.option_logits == pytest.approx(np.array(raw.option_logits) - prior[3])
        z = np.array(r_plain.option_logits)
        expected = np.exp(z / 2.0 - np.max(z / 2.0))
        assert r_plain.probabilities == pytest.approx((expected / expected.sum()).tolist())
        assert len({r.choice for r in got}) == 1  # the temperature never changes a choice
        assert calibrated.calibration_info()["source"] == "file"
    finally:
        calibrated.close()


def test_engine_refuses_a_calibration_for_another_model(engine: Engine, tmp_path: Path) -> None:
    path = _calibration("00" * 32).save(tmp_path / "cal.json")
    with pytest.raises(ModelLoadError, match=r"m\.gguf"):
        open_engine(EngineSettings(**{**engine.settings.model_dump(), "calibration": path}))


def test_a_server_error_budget_needs_abstention_scores(engine: Engine) -> None:
    settings = engine.settings.model_copy(update={"max_error": 0.05, "shipped_calibration": False})
    with pytest.raises(ModelLoadError, match=r"ARBITER_MAX_ERROR=0\.05 needs a calibration"):
        open_engine(settings)


def test_adaptive_reads_are_the_single_reads_of_each_order(engine: Engine) -> None:
    """On the real model, uncalibrated: an unclear decision read adaptively is exactly the mean
    of its canonical order's rounds read alone (the same prefix, each suffix on its own), says
    how many it read and counts their tokens; any other order of its options reads the same
    orders, so it gets the same logits by option id."""
    options = [*OPTIONS3, ("other", "Something else")]
    request = decision("a1", options=options)
    settings = engine.settings.model_copy(
        update={"order_margin": 1e9, "shipped_calibration": False, "order_policy": "adaptive"}
    )
    adaptive = open_engine(settings)
    try:
        assert adaptive.calibration is None
        got = _ok(adaptive.score([request])[0])
        assert got.option_ids == [o for o, _ in options]  # in the request's order
        start = canonical([o for o, _ in options])
        assert start == (0, 1, 3, 2)  # access, billing, other, ship
        reads = []
        for round_ in rounds(4):
            for order in round_:
                given = [request.options[start[i]] for i in order]
                variant = request.model_copy(update={"options": given, "order_samples": 1})
                logits = _ok(adaptive.score([variant])[0]).option_logits
                reads.append(Read(order, np.array(logits), 0.0))
        combined = ReadPolicy().combine(reads)[0]  # in the canonical order
        by_id = {options[start[i]][0]: float(combined[i]) for i in range(4)}
        assert got.orders_read == 4
        assert got.option_logits == pytest.approx([by_id[o] for o in got.option_ids], abs=1e-9)
        alone = _ok(adaptive.score([request.model_copy(update={"order_samples": 1})])[0])
        suffix = alone.prompt.input_tokens - alone.prompt.prefix_tokens
        assert got.prompt.input_tokens == pytest.approx(
            alone.prompt.input_tokens + 3 * suffix, abs=6
        )
        for other in (request.options[::-1], [request.options[i] for i in (2, 0, 3, 1)]):
            back = _ok(adaptive.score([request.model_copy(update={"options": other})])[0])
            again = dict(zip(back.option_ids, back.option_logits, strict=True))
            assert [again[i] for i in got.option_ids] == pytest.approx(got.option_logits, abs=1e-9)
            assert back.choice == got.choice
    finally:
        adaptive.close()


def test_abstention_keeps_the_answer_and_says_why(engine: Engine, tmp_path: Path) -> None:
    fitted = Abstention.of([0.99] * 200 + [0.3] * 50, [True] * 200 + [False] * 50)
    path = _calibration(engine.sha256, engine.profile.sha256, abstention=fitted).save(
        tmp_path / "c.json"
    )
    calibrated = open_engine(engine.settings.model_copy(update={"calibration": path}))
    try:
        budget = decision("b1", options=OPTIONS3).model_copy(update={"max_error": 0.05})
        floor = decision("b2", options=OPTIONS3).model_copy(update={"min_confidence": 0.0})
        r_budget, r_floor = (_ok(o) for o in calibrated.score([budget, floor]))
        threshold = fitted.threshold(0.05)
        assert threshold == pytest.approx(0.99)
        assert r_budget.abstention is not None and r_budget.abstention.threshold == threshold
        assert r_budget.abstained == (max(r_budget.probabilities) < threshold)
        assert r_budget.abstained  # a near-chance model is never that sure
        assert r_budget.choice in {o for o, _ in OPTIONS3}  # the answer is kept
        assert r_floor.abstained is False and r_floor.abstention.rule == "min_confidence"  # type: ignore[union-attr]
        # Without abstention scores, a budget is that decision's error, naming the field.
        other = _ok(engine.score([decision("b3", options=OPTIONS3)])[0])
        missing = engine.score([budget])[0]
        assert isinstance(missing, InvalidDecision) and missing.param == "max_error"
        assert other.abstained is False and other.abstention is None
    finally:
        calibrated.close()


def test_each_catalog_model_ships_its_calibration(engine: Engine) -> None:
    """Each model `arbiter models install` installs ships a calibration for its pinned sha256 and
    the built-in profile (found without loading the model): prior, margin, temperatures and
    abstention scores per read policy, so it serves calibrated out of the box. Another profile or
    another GGUF finds none; the bundled format demo ships none (raw, and it says so)."""
    profile = hashlib.sha256(builtin_bytes(DEFAULT_PROFILE)).hexdigest()
    assert engine.profile.sha256 == profile  # what a catalog model serves with no profile set
    for model in CATALOG:
        found = cal.shipped(model.sha256, profile)
        assert found is not None and found.source == "shipped", model.name
        assert found.model_file == model.file and found.model_sha256 == model.sha256
        assert {2, 3, 4, 5} <= set(found.position_prior)
        for policy in ("adaptive", "single"):
            assert found.policy(policy).abstention is not None, (model.name, policy)
        assert cal.shipped(model.sha256, "00" * 32) is None  # another profile: not this file
    assert cal.shipped("00" * 32, profile) is None
    assert cal.shipped(engine.sha256, profile) is None
