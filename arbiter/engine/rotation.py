"""Adaptive rotation: a decision read in more option orders only while its leader is unclear, each
read corrected by the model's position prior, the reads averaged by option id.

Small models prefer positions: the same options listed in reverse change about one answer in five
on the 1.5B catalog model. Two remedies are combined, both label-free:

- **The position prior** (PriDe, Zheng et al. 2024): a model's preference for label positions,
  measured once per model and option count from reads of every cyclic rotation of the options
  (``position_prior``; `arbiter calibrate` fits it and catalog models ship it). A read's logit at
  position ``q`` is corrected by ``-log prior[q]`` before anything else; a read is then closer to
  what the model thinks of the option than to where it sits.
- **More orders where they matter, from a canonical order**: the first read lists the options in
  their canonical order (``canonical``: by id, numbers as numbers), never the order the request
  gave; while the margin between the two leading options (corrected logits, averaged over the
  orders read) is under ``margin``, the next round of ``rounds`` is read on the same prefilled
  state (the reversed order, then a rotation by half and its reverse). A clear decision costs one
  read; an unclear one up to four suffixes. Every order of the same options reads the same orders,
  so the answer cannot depend on the order the request listed them in.

Everything here depends on one decision's own reads only, never on other traffic or on labels.
Pure functions: the engine's scoring (``scoring``) reads the orders they ask for, and `arbiter
calibrate` simulates the same policy on recorded reads (``evaluation.policy``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from arbiter.engine.probabilities import logsumexp
from arbiter.errors import ArbiterError
from arbiter.schema import DecisionRequest
from arbiter.scorer import Outcome

Order = tuple[int, ...]  # variant position q shows the given option order[q]
# The default margin (corrected logits, the two leaders) under which another round is read, for a
# model without a calibration that names its own (measured: docs/evaluation.md).
DEFAULT_MARGIN = 2.0


def rounds(n: int) -> list[list[Order]]:
    """The orders read for ``n`` options, round by round: the given order; the reversed one; a
    rotation by half and its reverse (from 3 options; with 2, two orders are all there are)."""
    identity = tuple(range(n))
    out: list[list[Order]] = [[identity]]
    if n < 2:
        return out
    out.append([identity[::-1]])
    if n >= 3:
        half = n // 2
        rotated = identity[half:] + identity[:half]
        out.append([rotated, rotated[::-1]])
    return out


@dataclass(frozen=True)
class Read:
    """One order's read: the label logits in the variant's own positions, and the log-sum-exp of
    the full vocabulary there (the label mass is ``exp(logsumexp(logits) - full_lse)``)."""

    order: Order
    logits: np.ndarray
    full_lse: float


def _id_key(option_id: str) -> tuple[int, int, str]:
    return (0, int(option_id), "") if option_id.isdigit() else (1, 0, option_id)


def canonical(option_ids: Sequence[str]) -> Order:
    """The options' canonical order, as an order of the given ones: sorted by id, ids of digits
    by their number (a score's levels keep their order), whatever order they were given in."""
    return tuple(sorted(range(len(option_ids)), key=lambda i: _id_key(option_ids[i])))


@dataclass(frozen=True)
class ReadPolicy:
    """How a decision is read: adaptively from its canonical order (``margin``, ``max_reads``) or
    in its given order only, with the position prior of each option count (log-probabilities,
    ``prior[n][q]``)."""

    adaptive: bool = True
    margin: float = DEFAULT_MARGIN
    max_reads: int = 4
    prior: Mapping[int, np.ndarray] = field(default_factory=dict)

    def corrected(self, read: Read) -> np.ndarray:
        """The read's logits in the given option order, less the prior of the position each
        option sat in."""
        n = len(read.logits)
        bias = self.prior.get(n)
        values = read.logits - bias if bias is not None else read.logits
        out = np.empty(n, dtype=np.float64)
        out[np.asarray(read.order)] = values
        return out

    def combine(self, reads: Sequence[Read]) -> tuple[np.ndarray, float]:
        """The corrected logits averaged over ``reads`` (in the given order), and the mean label
        mass of the reads as read (before any correction)."""
        mean = np.mean([self.corrected(r) for r in reads], axis=0)
        mass = float(np.mean([np.exp(logsumexp(r.logits) - r.full_lse) for r in reads]))
        return mean, mass

    def next_orders(self, n: int, reads: Sequence[Read]) -> list[Order]:
        """The orders to read next for a decision of ``n`` options that has ``reads`` so far;
        none when its leader is clear, its rounds are spent, or the policy is not adaptive."""
        if not self.adaptive or not reads:
            return []
        plan = rounds(n)
        done = len(reads)
        spent = 0
        for index, round_ in enumerate(plan):
            spent += len(round_)
            if spent == done:
                if index + 1 == len(plan) or spent + len(plan[index + 1]) > self.max_reads:
                    return []
                if leader_margin(self.combine(reads)[0]) >= self.margin:
                    return []
                return list(plan[index + 1])
        return []


def leader_margin(logits: np.ndarray) -> float:
    """How far the leading option is ahead of the next one, in logits (inf for one option)."""
    if len(logits) < 2:
        return float("inf")
    top = np.partition(logits, -2)[-2:]
    return float(top[1] - top[0])


def fit_prior(reads_by_item: Sequence[Sequence[Read]], n: int) -> np.ndarray | None:
    """The position prior of ``n`` options from items read in all ``n`` cyclic rotations (PriDe):
    per item, the mean over rotations of the log-softmax at each position (each option sits at
    each position once, so what the options are averages out); then the mean over items,
    normalized to log-probabilities. None when no item has all rotations."""
    cyclic = {tuple((q + s) % n for q in range(n)) for s in range(n)}
    rows = []
    for reads in reads_by_item:
        by_order = {r.order: r for r in reads if len(r.logits) == n}
        if not cyclic <= set(by_order):
            continue
        log_probs = [by_order[o].logits - logsumexp(by_order[o].logits) for o in sorted(cyclic)]
        rows.append(np.mean(log_probs, axis=0))
    if not rows:
        return None
    mean = np.mean(rows, axis=0)
    return np.asarray(mean - logsumexp(mean))


def cyclic_orders(n: int) -> list[Order]:
    """The ``n`` cyclic rotations of the given order (what ``fit_prior`` needs per item)."""
    identity = tuple(range(n))
    return [identity[s:] + identity[:s] for s in range(n)]


def canonical_requests(
    decisions: Sequence[DecisionRequest], policy: ReadPolicy
) -> list[DecisionRequest]:
    """Each decision read adaptively listed in its canonical order (the others as given)."""
    if not policy.adaptive:
        return list(decisions)
    out = []
    for request in decisions:
        if request.order_samples is not None:
            out.append(request)
            continue
        order = canonical([o.id for o in request.options])
        out.append(request.model_copy(update={"options": [request.options[i] for i in order]}))
    return out


def as_given(request: DecisionRequest, outcome: Outcome) -> Outcome:
    """A result read in another order of ``request``'s options, in the request's own order."""
    if isinstance(outcome, ArbiterError):
        return outcome
    ids = [o.id for o in request.options]
    if outcome.option_ids == ids:
        return outcome
    at = {oid: i for i, oid in enumerate(outcome.option_ids)}
    pick = [at[oid] for oid in ids]
    return outcome.model_copy(
        update={
            "option_ids": ids,
            "probabilities": [outcome.probabilities[i] for i in pick],
            "option_logits": [outcome.option_logits[i] for i in pick],
        }
    )
