"""Abstention under an error budget: the least top probability at which a decision is automated.

An application that automates a decision when its top probability clears a threshold, and sends
the rest to a person, wants the error among the automated ones under a budget (``max_error``). The
threshold is chosen on labeled decisions (the fit part of a calibration) with a finite-sample
guarantee, **selection with guaranteed risk** (SGR; Geifman and El-Yaniv, 2017): candidates are the
fit items' own top probabilities; a binary search looks for the lowest threshold whose one-sided
Clopper-Pearson upper bound on the error among the items it accepts is within the budget, each of
its ``ceil(log2 m)`` tests at confidence ``delta / ceil(log2 m)`` (a union bound). With probability
at least ``1 - delta`` over the draw of the fit items, the error among accepted decisions from the
same distribution is at most ``max_error``.

Why this and not a conformal prediction set: a set guarantees that the right option is *in* it,
which an application that acts on one option cannot use; SGR bounds the error of exactly what it
acts on. Why Clopper-Pearson: it is exact for a binomial count and never below the nominal level
(conservative when few items are accepted, which is when it should be).

Pure functions over plain numbers; the engine applies ``Abstention.threshold`` per decision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

DELTA = 0.05  # the chance that a fitted threshold is worse than its budget


@lru_cache(maxsize=64)
def _log_factorials(n: int) -> np.ndarray:
    """log(k!) for k = 0..n."""
    return np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1, dtype=np.float64)))])


def _log_binom_cdf(k: int, n: int, p: float) -> float:
    """log P(Binomial(n, p) <= k)."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 0.0 if k >= n else -math.inf
    lf = _log_factorials(n)
    i = np.arange(k + 1)
    terms = lf[n] - lf[i] - lf[n - i] + i * math.log(p) + (n - i) * math.log1p(-p)
    return float(np.logaddexp.reduce(terms))


def clopper_pearson_upper(errors: int, n: int, delta: float) -> float:
    """The one-sided ``1 - delta`` Clopper-Pearson upper bound on an error rate seen as
    ``errors`` of ``n`` (1.0 when ``n`` is 0): the ``p`` at which P(Bin(n, p) <= errors) = delta."""
    if n == 0 or errors >= n:
        return 1.0
    lo, hi = errors / n, 1.0
    target = math.log(delta)
    for _ in range(50):
        mid = (lo + hi) / 2
        if _log_binom_cdf(errors, n, mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class Abstention:
    """The fit items' top probabilities (highest first) and whether each decision was right."""

    confidences: tuple[float, ...]
    correct: tuple[bool, ...]
    delta: float = DELTA

    @classmethod
    def of(
        cls, confidences: Sequence[float], correct: Sequence[bool], delta: float = DELTA
    ) -> Abstention:
        pairs = sorted(zip(confidences, correct, strict=True), key=lambda x: -x[0])
        return cls(tuple(float(c) for c, _ in pairs), tuple(bool(h) for _, h in pairs), delta)

    def threshold(self, max_error: float) -> float | None:
        """The least top probability to automate at under ``max_error`` (SGR); None when no
        threshold meets the bound on these items (every decision abstains)."""
        return _threshold(self.confidences, self.correct, self.delta, round(max_error, 6))

    def to_dict(self) -> dict[str, object]:
        return {
            "method": "sgr-clopper-pearson",
            "delta": self.delta,
            "confidences": [round(c, 6) for c in self.confidences],
            "correct": [int(h) for h in self.correct],
        }

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> Abstention:
        confidences = raw.get("confidences")
        correct = raw.get("correct")
        delta = raw.get("delta", DELTA)
        if (
            not isinstance(confidences, list)
            or not isinstance(correct, list)
            or len(confidences) != len(correct)
            or not all(isinstance(c, int | float) and 0 <= c <= 1 for c in confidences)
            or not isinstance(delta, int | float)
            or not 0 < delta < 1
        ):
            raise ValueError("abstention needs confidences in [0, 1], one correct flag each, delta")
        return cls.of([float(c) for c in confidences], [bool(h) for h in correct], float(delta))


@lru_cache(maxsize=256)
def _threshold(
    confidences: tuple[float, ...], correct: tuple[bool, ...], delta: float, max_error: float
) -> float | None:
    m = len(confidences)
    if m == 0:
        return None
    errors_at = [0] * (m + 1)  # errors among the k most confident
    for k, hit in enumerate(correct, start=1):
        errors_at[k] = errors_at[k - 1] + (0 if hit else 1)
    tests = max(1, math.ceil(math.log2(m)))
    level = delta / tests

    def accepted(k: int) -> int:
        """Items accepted at the k-th highest confidence as threshold (ties accepted too)."""
        threshold = confidences[k - 1]
        while k < m and confidences[k] >= threshold:
            k += 1
        return k

    best: float | None = None
    lo, hi = 1, m
    for _ in range(tests):
        if lo > hi:
            break
        mid = (lo + hi + 1) // 2
        n = accepted(mid)
        if clopper_pearson_upper(errors_at[n], n, level) <= max_error:
            best = confidences[mid - 1]
            lo = mid + 1
        else:
            hi = mid - 1
    return best


def abstains(top_probability: float, threshold: float | None) -> bool:
    """Whether a decision abstains at ``threshold`` (None: no threshold met the budget)."""
    return threshold is None or top_probability < threshold
