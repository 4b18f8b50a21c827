"""Work bounded before it starts and stopped when abandoned, on the real engine.

The floor from bytes refuses what cannot fit without tokenizing it; a request's token and time
budgets are decided before anything is decoded; a cancelled request stops at the next
``llama_decode`` boundary and leaves the context, the KV cache and the prefix cache as a request
that never ran would.
"""

from __future__ import annotations

import math
import threading
import time
import tracemalloc
from typing import Any

import llama_cpp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arbiter.engine import Budget, Engine, SamplingParams, open_engine
from arbiter.engine import llama as llama_module
from arbiter.errors import (
    ContextLengthExceeded,
    RequestCancelled,
    TimeBudgetExceeded,
    TokenBudgetExceeded,
)
from arbiter.schema import DecisionResult
from tests.fakes import decision
from tests.strategies import examples
from tests.threads import TEST_THREADS

MB = 1024 * 1024


def _ok(outcome: DecisionResult | Exception) -> DecisionResult:
    assert isinstance(outcome, DecisionResult), outcome
    return outcome


class Decodes:
    """Counts ``llama_decode`` calls (spied on llama_cpp itself); ``on_call`` runs after each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.on_call: Any = None
        real = llama_cpp.llama_decode

        def spy(ctx: Any, batch: Any) -> int:
            rc = int(real(ctx, batch))
            self.calls += 1
            if self.on_call is not None:
                self.on_call(self.calls)
            return rc

        monkeypatch.setattr(llama_module.llama_cpp, "llama_decode", spy)


def _kv_empty(engine: Engine) -> bool:
    memory = engine.llama._mem
    return all(
        llama_cpp.llama_memory_seq_pos_max(memory, seq) == -1
        for seq in range(engine.llama.n_seq_max)
    )


# -- the floor from bytes --------------------------------------------------------------------------


def test_the_longest_piece_is_measured_over_the_whole_vocabulary(engine: Engine) -> None:
    pieces = [engine.llama.vocab.piece_bytes(t, special=True) for t in range(engine.n_vocab)]
    assert engine.cost.max_piece == max(len(p) for p in pieces) > 1


@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(
        st.sampled_from(["…", " ", "\n", "word ", "😀", "      ", "The ", "ab", "\t", "é", "0"]),
        max_size=300,
    ).map("".join)
    | st.text(max_size=400)
)
def test_the_floor_never_exceeds_the_tokens(engine: Engine, text: str) -> None:
    """The floor is a lower bound for any text, long pieces and whitespace runs included."""
    data = text.encode("utf-8")
    tokens = len(engine.tokenize_content(text))
    assert engine.cost.tokens_at_least(len(data)) <= tokens


def test_a_5_mb_state_is_refused_from_its_bytes_without_tokenizing(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenized: list[int] = []
    tokenize = engine.llama.vocab.tokenize

    def spy(text: str, *, special: bool, after: int | None = None) -> np.ndarray:
        tokenized.append(len(text))
        return tokenize(text, special=special, after=after)

    monkeypatch.setattr(engine.llama.vocab, "tokenize", spy)
    huge = decision("huge", "The printer is on fire. " * (5 * MB // 24))
    outcomes = engine.score([huge, decision("ok")])
    error = outcomes[0]
    assert isinstance(error, ContextLengthExceeded), error
    assert error.param == "state" and "at least" in error.message
    assert str(engine.n_ctx) in error.message
    assert _ok(outcomes[1]).id == "ok"
    assert max(tokenized) < 10_000  # only the short decision's text was tokenized


def test_a_too_long_prompt_is_tokenized_once_and_names_its_largest_part(
    small: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the context, yet under the floor: the diagnosis reuses the count (it used to tokenize
    every field again, under the engine lock)."""
    calls: list[int] = []
    tokenize = small.llama.vocab.tokenize

    def spy(text: str, *, special: bool, after: int | None = None) -> np.ndarray:
        calls.append(len(text))
        return tokenize(text, special=special, after=after)

    monkeypatch.setattr(small.llama.vocab, "tokenize", spy)
    long_state = decision("long", "word " * 400)
    error = small.score([long_state])[0]
    assert isinstance(error, ContextLengthExceeded) and error.param == "state"
    assert "state about" in error.message
    assert len([n for n in calls if n > 1000]) == 1  # the content, once


