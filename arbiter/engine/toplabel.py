"""Top-label recalibration: the leading option's probability mapped to how often it is right.

A temperature shapes the whole probability vector, but one parameter cannot fit every model's
miscalibration: the 1.5B catalog model, sharpened by its fitted T = 0.4, still missed by 0.08 ECE on
its own fit items. Applications threshold the top probability, so that is the number that must be
honest. After the temperature, the top probability ``c`` is mapped by Platt scaling on its log-odds,
``c' = sigmoid(a * logit(c) + b)`` (fitted by log-loss on whether the top option was right; a = 1,
b = 0 is the identity), and the other options share ``1 - c'`` in their proportions. The leading
option stays the leading one (``c'`` is held at least at the second option's share), so the map
never changes a choice.

Pure numpy: `arbiter calibrate` fits it (``fit``), the engine applies it (``TopLabel.apply``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_EPS = 1e-6


def _logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, _EPS, 1 - _EPS)
    return np.asarray(np.log(q) - np.log1p(-q))


@dataclass(frozen=True)
class TopLabel:
    a: float = 1.0
    b: float = 0.0

    def confidence(self, c: float) -> float:
        return float(1 / (1 + math.exp(-(self.a * float(_logit(np.array([c]))[0]) + self.b))))

    def apply(self, probabilities: Sequence[float]) -> list[float]:
        p = np.asarray(probabilities, dtype=np.float64)
        if len(p) < 2:
            return [float(x) for x in p]
        top = int(np.argmax(p))
        c = float(p[top])
        rest = 1.0 - c
        mapped = self.confidence(c)
        second = float(np.max(np.delete(p, top)))
        if rest > 0:
            # The top stays on top: c' >= p2 (1 - c') / rest, i.e. c' >= p2 / (rest + p2).
            mapped = max(mapped, second / (rest + second))
            out = p * ((1.0 - mapped) / rest)
        else:
            out = np.full_like(p, (1.0 - mapped) / (len(p) - 1))
        out[top] = mapped
        return [float(x) for x in out]

    def to_dict(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b}


def fit(confidences: Sequence[float], correct: Sequence[bool], l2: float = 1.0) -> TopLabel:
    """Platt scaling of the top probability's log-odds by Newton's method on the log-loss, with
    an L2 pull of ``l2`` (in items) towards the identity (a = 1, b = 0), so a few items cannot
    move it far."""
    if not len(confidences):
        return TopLabel()
    x = _logit(np.asarray(confidences, dtype=np.float64))
    y = np.asarray(correct, dtype=np.float64)
    features = np.stack([x, np.ones_like(x)], axis=1)
    w = np.array([1.0, 0.0])
    prior = np.array([1.0, 0.0])
    for _ in range(50):
        z = features @ w
        p = 1 / (1 + np.exp(-z))
        grad = features.T @ (p - y) + l2 * (w - prior)
        hess = (features * (p * (1 - p))[:, None]).T @ features + l2 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        w = w - step
        if np.max(np.abs(step)) < 1e-9:
            break
    if not np.all(np.isfinite(w)) or w[0] <= 0:
        return TopLabel()  # a map that reverses confidence is no calibration: keep the identity
    return TopLabel(float(w[0]), float(w[1]))
