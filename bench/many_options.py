"""The many-options row of `arbiter bench engine`: codes (27-255 options) against letters, one state.

For each repeat, a fresh ~200-token state (nothing cached) and two questions about it, one with 26
options (letters, one readout position) and one with 60 (codes: the prompt plus one batched decode of
the code prefixes, 6 letters x 2 spellings = 12 branches). Each is timed cold against the floor of
its own prompt tokens (``floor.plain_pass``: one prefill, logits at the last position), interleaved.
The label decode's own time (``timing.readout_s``) is reported as a share of that floor. One 255-option
question (52 branches) is measured the same way once.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from arbiter.engine import Engine
from arbiter.schema import DecisionRequest
from bench import floor

TEAMS = [
    "billing and invoices",
    "single sign-on and login",
    "refunds",
    "shipping and delivery",
    "service outages",
    "security incidents",
    "sales and renewals",
    "hardware repairs",
    "data exports",
    "mobile app",
]


def _question(i: int, state: Any, n: int) -> DecisionRequest:
    return DecisionRequest.model_validate(
        {
            "id": f"m{i}-{n}",
            "state": state,
            "question": "Which team should own this case?",
            "options": [
                {"id": f"t{k}", "description": f"Team {k}: {TEAMS[k % len(TEAMS)]}"}
                for k in range(n)
            ],
        }
    )


def _cold(engine: Engine, request: DecisionRequest) -> dict[str, float]:
    tokens = engine.prompt_tokens(request)
    _, floor_s = floor.plain_pass(engine, tokens)
    engine.cache.clear()
    started = time.perf_counter()
    outcome = engine.score([request])[0]
    elapsed = time.perf_counter() - started
    outcome = floor.one_read(outcome)
    return {
        "tokens": len(tokens),
        "engine_s": elapsed,
        "floor_s": floor_s,
        "readout_s": outcome.timing.readout_s,
    }


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    engine_s = statistics.median(r["engine_s"] for r in runs)
    floor_s = statistics.median(r["floor_s"] for r in runs)
    readout_s = statistics.median(r["readout_s"] for r in runs)
    return {
        "prompt_tokens": runs[-1]["tokens"],
        "engine_p50_ms": 1000 * engine_s,
        "floor_p50_ms": 1000 * floor_s,
        "readout_p50_ms": 1000 * readout_s,
        "ratio": engine_s / floor_s,
        "pairs": [r["engine_s"] / r["floor_s"] for r in runs],
        "readout_share_of_floor": readout_s / floor_s,
    }


def bench_many_options(engine: Engine, repeats: int, state_of: Any) -> dict[str, Any]:
    """``state_of(seed)``: a fresh ~200-token state per repeat (the bench's own generator)."""
    letters, codes = [], []
    for r in range(repeats + 1):
        state = state_of(91_000 + r)
        few, many = _cold(engine, _question(r, state, 26)), _cold(engine, _question(r, state, 60))
        if r:  # the first pair warms up
            letters.append(few)
            codes.append(many)
    biggest = _cold(engine, _question(0, state_of(92_000), 255))
    engine.cache.clear()
    return {
        "options_26": _summary(letters),
        "options_60": _summary(codes),
        "options_255": _summary([biggest]),
    }


def render_rows(report: dict[str, Any]) -> list[str]:
    rows = []
    for n in (26, 60, 255):
        m = report[f"options_{n}"]
        kind = "letters" if n <= 26 else "codes"
        rows.append(
            f"| {n} options ({kind}), {m['prompt_tokens']} tokens | {m['engine_p50_ms']:.0f} ms "
            f"(label read {m['readout_p50_ms']:.0f} ms) | floor {m['floor_p50_ms']:.0f} ms | "
            f"{m['ratio']:.3f} (read {m['readout_share_of_floor']:.3f}) | "
            f"{'<= 1.10' if n <= 26 else 'read a small fraction'} |"
        )
    return rows
