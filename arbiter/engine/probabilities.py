"""Logits to probabilities, written once: log-sum-exp and the tempered softmax.

The engine's raw results, the merge of option orders, calibrated results and the evaluation's
metrics all use these, so the same logits give the same probabilities everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def logsumexp(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """log(sum(exp(values))) without overflow, over ``axis`` (all values when None)."""
    top = np.max(values, axis=axis, keepdims=True)
    out = top + np.log(np.sum(np.exp(values - top), axis=axis, keepdims=True))
    return np.asarray(np.squeeze(out, axis=axis) if axis is not None else out.reshape(()))


def softmax(logits: np.ndarray | Sequence[float], temperature: float = 1.0) -> np.ndarray:
    """softmax(logits / temperature) in float64. A temperature so small that the scaled logits
    overflow gives non-finite values (no warning): callers that take any temperature check."""
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.asarray(logits, dtype=np.float64) / temperature
        return np.asarray(np.exp(scaled - logsumexp(scaled)))
