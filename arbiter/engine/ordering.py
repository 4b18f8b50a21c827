"""Order robustness (``order_samples``): score a decision under several option orders, average.

Small models prefer a position (the bundled Gemma base model picks the first option almost always).
A request with ``order_samples: K`` is expanded into K decisions over the same state, each listing
the options in another order: the given order, the reversed order, then seeded shuffles (all distinct;
with n options there are at most n! orders, so K is capped there). They share the state prefix like
any questions about one state. The option logits are aligned by option id and averaged, and the
probabilities, the choice and ``allowed_mass`` are computed from the average. The result names the
number of orders used in ``prompt.version`` (``+order-K``) and ``orders_read``. Each variant's
read is corrected by the model's position prior like any read (``rotation``).

Pure functions: the engine calls ``expand`` before grouping and ``merge`` after scoring.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from arbiter.engine.probabilities import softmax
from arbiter.errors import ArbiterError
from arbiter.schema import (
    MAX_ORDER_SAMPLES,
    DecisionRequest,
    DecisionResult,
    Timing,
)

_MARK = "#order"


def permutations(n: int, k: int, seed: int) -> list[tuple[int, ...]]:
    """``min(k, n!)`` distinct orders of ``n`` options: identity, reversed, then seeded shuffles."""
    identity = tuple(range(n))
    orders = [identity]
    if k >= 2 and n >= 2:
        orders.append(identity[::-1])
    total = 1
    for i in range(2, n + 1):
        total *= i
        if total > MAX_ORDER_SAMPLES:
            break
    want = min(k, total)
    if len(orders) >= want:
        return orders[:want]
    if total <= MAX_ORDER_SAMPLES:  # few options: take the remaining orders in a seeded order
        rest = [p for p in itertools.permutations(identity) if p not in orders]
        picks = np.random.default_rng(seed).permutation(len(rest))
        return orders + [rest[i] for i in picks[: want - len(orders)]]
    rng = np.random.default_rng(seed)
    while len(orders) < want:
        candidate = tuple(int(i) for i in rng.permutation(n))
        if candidate not in orders:
            orders.append(candidate)
    return orders


def _seed(request: DecisionRequest) -> int:
    """Deterministic per decision: the same request always gets the same shuffles."""
    key = json.dumps([request.id, [o.id for o in request.options]]).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


@dataclass(frozen=True)
class Plan:
    """Where each input decision's variants sit in the expanded list, and their orders."""

    slots: list[list[int]]  # per input decision: indices into the expanded list
    orders: list[list[tuple[int, ...]]]  # per input decision: the option order of each variant


def expand(decisions: Sequence[DecisionRequest]) -> tuple[list[DecisionRequest], Plan | None]:
    """The decisions to score. ``None`` as plan when no decision asks for more than one order."""
    if not any((d.order_samples or 1) > 1 for d in decisions):
        return list(decisions), None
    expanded: list[DecisionRequest] = []
    slots: list[list[int]] = []
    orders: list[list[tuple[int, ...]]] = []
    for request in decisions:
        k = request.order_samples or 1
        perms: list[tuple[int, ...]] = (
            permutations(len(request.options), k, _seed(request)) if k > 1 else [()]
        )
        slot = []
        for j, perm in enumerate(perms):
            slot.append(len(expanded))
            if j == 0:
                expanded.append(request)
                continue
            expanded.append(
                request.model_copy(
                    update={
                        "id": f"{request.id}{_MARK}{j}",
                        "options": [request.options[i] for i in perm],
                    }
                )
            )
        slots.append(slot)
        orders.append(perms)
    return expanded, Plan(slots, orders)


def align(request: DecisionRequest, results: Sequence[DecisionResult]) -> np.ndarray:
    """Option logits of each variant, reindexed into the request's option order: (K, n)."""
    ids = [o.id for o in request.options]
    rows = []
    for result in results:
        by_id = dict(zip(result.option_ids, result.option_logits, strict=True))
        rows.append([by_id[i] for i in ids])
    return np.asarray(rows, dtype=np.float64)


def merge_one(
    request: DecisionRequest, results: Sequence[DecisionResult], temperature: float
) -> DecisionResult:
    """One result from the variants of one decision (``results[0]`` in the given order)."""
    first = results[0]
    if len(results) == 1:
        return first
    mean = align(request, results).mean(axis=0)
    probs = softmax(mean, temperature)
    ids = [o.id for o in request.options]
    return first.model_copy(
        update={
            "id": request.id,
            "option_ids": ids,
            "option_logits": [float(x) for x in mean],
            "probabilities": [float(x) for x in probs],
            "choice": ids[int(np.argmax(probs))],
            "allowed_mass": float(np.mean([r.allowed_mass for r in results])),
            "temperature": float(temperature),
            "orders_read": sum(r.orders_read for r in results),
            "prompt": first.prompt.model_copy(
                update={
                    "version": f"{first.prompt.version}+order-{len(results)}",
                    # What the model read: the shared prefix once, each order's own suffix.
                    "input_tokens": first.prompt.prefix_tokens
                    + sum(r.prompt.input_tokens - r.prompt.prefix_tokens for r in results),
                }
            ),
            "timing": _timing(results),
        }
    )


def _timing(results: Sequence[DecisionResult]) -> Timing:
    tokenize = sum(r.timing.tokenize_s for r in results)
    prefill = max(r.timing.prefill_s for r in results)  # variants share one group's prefill
    readout = sum(r.timing.readout_s for r in results)
    return Timing(
        tokenize_s=tokenize,
        prefill_s=prefill,
        readout_s=readout,
        total_s=tokenize + prefill + readout,
    )


def merge(
    decisions: Sequence[DecisionRequest],
    outcomes: Sequence[DecisionResult | ArbiterError],
    plan: Plan | None,
    default_temperature: float,
) -> list[DecisionResult | ArbiterError]:
    """Outcomes in input order; a decision with a failed variant gets that variant's error."""
    if plan is None:
        return list(outcomes)
    merged: list[DecisionResult | ArbiterError] = []
    for request, slot in zip(decisions, plan.slots, strict=True):
        parts = [outcomes[i] for i in slot]
        error = next((p for p in parts if isinstance(p, ArbiterError)), None)
        if error is not None:
            merged.append(error)
            continue
        results = [p for p in parts if isinstance(p, DecisionResult)]
        merged.append(merge_one(request, results, request.temperature or default_temperature))
    return merged
