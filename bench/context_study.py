"""Where a cold decision's time goes, setting by setting, in process (`arbiter bench peers`).

The same prompt tokens are prefilled on contexts that differ from the engine's in one setting each,
and on the context llama.cpp's server makes for ``-np 1`` (one sequence, one output row, no
unified cache, no full sliding-window cache); the engine's own decision (``Engine.score``, the
prefix cache off; and with ``parallel_branches``, which prefills a lone question in one decode)
and its two-decode prefill (the state's prefix, then the rest) run beside them.
Every run takes its turn decision by decision, so the machine's noise falls on all alike, and each
row prints the median of its ratios to the server-shaped context's one-decode prefill.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from arbiter.engine import open_engine
from arbiter.engine.llama import ContextShape, Llama
from arbiter.prompt import state_text
from arbiter.schema import DecisionRequest
from arbiter.settings import EngineSettings
from bench.common import ONE_READ


@dataclass
class Variant:
    """One context: its sequences and shape."""

    name: str
    sequences: int
    shape: ContextShape


def variants(engine_sequences: int, max_branches: int) -> list[Variant]:
    server = ContextShape(unified=False, swa_full=False)
    return [
        Variant("llama-server -np 1 (1 sequence, split, no full SWA)", 1, server),
        Variant(
            f"engine's context ({engine_sequences} sequences)", engine_sequences, ContextShape()
        ),
        Variant(
            f"  ... sized for letters only ({max_branches + 1} sequences)",
            max_branches + 1,
            ContextShape(),
        ),
        Variant("  ... 2 sequences", 2, ContextShape()),
        Variant("  ... swa_full off", engine_sequences, ContextShape(swa_full=False)),
        Variant("  ... 1 sequence", 1, ContextShape()),
    ]


def _one_decode(llama: Llama, prompts: list[np.ndarray], i: int) -> float:
    tokens = prompts[i]
    llama.clear()
    started = time.perf_counter()
    llama.last_logits(tokens, 0)
    return time.perf_counter() - started


def _two_decodes(llama: Llama, prompts: list[np.ndarray], prefixes: list[int], i: int) -> float:
    tokens, prefix = prompts[i], prefixes[i]
    llama.clear()
    started = time.perf_counter()
    llama.prefill(tokens[:prefix])
    llama.last_logits(tokens[prefix:], prefix)
    return time.perf_counter() - started


def study(
    model: Path,
    threads: int,
    n_ctx: int,
    decisions: list[DecisionRequest],
    repeats: int,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Medians of each run's ratio to the server-shaped one-decode prefill, decision by decision."""
    settings = EngineSettings(
        model=model, n_threads=threads, n_ctx=n_ctx, prefix_cache_mb=0, order_policy=ONE_READ
    )
    engine = open_engine(settings)
    contexts: list[tuple[Variant, Llama]] = []
    try:
        tokens = [engine.prompt_tokens(d) for d in decisions]
        prefixes = [
            engine.prompts.shared_prefix(
                state_text(d.state), engine.prompts.layout_for(len(d.options)), [t]
            )
            for d, t in zip(decisions, tokens, strict=True)
        ]
        for variant in variants(engine.llama.n_seq_max, settings.max_branches):
            llama = Llama(engine.resolved.path, settings)
            llama.open_context(settings, variant.sequences, variant.shape)
            contexts.append((variant, llama))
        runs: dict[str, Callable[[int], float]] = {}
        for variant, llama in contexts:
            runs[variant.name] = partial(_one_decode, llama, tokens)
        runs["engine's context, two decodes (prefix, then the rest)"] = partial(
            _two_decodes, contexts[1][1], tokens, prefixes
        )

        def score(i: int) -> float:
            started = time.perf_counter()
            engine.score([decisions[i]])
            return time.perf_counter() - started

        runs["Engine.score (the engine's own decision)"] = score
        one_pass = settings.model_copy(update={"parallel_branches": True})

        def score_one_pass(i: int) -> float:
            engine.settings = one_pass  # read at each call
            try:
                return score(i)
            finally:
                engine.settings = settings

        runs["Engine.score, ARBITER_PARALLEL_BRANCHES (one decode)"] = score_one_pass
        for i in range(min(2, len(decisions))):  # warm-up: every context decodes once
            for run in runs.values():
                run(i)
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        order = list(runs)
        for r in range(repeats):
            for i in range(len(decisions)):
                progress(f"round {r + 1} of {repeats}, decision {i + 1} of {len(decisions)}")
                rotated = order[(i + r) % len(order) :] + order[: (i + r) % len(order)]
                for name in rotated:
                    seconds[name].append(runs[name](i))
    finally:
        for _, llama in contexts:
            llama.close()
        engine.close()
    base = seconds[order[0]]
    return {
        name: {
            "p50_ms": 1000 * statistics.median(values),
            "ratio_median": statistics.median(v / b for v, b in zip(values, base, strict=True)),
            "pairs": [v / b for v, b in zip(values, base, strict=True)],
        }
        for name, values in seconds.items()
    }


def render(rows: dict[str, Any]) -> str:
    lines = []
    for name, row in rows.items():
        lines.append(f"  {name:62s} p50 {row['p50_ms']:8.1f} ms  x{row['ratio_median']:.3f}")
    return "\n".join(lines)
