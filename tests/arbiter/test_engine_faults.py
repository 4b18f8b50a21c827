"""The engine under hostile input and faults: no crash, no cross-talk, one error per bad decision.

Checks that would abort the interpreter on a regression (llama.cpp throwing across ctypes, a freed
context) run in a child process, so a failure is reported instead of killing the test session.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from arbiter.engine import Engine, backends, open_engine
from arbiter.engine.prefix_cache import PrefixCache
from arbiter.errors import ContextLengthExceeded, EngineFailure, InvalidDecision
from arbiter.schema import DecisionRequest, DecisionResult, Option
from arbiter.settings import EngineSettings
from tests import ROOT
from tests.fakes import decision
from tests.strategies import SCALE
from tests.threads import TEST_THREADS


def _ok(outcome: DecisionResult | Exception) -> DecisionResult:
    assert isinstance(outcome, DecisionResult), outcome
    return outcome


def _isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (model loading included) and return its outcome."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "HOME": str(Path.home()),
            # The tests' own empty model store: a catalog model installed here stays out of sight.
            "ARBITER_MODEL_STORE": os.environ["ARBITER_MODEL_STORE"],
        },
    )


@pytest.fixture(scope="module")
def small(default_gguf: Path) -> Any:
    """A 256-token context: prompts overflow it easily."""
    eng = open_engine(EngineSettings(model=default_gguf, n_ctx=256, n_threads=TEST_THREADS))
    yield eng
    eng.close()


def _unchecked(**fields: Any) -> DecisionRequest:
    """A decision that skipped the wire schema (as a library caller or an older worker might)."""
    base = decision()
    return DecisionRequest.model_construct(**{**dict(base), **fields})


# -- 1: tokenization is safe to run concurrently with scoring ------------------------------------


def test_concurrent_chat_tokenization_and_scoring_match_a_serial_run(engine: Engine) -> None:
    """``llama_tokenize`` releases the GIL: a shared token buffer let one call read another's
    tokens (about 1 in 700 under contention), and a decision was scored on the wrong prompt."""
    texts = [f"Message {i}: " + "word " * (i % 40 + 1) + "café 😀 " * (i % 5) for i in range(24)]
    segments = [
        [("<start_of_turn>user\n", True), (t, False), ("<end_of_turn>\n", True)] for t in texts
    ]
    expected_tokens = [engine.encode_segments(s) for s in segments]
    requests = [
        decision(f"d{i}", f"State {i}: the customer wrote " + "again and " * (10 * i + 5), f"Q{i}?")
        for i in range(3)
    ]
    engine.cache.clear()
    expected = [_ok(r) for r in engine.score(requests)]

    rounds = 2 * SCALE  # make fuzz: longer
    stop = threading.Event()
    mismatches: list[int] = []
    counts = [0]

    def tokenize_forever() -> None:
        while not stop.is_set():
            for i, (segs, want) in enumerate(zip(segments, expected_tokens, strict=True)):
                counts[0] += 1
                if not np.array_equal(engine.encode_segments(segs), want):
                    mismatches.append(i)

    threads = [threading.Thread(target=tokenize_forever) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        scored = []
        for _ in range(rounds):
            engine.cache.clear()
            scored.extend(_ok(r) for r in engine.score(requests))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert counts[0] > 1000  # the tokenizers really ran alongside the scoring
    assert mismatches == []
    for result, want in zip(scored, expected * rounds, strict=True):
        assert result.prompt.input_tokens == want.prompt.input_tokens
        assert result.prompt.sha256 == want.prompt.sha256
        assert np.allclose(result.option_logits, want.option_logits, atol=1e-3)


# -- 2: one bad decision never costs the others ---------------------------------------------------


def test_a_lone_surrogate_fails_only_its_own_decision(engine: Engine) -> None:
    """Past the schema (its own layer, tests/arbiter/test_schema.py), the tokenizer refuses text
    UTF-8 cannot hold, saying where (``Vocabulary.tokenize``)."""
    bad = _unchecked(id="bad", question="Which queue? \ud800")
    outcomes = engine.score([decision("ok1"), bad, decision("ok2")])
    assert isinstance(outcomes[1], InvalidDecision) and outcomes[1].code == "invalid_text"
    assert "surrogates not allowed at character" in outcomes[1].message
    assert _ok(outcomes[0]).id == "ok1" and _ok(outcomes[2]).id == "ok2"
    state = _unchecked(id="bad-state", state={"k": "\udfff"})
    outcomes = engine.score([state, decision("ok3")])
    assert isinstance(outcomes[0], InvalidDecision)
    assert _ok(outcomes[1]).id == "ok3"


def test_a_temperature_that_overflows_fails_only_its_own_decision(engine: Engine) -> None:
    tiny = _unchecked(id="tiny", temperature=1e-310)
    outcomes = engine.score([tiny, decision("ok")])
    assert isinstance(outcomes[0], InvalidDecision) and outcomes[0].param == "temperature"
    assert _ok(outcomes[1]).id == "ok"


def test_non_finite_logits_fail_only_that_decision(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = engine._scoring._read

    def poisoned(p: Any, batch_index: int) -> None:
        read(p, batch_index)
        if p.request.id == "nan":
            p.logits = np.full_like(p.logits, np.nan)

    monkeypatch.setattr(engine._scoring, "_read", poisoned)
    outcomes = engine.score([decision("ok1"), decision("nan", question="Other?"), decision("ok2")])
    assert isinstance(outcomes[1], EngineFailure)
    assert "non-finite" in outcomes[1].message
    assert _ok(outcomes[0]).id == "ok1" and _ok(outcomes[2]).id == "ok2"


def test_a_unicode_error_from_anywhere_in_a_decision_is_its_invalid_text(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last layer (``preparing.decision_error``): a UnicodeError that no earlier check
    caught is the decision's ``invalid_text``, not an ``engine_failure``."""
    prepare = engine._scoring.preparer.prepare

    def undecodable(index: int, request: DecisionRequest, state_bytes: int) -> Any:
        if request.id == "bad":
            b"\xff".decode("utf-8")
        return prepare(index, request, state_bytes)

    monkeypatch.setattr(engine._scoring.preparer, "prepare", undecodable)
    outcomes = engine.score([decision("bad"), decision("ok")])
    assert isinstance(outcomes[0], InvalidDecision) and outcomes[0].code == "invalid_text"
    assert _ok(outcomes[1]).id == "ok"


