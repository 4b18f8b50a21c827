"""A read policy replayed on recorded reads (``reads``), exactly as the engine would run it.

The engine reads a decision's orders one round at a time (``arbiter.engine.rotation``); given the
reads of every order the policy could ask for, the same functions pick the same orders and combine
them into the same logits, so a policy's accuracy, flip rate and cost are measured for any margin
and prior without reading the model again. ``replay`` runs one item as given or with its options
reversed (what a flip compares).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from arbiter.engine.rotation import Order, Read, ReadPolicy
from evaluation.reads import in_terms_of, reads_of, start_of


@dataclass(frozen=True)
class Replayed:
    """One item under a policy: logits in the item's given option order, orders read, label
    mass, and the read's share of the suffix tokens (for cost)."""

    logits: np.ndarray
    reads: int
    mass: float


def replay(record: dict[str, Any], policy: ReadPolicy, reversed_: bool = False) -> Replayed | None:
    """The item as the engine reads it under ``policy`` (its options reversed with
    ``reversed_``); None when a read the policy asks for was not recorded."""
    available = reads_of(record)
    n = int(record["n"])
    base: Order = tuple(range(n))[::-1] if reversed_ else tuple(range(n))
    start = start_of(record["option_ids"], base, policy.adaptive)

    def read(order: Order) -> Read | None:
        found = available.get(in_terms_of(start, order))
        if found is None:
            return None
        logits, mass = found
        # The label mass is kept as a log-sum-exp of the full vocabulary, as the engine keeps it.
        lse = float(np.log(np.sum(np.exp(logits - logits.max()))) + logits.max())
        return Read(order, logits, lse - math.log(max(mass, 1e-300)))

    first = read(tuple(range(n)))  # the request's first read: its start order
    if first is None:
        return None
    taken = [first]
    while True:
        wanted = policy.next_orders(n, taken)
        if not wanted:
            break
        more = [read(o) for o in wanted]
        if any(r is None for r in more):
            return None
        taken += [r for r in more if r is not None]
    logits, mass = policy.combine(taken)
    # Back into the item's given order: request option q is given option start[q].
    given = np.empty(n)
    given[np.asarray(start)] = logits
    return Replayed(given, len(taken), mass)


def replay_all(
    records: Sequence[dict[str, Any]], policy: ReadPolicy, reversed_: bool = False
) -> list[Replayed | None]:
    return [replay(r, policy, reversed_) if r["reads"] else None for r in records]


def flip_rate(records: Sequence[dict[str, Any]], policy: ReadPolicy) -> tuple[int, int]:
    """(answers that differ between the given and the reversed order, items compared)."""
    flips = compared = 0
    for record in records:
        a, b = replay(record, policy), replay(record, policy, reversed_=True)
        if a is None or b is None:
            continue
        compared += 1
        flips += int(np.argmax(a.logits) != np.argmax(b.logits))
    return flips, compared


def mean_reads(replayed: Sequence[Replayed | None]) -> float:
    got = [r.reads for r in replayed if r is not None]
    return float(np.mean(got)) if got else 0.0


def cost_ratio(records: Sequence[dict[str, Any]], policy: ReadPolicy) -> float | None:
    """What ``policy`` costs against one read per item, in prefilled tokens, as `arbiter bench
    orders` times it (each item cold, the totals divided): an item's state prefix is prefilled
    once, then each order read prefills its own question and options. None without the token
    counts (reads recorded before they were kept)."""
    single = policy_cost = 0.0
    for record in records:
        tokens, prefix = record.get("tokens"), record.get("prefix_tokens")
        got = replay(record, policy) if record["reads"] else None
        if got is None or not tokens or prefix is None:
            if got is not None:
                return None
            continue
        suffix = max(int(tokens) - int(prefix), 1)
        single += int(tokens)
        policy_cost += int(prefix) + got.reads * suffix
    return policy_cost / single if single else None
