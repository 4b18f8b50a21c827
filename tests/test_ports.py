"""The ports the tests hand to child servers: never where outgoing connections take theirs, never
twice, and each xdist worker in its own slice (a port taken between the pick and the child's bind
failed CI once: `arbiter runtime` could not listen on its stack's port)."""

from __future__ import annotations

import pytest

from tests import ports


def test_ports_come_from_outside_the_ephemeral_range_and_never_twice() -> None:
    low, high = ports._ephemeral()
    given = [ports.free_block(4) for _ in range(50)] + [ports.free_port() for _ in range(50)]
    every = [p for base in given[:50] for p in range(base, base + 4)] + given[50:]
    assert len(set(every)) == len(every)
    assert not [p for p in every if low <= p <= high]


def test_each_xdist_worker_has_a_slice_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(ports._slice()))
    assert all(len(s) > 1000 for s in slices)
    assert not (slices[0] & slices[1]) and not (slices[1] & slices[2])
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert all(ports.free_port() in slices[1] for _ in range(20))
