"""Calibration as served: a file of what was fitted for one model and prompt, loaded and applied.

`arbiter calibrate` (``evaluation.calibrate``) writes it; catalog models ship one
(``arbiter/data/calibrations/``), bound to the GGUF's sha256 and the prompt profile's sha256, so
their probabilities are calibrated out of the box. It holds:

- the **read policy**'s parameters (``rotation``): the position prior per option count, fitted
  label-free from rotated reads, and the margin under which another order is read;
- **temperatures** per read policy (adaptive, single), question type and option-count bucket,
  fitted by NLL on labeled decisions; a result is softmaxed at the most specific one that exists
  (type and bucket, then type, then any type in that bucket, then the policy's global one) unless
  its request set its own; then the **top-label map** (``toplabel``) makes the leading option's
  probability honest. Neither changes which option leads, so calibration never changes a choice;
- the **abstention** scores of the fit part per policy (``abstention``): thresholds for any error
  budget are derived from them.

A file fitted on another GGUF is refused at start-up; a file fitted with another prompt profile
too, since a profile changes what the logits mean. Files of format v1 (temperatures per type
only) still load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from arbiter.engine.abstention import Abstention
from arbiter.engine.probabilities import softmax
from arbiter.engine.rotation import DEFAULT_MARGIN
from arbiter.engine.toplabel import TopLabel
from arbiter.errors import ModelLoadError
from arbiter.logging import get_logger
from arbiter.models import ResolvedModel
from arbiter.schema import MAX_TEMPERATURE, MIN_TEMPERATURE
from arbiter.settings import EngineSettings

log = get_logger("arbiter.engine")
FORMAT = "arbiter-calibration-v2"
FORMAT_V1 = "arbiter-calibration-v1"
QUESTION_TYPES = ("noul", "choice", "score")
POLICIES = ("adaptive", "single")
# Option-count buckets of the temperatures: position bias and sharpness change with the count.
BUCKETS = ((2, 2), (3, 4), (5, 7), (8, 10**9))


def bucket(n_options: int) -> str:
    for low, high in BUCKETS:
        if low <= n_options <= high:
            return f"{low}" if low == high else (f"{low}-{high}" if high < 10**9 else f"{low}+")
    return "2"


def _temperature(name: str, value: Any, path: Path) -> float:
    # A request's own limits: below 0.01 the scaled logits overflow, above 100 all is uniform.
    usable = isinstance(value, int | float) and not isinstance(value, bool)
    if not usable or not (MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        raise ModelLoadError(
            f"{path}: temperature {name!r} must be a number from {MIN_TEMPERATURE:g} to "
            f"{MAX_TEMPERATURE:g} (got {value!r})"
        )
    return float(value)


@dataclass(frozen=True)
class Temperatures:
    """One policy's fitted temperatures: global, per question type, per type and bucket."""

    global_temperature: float
    by_type: dict[str, float] = field(default_factory=dict)
    by_bucket: dict[str, float] = field(default_factory=dict)  # "choice:3-4", "any:8+"

    def for_decision(self, question_type: str | None, n_options: int, reads: int = 1) -> float:
        """The most specific temperature fitted: by type, bucket and orders read (``r4``: a
        decision averaged over four orders is flatter than one read once, and adaptive rotation
        reads more exactly where the leader is unclear, so each stratum has its own scale), by
        orders read, by type and bucket, by type, by bucket, else the global one."""
        b = bucket(n_options)
        keys = (
            f"{question_type}:{b}:r{reads}",
            f"r{reads}",
            f"{question_type}:{b}",
            question_type,
            f"any:{b}",
        )
        for key in keys:
            if key is None:
                continue
            if key in self.by_bucket:
                return self.by_bucket[key]
            if key in self.by_type:
                return self.by_type[key]
        return self.global_temperature

    def to_dict(self) -> dict[str, Any]:
        return {
            "global": self.global_temperature,
            "by_type": dict(self.by_type),
            "by_bucket": dict(self.by_bucket),
        }

    @classmethod
    def from_dict(cls, raw: Any, path: Path) -> Temperatures:
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: temperatures must be an object")
        by_type = {k: _temperature(k, v, path) for k, v in (raw.get("by_type") or {}).items()}
        unknown = set(by_type) - set(QUESTION_TYPES) - {"multi_label"}
        if unknown:
            raise ModelLoadError(f"{path}: unknown question types {sorted(unknown)}")
        return cls(
            _temperature("global", raw.get("global"), path),
            by_type,
            {k: _temperature(k, v, path) for k, v in (raw.get("by_bucket") or {}).items()},
        )


