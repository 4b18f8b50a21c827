"""`arbiter calibrate`'s raw reads (evaluation/reads.py): every order a fit needs, read once, and a
stopped run resumed without reading (or writing) again what it already holds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from arbiter.schema import DecisionRequest
from evaluation.backends import ResultOrError
from evaluation.reads import collect, orders_for
from evaluation.tasks import EvalItem
from tests.fakes import decision


class CountingBackend:
    """Answers every read with raw logits (the option's index) and counts what it was asked."""

    name = "counting"

    def __init__(self) -> None:
        self.asked: list[str] = []

    def decide(self, request: DecisionRequest) -> ResultOrError:
        return self.decide_many([request])[0]

    def decide_many(self, requests: Sequence[DecisionRequest]) -> list[ResultOrError]:
        self.asked += [r.id for r in requests]
        return [
            (
                {
                    "option_logits": [float(i) for i in range(len(r.options))],
                    "allowed_mass": 0.9,
                    "probability_status": "raw",
                    "prompt": {"input_tokens": 50, "prefix_tokens": 30},
                    "model": {"file": "m.gguf"},
                },
                None,
            )
            for r in requests
        ]

    def calibration(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        return None


def _items() -> list[EvalItem]:
    three = [("b", "B"), ("a", "A"), ("c", "C")]
    return [
        EvalItem(f"i{k}", "f.jsonl", decision(f"i{k}", options=three), "a", split="fit")
        for k in range(3)
    ]


def test_each_order_is_read_once_and_a_resumed_run_reads_and_writes_only_what_it_lacks() -> None:
    items = _items()
    backend = CountingBackend()
    written: list[dict[str, Any]] = []
    first = collect(items, backend, progress=False, sink=written.append)
    wanted = len(orders_for(["b", "a", "c"]))
    assert len(backend.asked) == 3 * wanted and len(written) == 3
    assert all(len(r["reads"]) == wanted for r in first)
    assert first[0]["tokens"] == 50 and first[0]["prefix_tokens"] == 30
    # A run stopped after the first item: only the other two are read, and only they written.
    backend.asked.clear()
    written.clear()
    done = {(r["file"], r["id"]): r for r in first[:1]}
    again = collect(items, backend, progress=False, done=done, sink=written.append)
    assert len(backend.asked) == 2 * wanted
    assert [r["id"] for r in written] == ["i1", "i2"]
    assert [r["reads"] for r in again] == [r["reads"] for r in first]
