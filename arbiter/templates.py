"""Chat templates rendered as they are written: Hugging Face ``apply_chat_template``'s environment,
and, for a decision, what each family needs to answer at once with no tools and no reasoning.

Templates are Jinja written for ``transformers``: its globals (``raise_exception``,
``strftime_now``), its ``tojson`` (no HTML escaping), ``tools=None`` and ``documents=None`` when
there are none, and any keyword the caller adds (``enable_thinking``, ``reasoning_effort``, ...).
They are rendered in Jinja's immutable sandbox: a template reads what it is given and nothing else.

A decision is read at the end of the generation prompt, so that position must be where the model
writes its answer. Today's families differ in how they get there (``decision_kwargs``,
``close_reasoning``):

- Qwen3 / Qwen3.5 / QwQ / SmolLM3 / DeepSeek-R1 distills read ``enable_thinking``; rendered with
  ``False`` most close an empty ``<think>`` block themselves; one left open (DeepSeek-R1-Distill-
  Llama, ``<think>\\n``) is closed here the same way (``<think>\\n\\n</think>\\n\\n``).
- Gemma 4 opens its thought channel unless ``enable_thinking`` is true; rendered with ``False``,
  the channel is closed (``<|channel>thought\\n<channel|>``).
- gpt-oss (harmony channels) needs a channel on every assistant message: the analysis channel is
  written empty and closed, then the final channel opened (``reasoning_effort`` ``low``).
- Llama 3.x and Mistral Small read the date (``date_string``, ``strftime_now``): the decision
  prompt's date is fixed when the layout is rendered, so every decision of a process reads the same
  prompt (``ARBITER_PROMPT_DATE`` pins it across processes).
- Gemma 2/3 have no system role: the instruction goes into the user turn, where Gemma 3's own
  template would fold it (``prompt.chat_layout``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Keys a caller's ``chat_template_kwargs`` may not set: the renderer's own inputs.
RESERVED_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"}
)
# llama.cpp's server passes the date in this form (``date_string``; Llama 3.x reads it).
DATE_STRING_FORMAT = "%d %b %Y"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``tojson`` as transformers defines it (Jinja's own escapes ``<``, ``>``, ``&`` and ``'``)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    """A chat template compiled in the immutable sandbox with transformers' environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str,
    eos_token: str,
    now: datetime | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The template over ``messages`` with the generation prompt, no tools and no documents.

    ``now`` is what ``strftime_now`` and ``date_string`` read (the current time when None).
    Raises ``jinja2.TemplateError`` (``raise_exception``, or a template error of its own).
    """
    when = now or datetime.now()

    def strftime_now(fmt: str) -> str:
        return when.strftime(fmt)

    context: dict[str, Any] = {
        "strftime_now": strftime_now,
        "date_string": when.strftime(DATE_STRING_FORMAT),
        **(kwargs or {}),
    }
    try:
        return compile_template(template).render(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    except jinja2.exceptions.TemplateError:
        raise
    except Exception as exc:  # a template that fails on its own inputs (TypeError, ...)
        raise jinja2.exceptions.TemplateError(f"{type(exc).__name__}: {exc}") from exc


# -- reading a decision: no thinking, no tools ----------------------------------------------------

GPT_OSS_CHANNEL = "<|channel|>"


def decision_kwargs(template: str) -> dict[str, Any]:
    """The keywords a decision is rendered with: no thinking; gpt-oss also at its lowest effort."""
    kwargs: dict[str, Any] = {"enable_thinking": False}
    if GPT_OSS_CHANNEL in template:
        kwargs["reasoning_effort"] = "low"
    return kwargs


@dataclass(frozen=True)
class ReasoningBlock:
    """A family's reasoning block: how it opens and closes, and what closes it when left open."""

    name: str
    opens: str
    closes: str
    closing: Callable[[str], str]  # the text that closes it, given the prompt so far


def _newline_then(text: str) -> Callable[[str], str]:
    return lambda prompt: ("" if prompt.endswith("\n") else "\n") + text


GPT_OSS_FINAL = "<|start|>assistant<|channel|>final<|message|>"
GPT_OSS_EMPTY_ANALYSIS = "<|channel|>analysis<|message|><|end|>"
BLOCKS = (
    # Qwen3's own closed block is "<think>\n\n</think>\n\n".
    ReasoningBlock("think", "<think>", "</think>", _newline_then("\n</think>\n\n")),
    ReasoningBlock(
        "gemma4-thought", "<|channel>thought", "<channel|>", _newline_then("<channel|>")
    ),
    ReasoningBlock(
        "gpt-oss-analysis",
        "<|channel|>analysis<|message|>",
        "<|end|>",
        lambda _: "<|end|>" + GPT_OSS_FINAL,
    ),
    ReasoningBlock("mistral-think", "[THINK]", "[/THINK]", lambda _: "[/THINK]"),
    ReasoningBlock(
        "command-thinking", "<|START_THINKING|>", "<|END_THINKING|>", lambda _: "<|END_THINKING|>"
    ),
)


def open_block(text: str) -> ReasoningBlock | None:
    """The reasoning block ``text`` ends inside (opened and not closed after), if any."""
    found: tuple[int, ReasoningBlock] | None = None
    for block in BLOCKS:
        start = text.rfind(block.opens)
        if start == -1 or block.closes in text[start + len(block.opens) :]:
            continue
        if found is None or start > found[0]:
            found = (start, block)
    return found[1] if found else None


@dataclass(frozen=True)
class Closure:
    """What was appended to a decision's generation prompt so the answer comes next."""

    block: str | None  # the block's name; None when the template left nothing open
    text: str


def close_reasoning(template: str, tail: str) -> Closure:
    """The text that puts the read position after any reasoning block ``tail`` leaves open.

    ``tail`` is the rendered prompt after the user's content. gpt-oss's generation prompt stops at
    ``<|start|>assistant``, where the model must name a channel: the analysis channel is written
    empty and closed, and the final one opened.
    """
    block = open_block(tail)
    if block is not None:
        return Closure(block.name, block.closing(tail))
    if GPT_OSS_CHANNEL in template and tail.endswith("<|start|>assistant"):
        return Closure("gpt-oss-analysis", GPT_OSS_EMPTY_ANALYSIS + GPT_OSS_FINAL)
    return Closure(None, "")


# -- chat completions: the caller's choice ---------------------------------------------------------

MAX_CALLER_KWARGS = 64


def caller_kwargs(
    chat_template_kwargs: Mapping[str, Any] | None,
    reasoning_effort: str | None = None,
    enable_thinking: bool | None = None,
) -> dict[str, Any]:
    """A chat request's template keywords, as llama.cpp's server reads them.

    ``chat_template_kwargs`` are passed to the template as they are (not the renderer's own
    inputs); ``reasoning_effort`` ``"none"`` turns thinking off, another value is passed on;
    ``enable_thinking`` (top level) wins over both. Raises ``ValueError`` naming the key.
    """
    kwargs = dict(chat_template_kwargs or {})
    if len(kwargs) > MAX_CALLER_KWARGS:
        raise ValueError(f"at most {MAX_CALLER_KWARGS} chat_template_kwargs")
    for key in kwargs:
        if key in RESERVED_KWARGS or not key.isidentifier():
            raise ValueError(f"chat_template_kwargs.{key}: this key cannot be set by a request")
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise ValueError("chat_template_kwargs.enable_thinking must be true or false")
    if reasoning_effort == "none":
        kwargs["enable_thinking"] = False
        kwargs.pop("reasoning_effort", None)
    elif reasoning_effort:
        kwargs["reasoning_effort"] = reasoning_effort
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    return kwargs
