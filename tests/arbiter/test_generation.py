"""Text generation on the real chat model (SmolLM2): n choices from one prefill, seeds, stop
strings across streamed deltas, log-probabilities, logit_bias, grammars, limits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from arbiter.engine import Engine, SamplingParams, TokenLogprob
from arbiter.errors import ContextLengthExceeded, InvalidDecision
from arbiter.prompt import render_chat

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def prompt(chat_engine: Engine) -> np.ndarray:
    segments = render_chat(
        [("user", "Tell me about cats.")],
        chat_engine.chat_template,
        chat_engine.bos_text,
        chat_engine.eos_text,
    )
    return chat_engine.encode_segments(segments)


@pytest.fixture
def decodes(chat_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The token count of every llama_decode call."""
    calls: list[int] = []
    original = chat_engine.llama.decode

    def spy(tokens: np.ndarray, *args: Any, **kw: Any) -> None:
        calls.append(len(tokens))
        original(tokens, *args, **kw)

    monkeypatch.setattr(chat_engine.llama, "decode", spy)
    yield calls


def test_n_choices_share_one_prefill(
    chat_engine: Engine, prompt: np.ndarray, decodes: list[int]
) -> None:
    out = chat_engine.generate(prompt, max_tokens=6, sampling=SamplingParams(seed=7), n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.prompt_tokens == len(prompt)
    assert decodes[0] == len(prompt)  # the prompt, once
    assert all(n <= 3 for n in decodes[1:])  # then one token per unfinished choice, batched
    assert out.completion_tokens == sum(c.completion_tokens for c in out.choices)
    assert len({c.text for c in out.choices}) > 1  # each choice draws with its own seed


def test_the_same_seed_gives_the_same_choices(chat_engine: Engine, prompt: np.ndarray) -> None:
    def texts(seed: int) -> list[str]:
        out = chat_engine.generate(prompt, max_tokens=10, sampling=SamplingParams(seed=seed), n=3)
        return [c.text for c in out.choices]

    first = texts(42)
    assert texts(42) == first
    assert texts(43) != first


def test_greedy_choices_are_equal_and_match_one_greedy_choice(
    chat_engine: Engine, prompt: np.ndarray
) -> None:
    three = chat_engine.generate(prompt, max_tokens=8, sampling=GREEDY, n=3)
    one = chat_engine.generate(prompt, max_tokens=8, sampling=GREEDY)
    assert {c.text for c in three.choices} == {one.text}


def test_logprobs_are_the_models_and_join_to_the_text(
    chat_engine: Engine, prompt: np.ndarray
) -> None:
    out = chat_engine.generate(prompt, max_tokens=8, sampling=GREEDY, top_logprobs=5)
    entries = out.choices[0].logprobs
    assert entries is not None and len(entries) == out.completion_tokens
    assert "".join(e.token for e in entries) == out.text
    for e in entries:
        assert len(e.top) == 5 and e.logprob <= 0
        assert [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
        assert e.top[0].bytes == e.bytes and e.top[0].logprob == pytest.approx(e.logprob)  # greedy
    with chat_engine.session() as llama:  # the reference: a full sort of the first row
        row = llama.last_logits(prompt, 0)
    reference = row - np.log(np.exp(row - row.max()).sum()) - row.max()
    assert entries[0].logprob == pytest.approx(float(reference.max()), abs=1e-6)
    order = np.argsort(-reference)[:5]
    assert [t.logprob for t in entries[0].top] == pytest.approx(reference[order].tolist(), abs=1e-6)


def test_no_logprobs_unless_asked(chat_engine: Engine, prompt: np.ndarray) -> None:
    out = chat_engine.generate(prompt, max_tokens=2, sampling=GREEDY)
    assert out.choices[0].logprobs is None


def test_a_stop_string_cuts_at_its_first_match_also_when_streamed(
    chat_engine: Engine, prompt: np.ndarray
) -> None:
    full = chat_engine.generate(prompt, max_tokens=24, sampling=GREEDY, top_logprobs=0).choices[0]
    assert full.logprobs is not None
    # A stop string that starts inside one token and ends inside the next.
    second = full.logprobs[2]
    stop = full.text[second.start - 2 : second.start + 2]
    assert len(stop) == 4
    cut = full.text.index(stop)
    deltas: list[tuple[str, list[TokenLogprob] | None]] = []

    def on_delta(index: int, text: str, logprobs: list[TokenLogprob] | None) -> bool:
        assert index == 0
        deltas.append((text, logprobs))
        return True

    out = chat_engine.generate(
        prompt, max_tokens=24, sampling=GREEDY, stop=[stop], top_logprobs=0, on_delta=on_delta
    )
    choice = out.choices[0]
    assert choice.text == full.text[:cut] and choice.finish_reason == "stop"
    assert "".join(text for text, _ in deltas) == choice.text  # no part of the stop was sent
    streamed = [e.token for _, logprobs in deltas for e in (logprobs or [])]
    assert "".join(streamed) == choice.text
    assert choice.logprobs is not None and "".join(e.token for e in choice.logprobs) == choice.text
    # The token cut by the stop string has its bytes cut too: they join to the content's bytes
    # (issue 28: the whole token's bytes were kept).
    assert b"".join(e.bytes for e in choice.logprobs) == choice.text.encode()
    streamed_bytes = [e.bytes for _, logprobs in deltas for e in (logprobs or [])]
    assert b"".join(streamed_bytes) == choice.text.encode()


def test_logit_bias_bans_the_greedy_token_and_forces_another(
    chat_engine: Engine, prompt: np.ndarray
) -> None:
    first = chat_engine.generate(prompt, max_tokens=1, sampling=GREEDY, top_logprobs=0)
    assert first.choices[0].logprobs is not None
    banned = chat_engine.tokenize_content(first.text)
    assert len(banned) == 1
    biased = SamplingParams(temperature=0, logit_bias=((int(banned[0]), -100.0),))
    assert chat_engine.generate(prompt, max_tokens=1, sampling=biased).text != first.text
    forced_token = int(chat_engine.tokenize_content(" zebra")[0])
    forced = SamplingParams(seed=1, logit_bias=((forced_token, 100.0),))
    out = chat_engine.generate(prompt, max_tokens=3, sampling=forced)
    assert out.text == chat_engine.piece(forced_token) * 3


def test_a_grammar_the_model_would_never_follow_is_followed(
    chat_engine: Engine, prompt: np.ndarray
) -> None:
    """Every first draw is refused here: each token comes from the grammar-masked resample."""
    sampling = SamplingParams(temperature=0.7, seed=3, grammar='root ::= "zq" [0-9]{3} "!"')
    out = chat_engine.generate(prompt, max_tokens=20, sampling=sampling, n=2)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert (
            choice.text.startswith("zq") and choice.text[2:5].isdigit() and choice.text[5:] == "!"
        )


def test_a_client_that_leaves_cancels_every_choice(chat_engine: Engine, prompt: np.ndarray) -> None:
    out = chat_engine.generate(
        prompt, max_tokens=30, sampling=GREEDY, n=2, on_delta=lambda i, t, lp: False
    )
    assert {c.finish_reason for c in out.choices} == {"cancelled"}


def test_choices_and_the_context_are_bounded_before_any_work(chat_engine: Engine) -> None:
    with pytest.raises(InvalidDecision) as err:
        chat_engine.generate(np.zeros(4, np.int32), max_tokens=1, n=chat_engine.llama.n_seq_max + 1)
    assert err.value.param == "n"
    near_full = np.zeros(chat_engine.n_ctx - 2, np.int32)
    with pytest.raises(ContextLengthExceeded) as exceeded:
        chat_engine.generate(near_full, max_tokens=1, n=3)  # 2 cells left, 3 choices
    assert exceeded.value.param == "n"
