"""`arbiter bench generation` runs on the real chat model (a tiny sample), so a broken benchmark
fails here rather than when someone needs its figures."""

from __future__ import annotations

import pytest

from arbiter.models import smollm2_path
from bench import generation_bench


@pytest.mark.real_model
def test_every_row_is_measured_and_rendered() -> None:
    path = smollm2_path()
    assert path is not None
    result = generation_bench.bench_model(path, tokens=4, repeats=1)
    assert result["decode_floor_ms_per_token"] > 0 and result["greedy_ms_per_token"] > 0
    assert set(result["ratios"]) == {"greedy", "chain", "logprobs20", "grammar"}
    assert result["grammar_whole_vocabulary_mask_ms"] > 0 and result["n4_speedup"] > 0
    table = generation_bench.render([result])
    assert "SmolLM2" in table and table.count("\n") == 2