@dataclass(frozen=True)
class PolicyCalibration:
    temperatures: Temperatures
    abstention: Abstention | None = None
    report: dict[str, Any] = field(default_factory=dict)
    top_label: TopLabel | None = None  # after the temperature (``toplabel``)


@dataclass(frozen=True)
class Calibration:
    """What was fitted for one model and prompt profile."""

    policies: dict[str, PolicyCalibration]
    position_prior: dict[int, np.ndarray] = field(default_factory=dict)
    margin: float = DEFAULT_MARGIN
    model_sha256: str | None = None
    model_file: str | None = None
    profile_sha256: str | None = None
    source: str = "file"  # "file" (ARBITER_CALIBRATION) or "shipped" (a catalog model's)
    extra: dict[str, Any] = field(default_factory=dict)

    def policy(self, name: str) -> PolicyCalibration:
        """The calibration of a read policy (a fixed order count uses the adaptive one's)."""
        return (
            self.policies.get(name)
            or self.policies.get("adaptive")
            or next(iter(self.policies.values()))
        )

    def temperature_for(
        self,
        question_type: str | None,
        n_options: int = 2,
        policy: str = "adaptive",
        reads: int = 1,
    ) -> float:
        return self.policy(policy).temperatures.for_decision(question_type, n_options, reads)

    def probabilities(
        self, logits: list[float], question_type: str | None, policy: str, reads: int = 1
    ) -> tuple[list[float], float]:
        calibration = self.policy(policy)
        temperature = calibration.temperatures.for_decision(question_type, len(logits), reads)
        probs = softmax(logits, temperature).tolist()
        if calibration.top_label is not None:
            probs = calibration.top_label.apply(probs)
        return probs, temperature

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": {"file": self.model_file, "sha256": self.model_sha256},
            "prompt_profile_sha256": self.profile_sha256,
            "order": {
                "margin": self.margin,
                "position_prior": {
                    str(n): [round(float(x), 6) for x in prior]
                    for n, prior in sorted(self.position_prior.items())
                },
            },
            "policies": {
                name: {
                    "temperatures": p.temperatures.to_dict(),
                    "top_label": p.top_label.to_dict() if p.top_label else None,
                    "abstention": p.abstention.to_dict() if p.abstention else None,
                    "report": p.report,
                }
                for name, p in self.policies.items()
            },
            **self.extra,
        }

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: Path, source: str = "file") -> Calibration:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read calibration file {path}: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("format") not in (FORMAT, FORMAT_V1):
            raise ModelLoadError(f"{path} is not an {FORMAT} file (written by `arbiter calibrate`)")
        model = raw.get("model") or {}
        if raw["format"] == FORMAT_V1:
            temps = Temperatures.from_dict(
                {"global": raw.get("global_temperature"), "by_type": raw.get("temperatures")},
                path,
            )
            return cls(
                {"adaptive": PolicyCalibration(temps)},
                model_sha256=model.get("sha256"),
                model_file=model.get("file"),
                profile_sha256=raw.get("prompt_profile_sha256"),
                source=source,
            )
        return cls._load_v2(raw, path, source)

    @classmethod
    def _load_v2(cls, raw: dict[str, Any], path: Path, source: str) -> Calibration:
        order = raw.get("order") or {}
        try:
            prior = {
                int(n): np.asarray(values, dtype=np.float64)
                for n, values in (order.get("position_prior") or {}).items()
            }
            if any(len(v) != n or not np.all(np.isfinite(v)) for n, v in prior.items()):
                raise ValueError("a position prior needs one finite value per position")
            margin = float(order.get("margin", DEFAULT_MARGIN))
            if not 0 <= margin < 1e6:
                raise ValueError(f"margin {margin} is not a non-negative number")
            policies = {}
            for name, body in (raw.get("policies") or {}).items():
                if name not in POLICIES:
                    raise ValueError(f"unknown read policy {name!r} (one of {POLICIES})")
                abstention = body.get("abstention")
                top = body.get("top_label")
                if top is not None and not (
                    isinstance(top.get("a"), int | float)
                    and isinstance(top.get("b"), int | float)
                    and 0 < top["a"] < 100
                    and abs(top["b"]) < 100
                ):
                    raise ValueError(f"top_label needs 0 < a < 100 and |b| < 100, not {top}")
                policies[name] = PolicyCalibration(
                    Temperatures.from_dict(body.get("temperatures"), path),
                    Abstention.from_dict(abstention) if abstention else None,
                    body.get("report") or {},
                    TopLabel(float(top["a"]), float(top["b"])) if top is not None else None,
                )
        except (TypeError, ValueError, AttributeError) as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc
        if not policies:
            raise ModelLoadError(f"{path}: no read policy is calibrated")
        model = raw.get("model") or {}
        return cls(
            policies,
            prior,
            margin,
            model_sha256=model.get("sha256"),
            model_file=model.get("file"),
            profile_sha256=raw.get("prompt_profile_sha256"),
            source=source,
        )

    def check_model(self, sha256: str, file: str, profile_sha256: str | None = None) -> None:
        if self.model_sha256 and self.model_sha256 != sha256:
            raise ModelLoadError(
                f"the calibration file was fitted on {self.model_file} "
                f"(sha256 {self.model_sha256[:12]}…), not on the served {file} "
                f"(sha256 {sha256[:12]}…); refit it with `arbiter calibrate` or unset "
                "ARBITER_CALIBRATION"
            )
        if self.profile_sha256 and profile_sha256 and self.profile_sha256 != profile_sha256:
            raise ModelLoadError(
                f"the calibration file was fitted with another prompt profile (sha256 "
                f"{self.profile_sha256[:12]}…, served: {profile_sha256[:12]}…): a profile changes "
                "what the logits mean; refit it with `arbiter calibrate --profile` or unset "
                "ARBITER_CALIBRATION"
            )


