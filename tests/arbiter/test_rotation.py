"""Adaptive rotation's pure parts: the rounds, when another order is read, the position prior's
correction and fit, and why a reversed request gets the same answer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from arbiter.engine.probabilities import logsumexp
from arbiter.engine.rotation import (
    Read,
    ReadPolicy,
    canonical,
    cyclic_orders,
    fit_prior,
    leader_margin,
    rounds,
)
from evaluation.policy import replay
from evaluation.reads import key, orders_for


def _read(order: tuple[int, ...], logits: list[float]) -> Read:
    z = np.asarray(logits, dtype=np.float64)
    return Read(order, z, float(logsumexp(z)))


def test_rounds_given_reversed_then_half_rotation_and_its_reverse() -> None:
    assert rounds(2) == [[(0, 1)], [(1, 0)]]
    assert rounds(4) == [[(0, 1, 2, 3)], [(3, 2, 1, 0)], [(2, 3, 0, 1), (1, 0, 3, 2)]]
    for n in range(2, 12):
        orders = [o for r in rounds(n) for o in r]
        assert len(set(orders)) == len(orders)  # never the same order twice
        assert all(sorted(o) == list(range(n)) for o in orders)


def test_a_clear_leader_stops_an_unclear_one_reads_on() -> None:
    policy = ReadPolicy(margin=2.0)
    clear = [_read((0, 1, 2), [5.0, 1.0, 0.0])]
    assert policy.next_orders(3, clear) == []
    unclear = [_read((0, 1, 2), [1.0, 0.5, 0.0])]
    assert policy.next_orders(3, unclear) == [(2, 1, 0)]
    two = [*unclear, _read((2, 1, 0), [1.0, 0.5, 0.0])]  # reversed: option 2 leads there
    assert policy.next_orders(3, two) == [(1, 2, 0), (0, 2, 1)]
    four = [*two, _read((1, 2, 0), [0.0, 0.0, 0.0]), _read((0, 2, 1), [0.0, 0.0, 0.0])]
    assert policy.next_orders(3, four) == []  # every round read
    assert ReadPolicy(adaptive=False).next_orders(3, unclear) == []
    assert ReadPolicy(margin=2.0, max_reads=2).next_orders(3, two) == []


def test_reads_are_aligned_by_option_and_corrected_by_position() -> None:
    prior = {3: np.log(np.array([0.5, 0.3, 0.2]))}
    policy = ReadPolicy(prior=prior)
    # The variant lists given options 2, 0, 1: position 0 shows option 2.
    read = _read((2, 0, 1), [3.0, 2.0, 1.0])
    corrected = policy.corrected(read)
    assert corrected == pytest.approx([2.0 - np.log(0.3), 1.0 - np.log(0.2), 3.0 - np.log(0.5)])
    logits, mass = policy.combine([read, _read((0, 1, 2), [0.0, 0.0, 0.0])])
    assert logits == pytest.approx((corrected + (-prior[3])) / 2)
    assert mass == pytest.approx(1.0)  # full_lse of the labels alone


def test_leader_margin() -> None:
    assert leader_margin(np.array([1.0, 4.0, 2.5])) == pytest.approx(1.5)
    assert leader_margin(np.array([3.0])) == float("inf")


@given(
    prior=st.lists(st.floats(-3, 3), min_size=4, max_size=4),
    items=st.lists(st.lists(st.floats(-4, 4), min_size=4, max_size=4), min_size=1, max_size=8),
)
def test_fit_prior_recovers_a_position_bias_whatever_the_options(
    prior: list[float], items: list[list[float]]
) -> None:
    """Reads made as content + position bias: the cyclic average gives the bias back exactly
    (as log-probabilities), whatever the contents."""
    bias = np.asarray(prior)
    reads = []
    for content in items:
        c = np.asarray(content)
        reads.append([_read(o, list(c[list(o)] + bias)) for o in cyclic_orders(4)])
    fitted = fit_prior(reads, 4)
    assert fitted is not None
    expected = bias - logsumexp(bias)
    # The content's share that a cyclic average leaves is the same for every position.
    assert fitted - fitted.mean() == pytest.approx(expected - expected.mean(), abs=1e-6)
    assert fit_prior([r[:2] for r in reads], 4) is None  # rotations missing: no prior


def _record(n: int, content: np.ndarray, bias: np.ndarray, ids: list[str]) -> dict[str, object]:
    reads = {}
    for order in orders_for(ids):
        z = content[list(order)] + bias
        reads[key(order)] = {"logits": z.tolist(), "mass": 1.0}
    return {"n": n, "reads": reads, "option_ids": ids}


@given(
    n=st.integers(2, 10),
    seed=st.integers(0, 2**31),
    margin=st.sampled_from([0.0, 0.5, 3.0, 1e9]),
)
def test_every_order_of_the_options_reads_the_same_orders(n: int, seed: int, margin: float) -> None:
    """Adaptive reads start from the canonical order: the given request and its reversed twin
    (and any other order of the same options) read the same orders, so they get the same logits
    by option, whatever the position bias and wherever the margin stops them."""
    rng = np.random.default_rng(seed)
    ids = [f"opt{int(i)}" for i in rng.permutation(n)]
    record = _record(n, rng.normal(0, 2, n), rng.normal(0, 2, n), ids)
    policy = ReadPolicy(margin=margin)
    a, b = replay(record, policy), replay(record, policy, reversed_=True)
    assert a is not None and b is not None
    assert a.reads == b.reads
    assert 1 <= a.reads <= sum(len(r) for r in rounds(n))
    assert a.logits == pytest.approx(b.logits)
    # Read in the given order alone (the single policy), the bias shows.
    single = ReadPolicy(adaptive=False)
    assert replay(record, single) is not None


def test_canonical_order_by_id_numbers_as_numbers() -> None:
    assert canonical(["b", "a", "c"]) == (1, 0, 2)
    assert canonical(["10", "2", "1", "0"]) == (3, 2, 1, 0)  # a score's levels keep their order
    assert canonical(["true", "false"]) == (1, 0)
