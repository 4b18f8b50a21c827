"""The floor: what any llama.cpp-based decision server must pay, measured on Arbiter's own context.

A plain prefill of a prompt's tokens with logits at the last position only (no prefix split, no
branch, no cache), and for questions over one state, one prefix prefill followed by each suffix
decoded after it. Benchmarks set the engine's time against these; tests use the plain prefill as
the reference readout. Measurement only: the engine never calls this.
"""

from __future__ import annotations

import time

import numpy as np

from arbiter.engine import Engine
from arbiter.schema import DecisionRequest, DecisionResult


def plain_pass(engine: Engine, tokens: np.ndarray) -> tuple[np.ndarray, float]:
    """One prefill of ``tokens`` in sequence 0, logits at the last position only. Returns the
    full-vocabulary logits (a copy) and the seconds it took."""
    with engine.session() as llama:
        started = time.perf_counter()
        logits = llama.last_logits(tokens, 0)
        return logits, time.perf_counter() - started


def floor_shared(
    engine: Engine, prefix: np.ndarray, suffixes: list[np.ndarray]
) -> tuple[float, float]:
    """One prefix prefill, then each suffix decoded after it (logits at its last token) and
    removed again. Returns (prefix_s, suffixes_s)."""
    n = len(prefix)
    with engine.session() as llama:
        started = time.perf_counter()
        llama.prefill(prefix)
        prefix_s = time.perf_counter() - started
        suffix_s = 0.0
        for suffix in suffixes:
            m = len(suffix)
            want = np.zeros(m, dtype=np.int8)
            want[-1] = 1
            started = time.perf_counter()
            llama.decode(suffix, np.arange(n, n + m, dtype=np.int32), np.zeros(m, np.int32), want)
            suffix_s += time.perf_counter() - started
            llama.remove(0, n)
    return prefix_s, suffix_s


def one_read(outcome: object) -> DecisionResult:
    """A decision that can be set beside its floor: scored, in one read of the given order. By
    default the engine reads more orders while the leader is unclear (four on the bundled model),
    which a floor of one prefill cannot be compared with: the engine bench printed 2.6x the floor."""
    if not isinstance(outcome, DecisionResult):
        raise RuntimeError(f"the engine failed a benchmark decision: {outcome}")
    if outcome.orders_read != 1:
        raise RuntimeError(
            f"the engine read {outcome.orders_read} orders of a decision set beside a floor of one "
            "read: measure it with order_policy 'single' (bench.common.ONE_READ)"
        )
    return outcome


def reference_option_logits(engine: Engine, request: DecisionRequest) -> np.ndarray:
    """Option logits of one decision from a plain prefill of its whole prompt."""
    logits, _ = plain_pass(engine, engine.prompt_tokens(request))
    options, _ = engine.labels.read(logits, len(request.options))
    return options