BUDGETS = (0.01, 0.05, 0.1)


def describe(calibration: Calibration | None, policy: str) -> dict[str, Any]:
    """What a client may know of the served calibration (``/v1/models``, `arbiter eval`): its
    source, the read policy and margin, and the abstention threshold of common error budgets."""
    if calibration is None:
        return {"source": None, "order_policy": policy}
    fitted = calibration.policy(policy).abstention
    return {
        "source": calibration.source,
        "order_policy": policy,
        "margin": calibration.margin,
        "position_prior": sorted(calibration.position_prior),
        "top_label": calibration.policy(policy).top_label is not None,
        "abstention": None
        if fitted is None
        else {
            "method": "sgr-clopper-pearson",
            "delta": fitted.delta,
            "fit_items": len(fitted.confidences),
            "thresholds": {str(e): fitted.threshold(e) for e in BUDGETS},
        },
    }


def shipped(sha256: str, profile_sha256: str | None) -> Calibration | None:
    """The calibration a catalog model ships for this GGUF and prompt profile, if any."""
    folder = resources.files("arbiter") / "data" / "calibrations"
    if not folder.is_dir():
        return None
    for entry in folder.iterdir():
        if not entry.name.endswith(".json"):
            continue
        with resources.as_file(entry) as path:
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            model = raw.get("model") or {} if isinstance(raw, dict) else {}
            if model.get("sha256") != sha256 or raw.get("prompt_profile_sha256") != profile_sha256:
                continue
            return Calibration.load(path, source="shipped")
    return None


def load_calibration(
    settings: EngineSettings, sha256: str, resolved: ResolvedModel, profile_sha256: str
) -> Calibration | None:
    """``ARBITER_CALIBRATION`` (refused when fitted on another model or profile), else the one a
    catalog model ships for this GGUF and profile (unless ``ARBITER_SHIPPED_CALIBRATION`` is
    false); a server default error budget without one is refused."""
    calibration: Calibration | None = None
    if settings.calibration is not None:
        calibration = Calibration.load(settings.calibration)
        calibration.check_model(sha256, resolved.path.name, profile_sha256)
    elif settings.shipped_calibration:
        calibration = shipped(sha256, profile_sha256)
    if calibration is not None:  # raw probabilities are the default of any other model
        log.info("calibration", source=calibration.source, order_policy=settings.order_policy)
    if settings.max_error is not None and (
        calibration is None or calibration.policy(settings.order_policy).abstention is None
    ):
        raise ModelLoadError(
            f"ARBITER_MAX_ERROR={settings.max_error} needs a calibration with abstention scores "
            f"for {resolved.path.name} (none is shipped for it or set in ARBITER_CALIBRATION): "
            "fit one with `arbiter calibrate`, or use ARBITER_MIN_CONFIDENCE"
        )
    return calibration