def test_an_unexpected_failure_in_one_decision_is_its_typed_error(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepare = engine._scoring.preparer.prepare

    def flaky(index: int, request: DecisionRequest, state_bytes: int) -> Any:
        if request.id == "boom":
            raise RuntimeError("simulated fault")
        return prepare(index, request, state_bytes)

    monkeypatch.setattr(engine._scoring.preparer, "prepare", flaky)
    outcomes = engine.score([decision("boom"), decision("ok")])
    assert isinstance(outcomes[0], EngineFailure) and outcomes[0].status == 500
    assert _ok(outcomes[1]).id == "ok"


# -- 3: token ids outside the vocabulary ----------------------------------------------------------


@pytest.mark.real_model
def test_a_model_without_bos_is_refused_or_served_never_aborts() -> None:
    """``piece(-1)`` used to throw ``std::out_of_range`` across ctypes: the process aborted."""
    result = _isolated(
        """
        from pathlib import Path
        import llama_cpp
        from arbiter.engine import open_engine
        from arbiter.errors import ModelLoadError
        from arbiter.settings import EngineSettings

        settings = EngineSettings(model_dir=Path("/nonexistent"), n_threads=1, n_ctx=512)
        llama_cpp.llama_vocab_bos = lambda vocab: -1  # a vocabulary without BOS
        try:
            open_engine(settings)
        except ModelLoadError as exc:
            print("refused:", exc)
        llama_cpp.llama_vocab_get_add_bos = lambda vocab: False
        eng = open_engine(settings)
        print("bos_text", repr(eng.bos_text))
        for token in (-1, -5, eng.n_vocab, 2**31 - 1):
            assert eng.piece(token) == "" and not eng.is_control(token), token
        print("served")
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused:" in result.stdout and "BOS" in result.stdout
    assert "bos_text ''" in result.stdout and "served" in result.stdout


# -- 4: the output buffer is capped ---------------------------------------------------------------


def test_buffers_are_sized_for_the_outputs_read_not_n_batch(default_gguf: Path) -> None:
    """Without ``n_outputs_max`` llama.cpp sizes its compute buffer for n_batch rows of logits
    (514 MiB at n_batch 512 for a 262k vocabulary, really allocated on a GPU)."""
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", "replace"))

    backends.init()
    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        eng = open_engine(
            EngineSettings(model=default_gguf, n_ctx=512, n_threads=TEST_THREADS, max_branches=4)
        )
    finally:
        backends.route_llama_logs()
    try:
        sizes = {
            kind: float(line.split("=")[-1].split()[0])
            for line in lines
            for kind in ("output buffer", "compute buffer")
            if kind in line
        }
        assert set(sizes) == {"output buffer", "compute buffer"}, lines
        row_mib = eng.n_vocab * 4 / 2**20
        # One row per sequence: the prefix, a question and the label branches of a 255-option
        # question (2 + 52) outnumber the prefix and its 4 branches.
        assert eng.llama.n_outputs_max == 2 + eng.labels.max_branches == 54
        assert sizes["output buffer"] <= eng.llama.n_outputs_max * row_mib + 1, sizes
        assert sizes["compute buffer"] < 64, sizes  # 514 MiB without the cap, 55.6 with it
        # A slice that asks for more outputs than the cap is refused before llama.cpp sees it.
        n = eng.llama.n_outputs_max + 1
        with pytest.raises(EngineFailure, match="outputs"):
            eng.llama.decode(
                np.arange(n, dtype=np.int32),
                np.arange(n, dtype=np.int32),
                np.zeros(n, np.int32),
                np.ones(n, np.int8),
            )
        assert _ok(eng.score([decision()])[0])
    finally:
        eng.close()


# -- 5: close is safe while calls are running -----------------------------------------------------


@pytest.mark.real_model
def test_close_waits_for_running_calls_and_later_calls_fail_cleanly() -> None:
    result = _isolated(
        """
        import threading, time
        from pathlib import Path
        from arbiter.engine import open_engine
        from arbiter.errors import EngineFailure
        from arbiter.schema import DecisionResult
        from arbiter.settings import EngineSettings
        from tests.fakes import decision

        eng = open_engine(EngineSettings(model_dir=Path("/nonexistent"), n_threads=1, n_ctx=1024))
        outcomes = []
        requests = [decision(f"d{i}", "A long shared state. " * 40, f"Q{i}?") for i in range(4)]
        worker = threading.Thread(target=lambda: outcomes.extend(eng.score(requests)))
        worker.start()
        time.sleep(0.05)
        eng.close()  # while the worker is scoring
        worker.join()
        assert all(isinstance(o, DecisionResult) for o in outcomes), outcomes
        for call in (
            lambda: eng.score([decision()]),
            lambda: eng.encode_segments([("hello", False)]),
            lambda: eng.generate(eng.encode_segments([("hi", False)]), max_tokens=1),
            lambda: eng.piece(2),
        ):
            try:
                call()
            except EngineFailure as exc:
                print("refused:", exc)
        eng.close()  # twice is harmless
        print("done")
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("refused:") == 4 and "done" in result.stdout


# -- 6: a failed prefix-cache restore --------------------------------------------------------------


def test_a_corrupt_cached_prefix_is_prefilled_like_a_cold_run(engine: Engine) -> None:
    state = {"order": 1182, "status": "delivered broken", "customer": "gold"}
    request = decision("a", state, "Refund?", [("y", "Yes"), ("n", "No")])
    engine.cache.clear()
    cold = _ok(engine.score([request])[0])
    ((key, saved),) = engine.cache._entries.items()
    engine.cache._entries[key] = saved[: len(saved) // 2]  # llama.cpp fails part-way through
    engine.cache.bytes_used -= len(saved) - len(saved) // 2
    again = _ok(engine.score([request])[0])
    assert again.prefix_cache == "miss"
    assert np.allclose(again.option_logits, cold.option_logits, atol=1e-3), (
        again.option_logits,
        cold.option_logits,
    )


# -- 7: cheap wins -------------------------------------------------------------------------------


def test_a_state_too_big_for_the_cache_is_never_copied(
    small: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(small, "cache", PrefixCache(10 * 1024))
    copies: list[int] = []
    clears: list[bool] = []
    get_data = llama_cpp.llama_state_seq_get_data
    clear = llama_cpp.llama_memory_clear

    def counting_get_data(*args: Any) -> Any:
        copies.append(1)
        return get_data(*args)

    def recording_clear(mem: Any, data: bool) -> Any:
        clears.append(bool(data))
        return clear(mem, data)

    monkeypatch.setattr(llama_cpp, "llama_state_seq_get_data", counting_get_data)
    monkeypatch.setattr(llama_cpp, "llama_memory_clear", recording_clear)
    result = _ok(small.score([decision()])[0])
    assert result.prefix_cache == "miss" and len(small.cache) == 0
    assert copies == []  # the state (~1 MB) is over the 10 kB cache: never read out
    # Between groups only the cells' metadata is cleared; zeroing the KV data cost ~3%.
    assert clears and not any(clears)


# -- 8: a too-long prompt names the field that holds the most tokens ------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"state": "word " * 400}, "state"),
        ({"question": "Which one of these, really, " * 60}, "question"),
        (
            {
                "options": [
                    Option(id="a", description="Short"),
                    Option(id="b", description="A very long option text. " * 60),
                ]
            },
            "options.1.description",
        ),
    ],
)
def test_context_length_error_names_the_longest_field(
    small: Engine, fields: dict[str, Any], param: str
) -> None:
    outcome = small.score([decision().model_copy(update=fields), decision("fits")])
    assert isinstance(outcome[0], ContextLengthExceeded)
    assert outcome[0].param == param, outcome[0].message
    assert param in outcome[0].message and "256" in outcome[0].message
    assert _ok(outcome[1]).id == "fits"
