"""llama.cpp's sampler chain as the engine builds it, on rows of logits made here: each control
does what it says, whatever the model (the model-level tests are in test_generation.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from arbiter.engine.sampler import Candidates, Sampler
from arbiter.engine.sampling import SamplingParams, token_logprobs

VOCAB = 64


def sampler(budget: int = 100, seed_index: int = 0, **params: object) -> Sampler:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    return Sampler(VOCAB, p, p.choice_seed(seed_index), budget, None, Candidates(VOCAB))


def row(*pairs: tuple[int, float], base: float = 0.0) -> np.ndarray:
    logits = np.full(VOCAB, base, dtype=np.float32)
    for token, value in pairs:
        logits[token] = value
    return logits


def draws(s: Sampler, logits: np.ndarray, k: int) -> list[int]:
    try:
        return [s.sample(logits) for _ in range(k)]
    finally:
        s.close()


def test_temperature_zero_is_the_argmax() -> None:
    assert draws(sampler(temperature=0), row((7, 5.0), (3, 4.9)), 5) == [7] * 5


@pytest.mark.parametrize("tiny", [1e-7, 1e-38, 1e-300])
def test_a_temperature_too_small_to_divide_by_is_greedy(tiny: float) -> None:
    """Logits / 1e-38 overflow float32: llama.cpp's draw then picked the last token (63)."""
    assert draws(sampler(temperature=tiny, seed=1), row((7, 50.0), (3, 49.0)), 3) == [7] * 3


def test_top_k_one_is_the_argmax_at_any_temperature() -> None:
    assert set(draws(sampler(temperature=2, top_k=1, seed=1), row((9, 1.0)), 50)) == {9}


def test_a_draw_follows_the_softmax() -> None:
    """Two tokens at logits 0 and log 3 (the rest at -inf): 3 in 4 draws are the second."""
    logits = row((1, 0.0), (2, float(np.log(3.0))), base=-np.inf)
    counts = Counter(draws(sampler(seed=5), logits, 4000))
    assert set(counts) == {1, 2}
    assert counts[2] / 4000 == pytest.approx(0.75, abs=0.03)


def test_top_p_keeps_the_smallest_set_over_p() -> None:
    # probabilities 0.5, 0.3, 0.2 (others -inf): top_p 0.7 keeps the first two only.
    logits = row((1, np.log(0.5)), (2, np.log(0.3)), (3, np.log(0.2)), base=-np.inf)
    assert set(draws(sampler(seed=2, top_p=0.7), logits, 400)) == {1, 2}


def test_min_p_drops_tokens_under_a_share_of_the_best() -> None:
    logits = row((1, np.log(0.6)), (2, np.log(0.35)), (3, np.log(0.05)), base=-np.inf)
    assert set(draws(sampler(seed=3, min_p=0.1), logits, 400)) == {1, 2}


def test_the_same_seed_gives_the_same_draws_and_another_seed_others() -> None:
    logits = row()
    first = draws(sampler(seed=42), logits, 40)
    assert draws(sampler(seed=42), logits, 40) == first
    assert draws(sampler(seed=43), logits, 40) != first
    assert draws(sampler(seed=42, seed_index=1), logits, 40) != first  # choice 1 of n


def test_logit_bias_bans_and_forces_tokens() -> None:
    logits = row((4, 10.0))
    assert set(draws(sampler(temperature=0, logit_bias=((4, -100.0),)), logits, 3)) != {4}
    assert draws(sampler(seed=1, logit_bias=((11, 100.0),)), logits, 20) == [11] * 20


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repeat_penalty": 2.0}]
)
def test_a_penalty_moves_greedy_off_a_token_already_generated(penalty: dict[str, float]) -> None:
    logits = row((5, 2.0), (6, 1.5), base=0.0)
    out = draws(sampler(temperature=0, **penalty), logits, 2)  # type: ignore[arg-type]
    assert out == [5, 6]
    assert draws(sampler(temperature=0), logits, 2) == [5, 5]  # without it, greedy repeats


def test_the_penalty_window_forgets_older_tokens() -> None:
    logits = row((5, 2.0), (6, 1.5), (7, 1.2))
    s = sampler(temperature=0, presence_penalty=2.0, penalty_last_n=1)
    assert draws(s, logits, 4) == [5, 6, 5, 6]


def test_logprobs_are_the_log_softmax_and_the_top_ones_in_order() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=5000).astype(np.float32)
    logprob, top, values = token_logprobs(logits, 17, 20)
    reference = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert logprob == pytest.approx(reference[17])
    assert top.tolist() == np.argsort(-reference)[:20].tolist()
    assert values == pytest.approx(reference[top])
    assert token_logprobs(logits, 3, 0)[1].size == 0
