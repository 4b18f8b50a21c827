"""Temperature calibration as served: a file of fitted temperatures, loaded and applied.

One temperature per question type (``noul``, ``choice``, ``score``) and a global one, fitted by
`arbiter calibrate` (``evaluation.calibrate``). A result is softmaxed at its type's temperature unless
its request set its own. Dividing by T > 0 never changes which option has the largest logit, so
calibration never changes a choice.

The engine loads a calibration file from ``ARBITER_CALIBRATION``. It is bound to the model: a file
fitted on another GGUF (different sha256) is refused at start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbiter.engine.probabilities import softmax
from arbiter.errors import ArbiterError, ModelLoadError
from arbiter.schema import MAX_TEMPERATURE, MIN_TEMPERATURE, DecisionRequest, DecisionResult

FORMAT = "arbiter-calibration-v1"
QUESTION_TYPES = ("noul", "choice", "score")


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
            # A request's own limits: below 0.01 the scaled logits overflow (1e-310 gave NaN
            # probabilities in the JSON), and above 100 every answer is uniform.
            usable = isinstance(value, int | float) and not isinstance(value, bool)
            if not usable or not (MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
                raise ModelLoadError(
                    f"{path}: temperature {name!r} must be a number from {MIN_TEMPERATURE:g} to "
                    f"{MAX_TEMPERATURE:g} (got {value!r})"
                )
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
