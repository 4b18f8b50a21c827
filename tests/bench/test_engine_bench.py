"""`arbiter bench engine`'s measurements run on the real engine (one small sample each), so a
broken benchmark fails here rather than when someone needs its figures."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from arbiter.engine import Engine, open_engine
from bench import engine_bench
from bench.common import ONE_READ, QUESTIONS, case_decision, sized_state
from bench.floor import floor_shared, plain_pass, reference_option_logits
from tests.environ import environ_without
from tests.threads import TEST_THREADS


@contextmanager
def reading(engine: Engine, **settings: Any) -> Iterator[Engine]:
    """The session's engine with other settings for one test (they are read at each call)."""
    before = engine.settings
    engine.settings = before.model_copy(update=settings)
    try:
        yield engine
    finally:
        engine.settings = before


def test_single_decision_against_the_floor(engine: Engine) -> None:
    with reading(engine, order_policy=ONE_READ):
        row = engine_bench.bench_single(engine, 150, repeats=1)
    assert 130 <= row["prompt_tokens"] <= 170
    assert row["engine_p50_ms"] > 0 and row["floor_p50_ms"] > 0 and row["ratio"] > 0
    assert len(row["pairs"]) == 1


def test_a_decision_read_in_more_orders_is_never_set_beside_the_floor(engine: Engine) -> None:
    """The engine reads more orders while the leader is unclear (issue 34): against a floor of one
    prefill that printed 2.6x the floor. The bench refuses such a figure instead."""
    with (
        reading(engine, order_policy="adaptive", order_margin=1e9),
        pytest.raises(RuntimeError, match="order_policy 'single'"),
    ):
        engine_bench.bench_single(engine, 150, repeats=1)


def test_the_floor_decodes_on_the_engines_context_and_leaves_it_clean(engine: Engine) -> None:
    state = sized_state(engine, 5, 60, whole_prompt=False)
    requests = [case_decision(i, state, q) for i, q in enumerate(QUESTIONS[:2])]
    tokens = [engine.prompt_tokens(r) for r in requests]
    logits, seconds = plain_pass(engine, tokens[0])
    assert logits.shape == (engine.n_vocab,) and seconds > 0
    prefix = 20
    prefix_s, suffix_s = floor_shared(engine, tokens[0][:prefix], [t[prefix:] for t in tokens])
    assert prefix_s > 0 and suffix_s > 0
    # Scoring after the floor is unaffected: the context was left empty.
    engine.cache.clear()
    assert len(reference_option_logits(engine, requests[0])) == 4
    assert not isinstance(engine.score(requests)[0], Exception)


def test_the_adapter_rows_toggle_the_adapter_and_leave_it_applied(tmp_path: Path) -> None:
    from arbiter.models import smollm2_path
    from arbiter.settings import EngineSettings
    from bench.lora_adapter import write_lora

    model = smollm2_path()
    assert model is not None
    lora = write_lora(model, tmp_path / "lora.gguf", seed=1)
    eng = open_engine(
        EngineSettings(
            model=model, n_threads=TEST_THREADS, n_ctx=2048, lora=f"{lora}:1", order_policy=ONE_READ
        )
    )
    try:
        request = case_decision(0, sized_state(eng, 9, 60))
        before = eng.score([request])[0]
        row = engine_bench.bench_adapter(eng, 150, repeats=1)
        assert row["with_ms"] > 0 and row["without_ms"] > 0 and row["floor_with_ms"] > 0
        assert row["with_vs_without"] > 0 and row["adapters"] == ["lora.gguf"]
        eng.cache.clear()
        after = eng.score([request])[0]
        assert not isinstance(before, Exception) and not isinstance(after, Exception)
        assert after.option_logits == pytest.approx(before.option_logits, abs=1e-3)
    finally:
        eng.close()


def test_lora_random_without_gguf_is_refused_in_one_line_naming_what_to_install() -> None:
    """`make run` installs the package and its local extra, not llama.cpp's gguf package, which
    `--lora random` writes its adapter with: a ModuleNotFoundError traceback, before."""
    script = (
        "import sys; sys.modules['gguf'] = None\n"  # as in `make run`'s environment
        "from arbiter.cli import main\n"
        "sys.exit(main(['bench', 'engine', '--lora', 'random', '--repeats', '1']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=environ_without("ARBITER_", "SM_"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert "gguf" in line and "pip install" in line and "'.[bench]'" in line