def test_many_short_options_name_the_options_not_the_state(small: Engine) -> None:
    options = [(f"o{i}", f"Option number {i} of the list") for i in range(26)]
    error = small.score([decision("many", "A short state.", "Which?", options)])[0]
    assert isinstance(error, ContextLengthExceeded)
    assert error.param == "options" and "26 options" in error.message


# -- the budgets -----------------------------------------------------------------------------------


def _independent(n: int, words: int = 40) -> list[Any]:
    return [
        decision(f"d{i}", f"Ticket {i}: " + "the order arrived damaged and late " * (words // 6))
        for i in range(n)
    ]


def test_a_request_over_its_token_budget_is_refused_before_any_decode(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    decodes = Decodes(monkeypatch)
    requests = _independent(8)
    one = engine.prompt_tokens(requests[0])
    with pytest.raises(TokenBudgetExceeded) as refused:
        engine.score(requests, Budget(max_tokens=3 * len(one)))
    assert "ARBITER_MAX_REQUEST_TOKENS" in refused.value.message
    assert refused.value.status == 413
    assert decodes.calls == 0
    # Shared states count their prefix once: 8 questions over one state fit a budget that 8
    # independent decisions do not.
    single = {"order_samples": 1}
    grouped = [
        decision(f"q{i}", requests[0].state, f"Question {i}?").model_copy(update=single)
        for i in range(8)
    ]
    assert all(isinstance(o, DecisionResult) for o in engine.score(grouped, Budget(3 * len(one))))
    # Read adaptively, each may read its other order too: the budget counts that before it
    # starts (the most it may read), so the same budget refuses it, with nothing decoded.
    adaptive = [d.model_copy(update={"order_samples": None}) for d in grouped]
    before = decodes.calls
    with pytest.raises(TokenBudgetExceeded):
        engine.score(adaptive, Budget(3 * len(one)))
    assert decodes.calls == before


def test_the_time_budget_refuses_by_estimate_and_stops_at_a_group(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = _independent(6)
    _ok(engine.score(requests[:1])[0])  # the speed is measured
    assert engine.seconds_per_token is not None
    decodes = Decodes(monkeypatch)
    with pytest.raises(TimeBudgetExceeded, match="ARBITER_MAX_REQUEST_SECONDS"):
        engine.score(requests, Budget(max_seconds=1e-4))
    assert decodes.calls == 0
    # An estimate that fits, then a slow machine: what is past the deadline says so.
    budget = Budget(max_seconds=60.0)

    def run_out(calls: int) -> None:
        if calls == 2:  # the first decision's prefix and branch are decoded
            budget.deadline = time.monotonic() - 1

    decodes.on_call = run_out
    outcomes = engine.score(requests[1:], budget)
    kinds = [type(o).__name__ for o in outcomes]
    assert "DecisionResult" in kinds and "TimeBudgetExceeded" in kinds
    assert kinds.index("TimeBudgetExceeded") == 1
    assert decodes.calls == 2
    assert all(k == "TimeBudgetExceeded" for k in kinds[kinds.index("TimeBudgetExceeded") :])


# -- cancellation ----------------------------------------------------------------------------------


def test_a_cancelled_request_stops_at_the_next_decode_and_leaves_nothing_behind(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = _independent(256)
    probe = decision("probe", "A state no other request uses: the probe.")
    engine.cache.clear()
    before = _ok(engine.score([probe])[0])
    decodes = Decodes(monkeypatch)
    budget = Budget()
    cancelled_at: list[int] = []

    def cancel_after(calls: int) -> None:
        if calls == 7 and not budget.cancel.is_set():  # mid-request, mid-group
            budget.cancel.set()
            cancelled_at.append(calls)

    decodes.on_call = cancel_after
    with pytest.raises(RequestCancelled):
        engine.score(requests, budget)
    assert cancelled_at == [7] and decodes.calls == 7  # no llama_decode began after the flag
    assert _kv_empty(engine)
    decodes.on_call = None
    engine.cache.clear()
    after = _ok(engine.score([probe])[0])
    assert after.option_logits == before.option_logits
    assert after.probabilities == before.probabilities
    # The request cut short stored no partial prefix: its decisions score as if it never ran.
    fourth = _ok(engine.score([requests[3]])[0])
    engine.cache.clear()
    assert fourth.option_logits == _ok(engine.score([requests[3]])[0]).option_logits


def test_a_cancelled_generation_stops_between_decodes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    decodes = Decodes(monkeypatch)
    budget = Budget()
    decodes.on_call = lambda calls: budget.cancel.set() if calls == 3 else None
    tokens = engine.tokenize_content("Tell me a long story about a lighthouse. " * 4)
    with pytest.raises(RequestCancelled):
        engine.generate(
            tokens, max_tokens=64, sampling=SamplingParams(temperature=0), budget=budget
        )
    assert decodes.calls == 3
    assert _kv_empty(engine)


def test_cancelling_from_another_thread_frees_the_engine_within_one_decision(
    engine: Engine,
) -> None:
    requests = _independent(256)
    started = time.perf_counter()
    _ok(engine.score([requests[0]])[0])
    one_decision = time.perf_counter() - started
    budget = Budget()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            engine.score(requests[1:], budget)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(max(0.5, 3 * one_decision))  # a few decisions in
    cancelled = time.perf_counter()
    budget.cancel.set()
    worker.join(timeout=60)
    freed = time.perf_counter() - cancelled
    assert outcome and isinstance(outcome[0], RequestCancelled)
    # The decode in progress finishes (it cannot be interrupted), then nothing else starts.
    assert freed < max(2 * one_decision, 0.25), (freed, one_decision)


# -- the prefix cache keeps the buffer llama.cpp wrote -----------------------------------------


def test_a_saved_prefix_state_is_copied_once(engine: Engine) -> None:
    with engine.session() as llama:
        llama.prefill(engine.tokenize_content("A prefix to save. " * 40))
        tracemalloc.start()
        try:
            state = llama.save(1 << 30)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert state is not None and len(state) > 100_000
        # One buffer of the state's size at the peak (the old code held a ctypes array and the
        # bytes copied from it: 2x).
        assert peak < 1.2 * len(state), (peak, len(state))
        llama.clear()
        assert llama.restore(state)


@pytest.fixture(scope="module")
def small(default_gguf: Any) -> Any:
    from arbiter.settings import EngineSettings

    eng = open_engine(EngineSettings(model=default_gguf, n_ctx=256, n_threads=TEST_THREADS))
    yield eng
    eng.close()


def test_the_request_floor_counts_each_state_once(engine: Engine) -> None:
    cost = engine.cost
    a = decision("a", "x" * 4800, "Q?")
    b = decision("b", "x" * 4800, "Another question?")
    alone = cost.request_floor([a])
    both = cost.request_floor([a, b])
    assert alone >= math.ceil(4800 / cost.max_piece)
    assert both - alone < alone  # the second question does not pay for the state again
    assert both <= sum(len(engine.prompt_tokens(d)) for d in (a, b))


def test_tokenizing_stops_once_a_request_is_over_its_budget(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose floor fits but whose tokens do not is refused after tokenizing about its
    budget, not all of it (a 6 MB body of 256 long prompts took 8 s of tokenizing to refuse)."""
    requests = _independent(40, words=300)
    one = len(engine.prompt_tokens(requests[0]))
    tokenized: list[int] = []
    tokenize = engine.llama.vocab.tokenize

    def spy(text: str, *, special: bool, after: int | None = None) -> np.ndarray:
        tokenized.append(1)
        return tokenize(text, special=special, after=after)

    monkeypatch.setattr(engine.llama.vocab, "tokenize", spy)
    with pytest.raises(TokenBudgetExceeded, match="at least"):
        engine.score(requests, Budget(max_tokens=3 * one))
    assert len(tokenized) <= 2 * 5  # four decisions (prompt and state prefix each), not forty
