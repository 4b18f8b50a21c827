"""`arbiter bench engine`'s measurements run on the real engine (one small sample each), so a
broken benchmark fails here rather than when someone needs its figures."""

from __future__ import annotations

from arbiter.engine import Engine
from bench import engine_bench
from bench.common import QUESTIONS, case_decision, sized_state
from bench.floor import floor_shared, plain_pass, reference_option_logits


def test_single_decision_against_the_floor(engine: Engine) -> None:
    row = engine_bench.bench_single(engine, 150, repeats=1)
    assert 130 <= row["prompt_tokens"] <= 170
    assert row["engine_p50_ms"] > 0 and row["floor_p50_ms"] > 0 and row["ratio"] > 0


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
