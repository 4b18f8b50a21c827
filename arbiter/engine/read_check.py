"""The read check at load: a few built-in decisions scored at start-up, and how much probability
their prompts put on the option labels at the read position (``allowed_mass``).

A prompt that does not end where the model answers (a reasoning block left open, a header the
model writes first, a template that drops the generation prompt) is silent: the softmax over the
labels still sums to one. The label mass is not: a model that answers at the read position puts
most of its probability on the labels, one that is about to write something else puts almost none
there. So the engine scores these probes once at load, reports the median mass (the log's
``read_check`` line, ``/v1/models``, the ``arbiter_read_check_allowed_mass`` gauge), and refuses
to start under ``ARBITER_READ_CHECK_MIN_MASS`` (``ARBITER_READ_CHECK=warn`` serves it anyway with a
warning, ``off`` skips the check). The probes share one state, so it is prefilled once and each
question is a short branch of it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from arbiter.errors import ReadCheckRefused
from arbiter.logging import get_logger
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.scorer import Outcome

log = get_logger("arbiter.engine")

_STATE = (
    "Ticket 4410 from Dana Reyes: I was charged twice for my March invoice. Please refund the "
    "duplicate payment of 49 euros to my card."
)
PROBES = tuple(
    DecisionRequest.model_validate({"id": f"read-check-{i}", "state": _STATE, **body})
    for i, body in enumerate(
        (
            {
                "question": "Which team should handle this ticket?",
                "options": [
                    {"id": "billing", "description": "Billing and payments"},
                    {"id": "shipping", "description": "Shipping and delivery"},
                ],
            },
            {
                "question": "What does the customer ask for?",
                "options": [
                    {"id": "password", "description": "A new password"},
                    {"id": "refund", "description": "A refund of a duplicate payment"},
                ],
            },
            {
                "question": "Which month's invoice is it about?",
                "options": [
                    {"id": "january", "description": "January"},
                    {"id": "march", "description": "March"},
                ],
            },
        )
    )
)


@dataclass(frozen=True)
class ReadCheck:
    """What the probes measured, and what was done with it."""

    mode: str  # "refuse", "warn" or "off"
    min_allowed_mass: float
    allowed_mass: float | None  # the probes' median (None: not measured)
    masses: tuple[float, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        return self.allowed_mass is None or self.allowed_mass >= self.min_allowed_mass

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "allowed_mass": self.allowed_mass,
            "min_allowed_mass": self.min_allowed_mass,
            "probes": [round(m, 4) for m in self.masses],
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
        }


def refusal(model: str, check: ReadCheck) -> str:
    """One line: what was measured, what it means, where to look."""
    return (
        f"refusing to start: {model} puts {check.allowed_mass:.3f} of its probability on the "
        f"option labels where Arbiter reads them (the median of {len(check.masses)} start-up "
        f"probe decisions; at least {check.min_allowed_mass} is expected): the prompt does not "
        "end where this model answers. `arbiter prompt FILE.jsonl` shows the prompt it reads; a "
        "prompt profile (ARBITER_PROMPT_PROFILE, docs/models.md) sets the format a fine-tune was "
        "trained on; ARBITER_READ_CHECK=warn serves it anyway"
    )


def run(
    model: str,
    score: Callable[[Sequence[DecisionRequest]], list[Outcome]],
    max_options: int,
    mode: str,
    min_allowed_mass: float,
) -> ReadCheck:
    """Score the probes with ``score`` (the engine's own path) and judge their label mass;
    ``ReadCheckRefused`` in mode ``refuse`` when it is under ``min_allowed_mass``."""
    if mode == "off":
        return ReadCheck(mode, min_allowed_mass, None, (), 0.0)
    probes = [p for p in PROBES if len(p.options) <= max_options]
    started = time.perf_counter()
    outcomes = score(probes)
    seconds = time.perf_counter() - started
    masses = tuple(o.allowed_mass for o in outcomes if isinstance(o, DecisionResult))
    median = statistics.median(masses) if masses else None
    check = ReadCheck(mode, min_allowed_mass, median, masses, seconds)
    event = {"model": model, **check.to_dict()}
    if check.passed:
        log.info("read_check", **event)
    elif mode == "refuse":
        raise ReadCheckRefused(refusal(model, check))
    else:
        log.warning("read_check", **event, warning=refusal(model, check))
    return check
