"""Text completions (`/v1/completions`) against ``arbiter serve`` (SmolLM2) with the ``openai``
client: llama.cpp server's ``test_completion.py`` cases that do not depend on its test model,
and the legacy API's own shapes (logprobs as a count, echo)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.adapter.openai_server import arbiter_serve

pytestmark = pytest.mark.real_model

PROMPT = "I believe the meaning of life is"


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with arbiter_serve(1024) as base:
        yield openai.OpenAI(api_key="dummy", base_url=f"{base}/v1", max_retries=0, timeout=300)


def create(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("model", "smollm2")
    kw.setdefault("prompt", PROMPT)
    return client.completions.create(**kw)


def test_completion_with_openai_library(client: openai.OpenAI) -> None:
    res = create(client, max_tokens=8)
    assert res.object == "text_completion" and res.id.startswith("cmpl-")
    assert res.system_fingerprint is not None
    assert res.choices[0].finish_reason == "length"
    assert res.choices[0].text
    assert res.usage is not None and res.usage.completion_tokens == 8


def test_completion_stream_with_openai_library(client: openai.OpenAI) -> None:
    output_text = ""
    for data in create(client, max_tokens=8, temperature=0, stream=True):
        choice = data.choices[0]
        if choice.finish_reason is None:
            assert choice.text is not None
            output_text += choice.text
    assert output_text == create(client, max_tokens=8, temperature=0).choices[0].text


def test_consistent_result_same_seed_and_different_with_another(client: openai.OpenAI) -> None:
    texts = [create(client, max_tokens=12, seed=42, temperature=1.0).choices[0].text for _ in "ab"]
    assert texts[0] == texts[1]
    others = {
        create(client, max_tokens=12, seed=s, temperature=1.0).choices[0].text for s in range(3)
    }
    assert len(others) == 3


def test_legacy_logprobs_shape(client: openai.OpenAI) -> None:
    res = create(client, max_tokens=5, temperature=0, logprobs=3)
    lp = res.choices[0].logprobs
    assert lp is not None
    assert "".join(lp.tokens) == res.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == 5
    assert all(len(alternatives) <= 3 for alternatives in lp.top_logprobs)
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


def test_echo_and_several_choices(client: openai.OpenAI) -> None:
    res = create(client, max_tokens=4, echo=True, n=2, seed=3)
    assert [c.index for c in res.choices] == [0, 1]
    assert all(c.text.startswith(PROMPT) for c in res.choices)


def test_stop_and_grammar_over_a_raw_prompt(client: openai.OpenAI) -> None:
    full = create(client, max_tokens=16, temperature=0).choices[0].text
    stop = full[3:6]
    cut = create(client, max_tokens=16, temperature=0, stop=stop).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    grammar = create(client, max_tokens=8, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert grammar.choices[0].text in {"yes", "no"}


SENT: dict[str, tuple[Any, str]] = {
    "model": ("smollm2", "honoured"),
    "prompt": (PROMPT, "honoured"),
    "best_of": (3, "refused"),
    "echo": (True, "honoured"),
    "frequency_penalty": (0.5, "honoured"),
    "logit_bias": ({"42": -100}, "honoured"),
    "logprobs": (2, "honoured"),
    "max_tokens": (2, "honoured"),
    "n": (2, "honoured"),
    "presence_penalty": (0.5, "honoured"),
    "seed": (1, "honoured"),
    "stop": ("\n", "honoured"),
    "stream": (False, "honoured"),
    "stream_options": ({"include_usage": True}, "honoured"),
    "suffix": ("the end", "refused"),
    "temperature": (0.3, "honoured"),
    "top_p": (0.9, "honoured"),
    "user": ("u1", "honoured"),
}


def test_the_table_covers_every_parameter_of_the_client() -> None:
    params = set(inspect.signature(openai.OpenAI(api_key="x").completions.create).parameters)
    assert params - {"extra_headers", "extra_query", "extra_body", "timeout"} == set(SENT)


@pytest.mark.parametrize("name", sorted(SENT))
def test_every_parameter_is_honoured_or_refused_by_name(client: openai.OpenAI, name: str) -> None:
    value, outcome = SENT[name]
    kw = {"max_tokens": 2, name: value}
    if outcome == "honoured":
        assert create(client, **kw).choices
        return
    with pytest.raises(openai.BadRequestError) as err:
        create(client, **kw)
    error = err.value.body
    assert isinstance(error, dict)
    assert error["code"] == "unsupported_parameter" and error["param"] == name
