"""A scored decision finished for its caller: calibrated probabilities, then abstention.

The temperature is the calibration's for the decision's read policy, question type and option
count, unless the request set its own (``calibration``). Abstention holds the calibrated top
probability to the threshold of the decision's error budget (``abstention``) and to its minimum
confidence; a decision's own ``max_error`` / ``min_confidence`` replace the server's defaults
(``ARBITER_MAX_ERROR``, ``ARBITER_MIN_CONFIDENCE``). The result keeps its choice and probabilities
either way and says whether it abstained, and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from arbiter.engine.abstention import abstains
from arbiter.engine.calibration import Calibration
from arbiter.errors import ArbiterError, InvalidDecision
from arbiter.schema import AbstentionInfo, DecisionRequest, DecisionResult
from arbiter.scorer import Outcome


def policy_of(request: DecisionRequest, server_policy: str) -> str:
    """The read policy a decision was read under, as calibrations name them."""
    if request.order_samples == 1:
        return "single"
    if request.order_samples is None:
        return server_policy
    return "adaptive"  # a fixed number of orders: closest to the adaptive reads


@dataclass(frozen=True)
class Finisher:
    calibration: Calibration | None
    server_policy: str = "adaptive"
    max_error: float | None = None
    min_confidence: float | None = None

    def finish(self, request: DecisionRequest, outcome: Outcome) -> Outcome:
        if isinstance(outcome, ArbiterError):
            return outcome
        try:
            return self._finish(request, outcome)
        except ArbiterError as exc:
            return exc

    def _finish(self, request: DecisionRequest, result: DecisionResult) -> DecisionResult:
        policy = policy_of(request, self.server_policy)
        update: dict[str, object] = {}
        confidence = max(result.probabilities)
        if self.calibration is not None:
            probs, temperature = self.calibration.probabilities(
                result.option_logits, request.question_type, policy, result.orders_read
            )
            confidence = max(probs)  # what the abstention scores were fitted on
            if request.temperature is None:
                update.update(
                    probabilities=probs, temperature=temperature, probability_status="calibrated"
                )
        info = self._abstention(request, confidence, policy)
        if info is not None:
            update.update(abstention=info, abstained=abstains(confidence, info.threshold))
        return result.model_copy(update=update) if update else result

    def _abstention(
        self, request: DecisionRequest, confidence: float, policy: str
    ) -> AbstentionInfo | None:
        own = request.max_error is not None or request.min_confidence is not None
        max_error = request.max_error if own else self.max_error
        min_confidence = request.min_confidence if own else self.min_confidence
        if max_error is None and min_confidence is None:
            return None
        threshold = min_confidence
        if max_error is not None:
            fitted = self.calibration.policy(policy).abstention if self.calibration else None
            if fitted is None:
                raise InvalidDecision(
                    f"max_error needs abstention scores fitted for this model ({policy} reads): "
                    "serve it with a calibration from `arbiter calibrate` (ARBITER_CALIBRATION), "
                    "or use min_confidence",
                    param="max_error",
                    code="not_calibrated",
                )
            budget = fitted.threshold(max_error)
            threshold = None if budget is None else max(budget, min_confidence or 0.0)
        rule = "+".join(
            name
            for name, value in (("max_error", max_error), ("min_confidence", min_confidence))
            if value is not None
        )
        return AbstentionInfo(
            rule=rule,
            max_error=max_error,
            min_confidence=min_confidence,
            threshold=threshold,
            confidence=confidence,
        )
