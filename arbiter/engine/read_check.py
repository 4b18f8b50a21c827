"""The read check at load: a few built-in decisions scored at start-up, and how much probability
their prompts put on the option labels at the read position (``allowed_mass``), against what the
same weights put there under a plain known-good prompt (``reference_mass``).

A prompt that does not end where the model answers (a reasoning block left open, a header the
model writes first, a template that drops the generation prompt, a space the answer owns) is
silent: the softmax over the labels still sums to one. The label mass is not: a model that answers
at the read position puts most of its probability on the labels, one that is about to write
something else puts less there. How much less depends on the model, so the probes are scored twice
at load: in the served prompt, and in the built-in plain prompt (instruction, content, ``Answer:
The answer is``) on the same weights. The engine reports both (the log's ``read_check`` line,
``/v1/models``, the ``arbiter_read_check_allowed_mass`` gauge) and refuses to start when the
served prompt's median is under ``ARBITER_READ_CHECK_MIN_MASS``, or under
``ARBITER_READ_CHECK_MIN_RATIO`` times the reference (``ARBITER_READ_CHECK=warn`` serves it anyway
with a warning, ``off`` skips the check). Both thresholds are measured (docs/models.md).

The probes fit the profile's labels: questions with a yes and a no answer for a yes/no label pair
(a "Which team?" question over yes/no labels made every model pick the first label), choices
otherwise. A refusal says which cause it saw at the read position of the worst probe: the labels'
case (``Yes`` written where the labels are ``yes``), their spelling (``(A`` or another form of the
label than the one read), or the position (the model writes something else first: its likeliest
tokens there are named). The probes share one state, so it is prefilled once and each question is
a short branch of it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from arbiter.errors import ReadCheckRefused
from arbiter.logging import get_logger
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.scorer import Outcome

log = get_logger("arbiter.engine")

_STATE = (
    "Ticket 4410 from Dana Reyes: I was charged twice for my March invoice. Please refund the "
    "duplicate payment of 49 euros to my card."
)
# (question, options as (id, description), the right option's id)
_CHOICES = (
    (
        "Which team should handle this ticket?",
        [("billing", "Billing and payments"), ("shipping", "Shipping and delivery")],
        "billing",
    ),
    (
        "What does the customer ask for?",
        [("password", "A new password"), ("refund", "A refund of a duplicate payment")],
        "refund",
    ),
    ("Which month's invoice is it about?", [("january", "January"), ("march", "March")], "march"),
)
_YES_NO = (
    ("Was the customer charged twice?", "yes"),
    ("Does the customer ask for a new password?", "no"),
    ("Is the ticket about the March invoice?", "yes"),
)
YES_NO_PAIRS = {("yes", "no"), ("true", "false"), ("y", "n")}


@dataclass(frozen=True)
class Probe:
    request: DecisionRequest
    right: str  # the id of the option a model that read the state picks


def _probe(i: int, question: str, options: Sequence[tuple[str, str]], right: str) -> Probe:
    body = {
        "id": f"read-check-{i}",
        "state": _STATE,
        "question": question,
        "options": [{"id": oid, "description": text} for oid, text in options],
    }
    return Probe(DecisionRequest.model_validate(body), right)


PROBES = tuple(_probe(i, q, options, right) for i, (q, options, right) in enumerate(_CHOICES))


def probes_for(labels: Sequence[str]) -> tuple[Probe, ...]:
    """The probes for a profile whose first two labels are ``labels``: yes/no questions for a
    yes/no pair (its options in the labels' order), the choice questions otherwise."""
    pair = tuple(label.casefold() for label in labels[:2])
    yes_first = pair in YES_NO_PAIRS
    if not yes_first and pair[::-1] not in YES_NO_PAIRS:
        return PROBES
    options = [("yes", "Yes"), ("no", "No")]
    order = options if yes_first else options[::-1]
    return tuple(_probe(i, q, order, right) for i, (q, right) in enumerate(_YES_NO))


# The most likely next tokens at a prompt's read position, as (text, probability).
NextTokens = Callable[[DecisionRequest], list[tuple[str, float]]]
Score = Callable[[Sequence[DecisionRequest]], list[Outcome]]


@dataclass(frozen=True)
class ReadCheck:
    """What the probes measured, and what was done with it."""

    mode: str  # "refuse", "warn" or "off"
    min_allowed_mass: float
    allowed_mass: float | None  # the probes' median (None: not measured)
    masses: tuple[float, ...]
    seconds: float
    min_ratio: float = 0.0
    reference_mass: float | None = None  # the same probes in the plain built-in prompt
    right: float | None = None  # the median probability of each probe's right option
    cause: str | None = None  # what a failed check saw at the worst probe's read position
    next_tokens: tuple[tuple[str, float], ...] = field(default=())

    @property
    def ratio(self) -> float | None:
        if self.allowed_mass is None or not self.reference_mass:
            return None
        return self.allowed_mass / self.reference_mass

    @property
    def passed(self) -> bool:
        if self.allowed_mass is None:
            return True
        ratio = self.ratio
        return self.allowed_mass >= self.min_allowed_mass and (
            ratio is None or ratio >= self.min_ratio
        )

    def to_dict(self) -> dict[str, object]:
        ratio = self.ratio
        return {
            "mode": self.mode,
            "allowed_mass": self.allowed_mass,
            "min_allowed_mass": self.min_allowed_mass,
            "reference_mass": self.reference_mass,
            "ratio": None if ratio is None else round(ratio, 4),
            "min_ratio": self.min_ratio,
            "probes": [round(m, 4) for m in self.masses],
            "right": None if self.right is None else round(self.right, 4),
            "passed": self.passed,
            "cause": self.cause,
            "next_tokens": [[text, round(p, 4)] for text, p in self.next_tokens],
            "seconds": round(self.seconds, 3),
        }


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def diagnose(labels: Sequence[str], next_tokens: Sequence[tuple[str, float]], mass: float) -> str:
    """What the model writes at the read position instead of the labels, as a cause: the labels'
    case, their spelling, or the position (its likeliest tokens)."""
    written = {label.strip(): label for label in labels}
    folded = {label.casefold(): label for label in written}
    case = [
        (t, p)
        for t, p in next_tokens
        if t.strip() not in written and t.strip().casefold() in folded
    ]
    if case and sum(p for _, p in case) > mass:
        shown = ", ".join(repr(t.strip()) for t, _ in case[:2])
        return (
            f"label case: the model writes {shown} where the labels are "
            f"{', '.join(repr(folded[t.strip().casefold()]) for t, _ in case[:2])}; the prompt "
            "profile's labels should be written as the model writes them"
        )
    bare = [(t, p) for t, p in next_tokens if t.strip(" \n\t*()[]{}.:'\"`") in written]
    spelled = [(t, p) for t, p in bare if t.strip() not in written or t.startswith(("\n", "\t"))]
    if spelled and sum(p for _, p in spelled) > mass:
        shown = ", ".join(repr(t) for t, _ in spelled[:2])
        return (
            f"label spelling: the model writes {shown}, a form of a label that is not read; the "
            "prompt profile's labels or answer cue should end where the label itself comes next"
        )
    others = [f"{t!r} {p:.2f}" for t, p in next_tokens if t.strip() not in written]
    top = ", ".join(others[:3])
    return (
        f"position: the model writes something else first (its likeliest next tokens there: "
        f"{top}); the prompt does not end where this model answers"
    )


def refusal(model: str, check: ReadCheck) -> str:
    """One line: what was measured, against what, the cause seen, where to look."""
    against = f"at least {check.min_allowed_mass} is expected"
    if check.reference_mass is not None:
        against = (
            f"the same weights put {check.reference_mass:.3f} there in the plain built-in prompt; "
            f"at least {check.min_ratio} of that, and {check.min_allowed_mass}, is expected"
        )
    return (
        f"refusing to start: {model} puts {check.allowed_mass:.3f} of its probability on the "
        f"option labels where Arbiter reads them (the median of {len(check.masses)} start-up "
        f"probe decisions; {against}). Cause: {check.cause or 'position'}. "
        "`arbiter prompt FILE.jsonl` shows the prompt it reads; a prompt profile "
        "(ARBITER_PROMPT_PROFILE, docs/models.md) sets the format a fine-tune was trained on; "
        "ARBITER_READ_CHECK=warn serves it anyway"
    )


@dataclass(frozen=True)
class Probing:
    """How the engine scores the probes: the served path, the plain reference on the same weights
    (None: the served prompt is that reference, or it cannot be built), and the next tokens at a
    read position (for the cause of a failure)."""

    score: Score
    labels: Sequence[str]  # the labels the probes' options get (the profile's first two)
    reference: Score | None = None
    next_tokens: NextTokens | None = None


def _outcomes(score: Score, probes: Sequence[Probe]) -> list[DecisionResult | None]:
    outcomes = score([p.request for p in probes])
    return [o if isinstance(o, DecisionResult) else None for o in outcomes]


def run(
    model: str,
    probing: Probing,
    mode: str,
    min_allowed_mass: float,
    min_ratio: float = 0.0,
) -> ReadCheck:
    """Score the probes (the engine's own path) and judge their label mass, alone and against
    the reference; ``ReadCheckRefused`` in mode ``refuse`` when it fails."""
    if mode == "off":
        return ReadCheck(mode, min_allowed_mass, None, (), 0.0, min_ratio)
    probes = probes_for(probing.labels)
    started = time.perf_counter()
    results = _outcomes(probing.score, probes)
    reference = _outcomes(probing.reference, probes) if probing.reference else []
    seconds = time.perf_counter() - started
    scored = [(p, r) for p, r in zip(probes, results, strict=True) if r is not None]
    masses = tuple(r.allowed_mass for _, r in scored)
    right = [dict(zip(r.option_ids, r.probabilities, strict=True))[p.right] for p, r in scored]
    check = ReadCheck(
        mode,
        min_allowed_mass,
        _median(masses),
        masses,
        seconds,
        min_ratio,
        _median([r.allowed_mass for r in reference if r is not None]),
        _median(right),
    )
    if not check.passed and probing.next_tokens is not None and scored:
        worst, result = min(scored, key=lambda pair: pair[1].allowed_mass)
        tokens = probing.next_tokens(worst.request)
        cause = diagnose(probing.labels[:2], tokens, result.allowed_mass)
        check = ReadCheck(**{**check.__dict__, "cause": cause, "next_tokens": tuple(tokens)})
    event: dict[str, Any] = {"model": model, **check.to_dict()}
    if check.passed:
        log.info("read_check", **event)
    elif mode == "refuse":
        raise ReadCheckRefused(refusal(model, check))
    else:
        log.warning("read_check", **event, warning=refusal(model, check))
    return check
