"""Temperature calibration: fit on labeled option logits, save, and apply when serving.

Fitting minimizes the mean negative log-likelihood of the labels under softmax(logits / T), one T per
question type (``noul``, ``choice``, ``score``; decisions without a type use the global T) plus one
global T over everything. The search is 1-D over log T: a grid, then a golden-section refinement in
the best grid cell (the NLL is smooth and unimodal in log T for all practical purposes). Dividing by
T > 0 never changes which option has the largest logit, so calibration never changes a choice.

The engine loads a calibration file from ``ARBITER_CALIBRATION``. It is bound to the model: a file
fitted on another GGUF (different sha256) is refused at start-up.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from arbiter.engine.probabilities import softmax
from arbiter.errors import ArbiterError, ModelLoadError
from arbiter.schema import DecisionRequest, DecisionResult

FORMAT = "arbiter-calibration-v1"
QUESTION_TYPES = ("noul", "choice", "score")
LOG_T_RANGE = (math.log(0.02), math.log(50.0))


def _padded(logits: Sequence[Sequence[float]]) -> np.ndarray:
    """Rows of different lengths as one (N, max) array padded with -inf."""
    width = max(len(row) for row in logits)
    out = np.full((len(logits), width), -np.inf)
    for i, row in enumerate(logits):
        out[i, : len(row)] = row
    return out


def nll(
    logits: Sequence[Sequence[float]] | np.ndarray, labels: Sequence[int], temperature: float
) -> float:
    """Mean negative log-likelihood of ``labels`` under softmax(logits / temperature)."""
    z = logits if isinstance(logits, np.ndarray) else _padded(logits)
    scaled = z / temperature
    top = scaled.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(scaled - top).sum(axis=1))
    picked = scaled[np.arange(len(z)), np.asarray(labels)]
    return float(np.mean(lse - picked))


def fit_temperature(
    logits: Sequence[Sequence[float]], labels: Sequence[int], grid: int = 121, iterations: int = 60
) -> float:
    """The temperature minimizing the NLL, searched over log T in ``LOG_T_RANGE``."""
    if not len(logits):
        raise ValueError("no items to fit a temperature on")
    z = _padded(logits)
    y = list(labels)
    points = np.linspace(*LOG_T_RANGE, grid)
    losses = [nll(z, y, math.exp(p)) for p in points]
    best = int(np.argmin(losses))
    lo = points[max(best - 1, 0)]
    hi = points[min(best + 1, grid - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo + (1 - ratio) * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = nll(z, y, math.exp(a)), nll(z, y, math.exp(b))
    for _ in range(iterations):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = lo + (1 - ratio) * (hi - lo)
            fa = nll(z, y, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = nll(z, y, math.exp(b))
    return float(math.exp((lo + hi) / 2))


@dataclass(frozen=True)
class Calibration:
    """Fitted temperatures, and the model they belong to."""

    global_temperature: float
    by_type: dict[str, float] = field(default_factory=dict)
    model_sha256: str | None = None
    model_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def temperature_for(self, question_type: str | None) -> float:
        if question_type is not None and question_type in self.by_type:
            return self.by_type[question_type]
        return self.global_temperature

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": {"file": self.model_file, "sha256": self.model_sha256},
            "global_temperature": self.global_temperature,
            "temperatures": dict(self.by_type),
            **self.extra,
        }

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read calibration file {path}: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ModelLoadError(f"{path} is not an {FORMAT} file (written by `arbiter calibrate`)")
        temps = {"global": raw.get("global_temperature"), **(raw.get("temperatures") or {})}
        for name, value in temps.items():
            if not isinstance(value, int | float) or not (0 < value < math.inf):
                raise ModelLoadError(f"{path}: temperature {name!r} must be a positive number")
        unknown = set(raw.get("temperatures") or {}) - set(QUESTION_TYPES)
        if unknown:
            raise ModelLoadError(f"{path}: unknown question types {sorted(unknown)}")
        model = raw.get("model") or {}
        return cls(
            global_temperature=float(raw["global_temperature"]),
            by_type={k: float(v) for k, v in (raw.get("temperatures") or {}).items()},
            model_sha256=model.get("sha256"),
            model_file=model.get("file"),
        )

    def apply(
        self, request: DecisionRequest, outcome: DecisionResult | ArbiterError
    ) -> DecisionResult | ArbiterError:
        """The result's probabilities at the calibrated temperature, unless the request set its
        own (or it is an error)."""
        if request.temperature is not None or isinstance(outcome, ArbiterError):
            return outcome
        temperature = self.temperature_for(request.question_type)
        return outcome.model_copy(
            update={
                "probabilities": softmax(outcome.option_logits, temperature).tolist(),
                "temperature": temperature,
                "probability_status": "calibrated",
            }
        )

    def check_model(self, sha256: str, file: str) -> None:
        if self.model_sha256 and self.model_sha256 != sha256:
            raise ModelLoadError(
                f"the calibration file was fitted on {self.model_file} "
                f"(sha256 {self.model_sha256[:12]}…), not on the served {file} "
                f"(sha256 {sha256[:12]}…); refit it with `arbiter calibrate` or unset "
                "ARBITER_CALIBRATION"
            )


def fit(
    logits: Sequence[Sequence[float]],
    labels: Sequence[int],
    types: Sequence[str | None],
    min_items: int = 8,
) -> tuple[float, dict[str, float]]:
    """A global temperature, and one per question type that has at least ``min_items`` items."""
    global_t = fit_temperature(logits, labels)
    by_type: dict[str, float] = {}
    for kind in QUESTION_TYPES:
        rows = [i for i, t in enumerate(types) if t == kind]
        if len(rows) >= min_items:
            by_type[kind] = fit_temperature([logits[i] for i in rows], [labels[i] for i in rows])
    return global_t, by_type
