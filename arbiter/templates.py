"""Chat templates rendered as they are written: Hugging Face ``apply_chat_template``'s environment,
and, for a decision, what each family needs to answer at once with no tools and no reasoning.

Templates are Jinja written for ``transformers``: its globals (``raise_exception``,
``strftime_now``), its ``tojson`` (no HTML escaping), its ``{% generation %}`` tag (which marks the
assistant's tokens for training and renders its body), and any keyword the caller adds
(``enable_thinking``, ``reasoning_effort``, ...). As llama.cpp's server renders them, ``tools`` and
``functions`` are left undefined when there are none (a template iterates an undefined name as
empty, where ``None`` would fail), an undefined name joined to a string is the empty string, and
``datetime`` and ``date_string`` carry the day. They are rendered in Jinja's immutable sandbox: a
template reads what it is given and nothing else.

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
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from arbiter import marks

# Keys a caller's ``chat_template_kwargs`` may not set: the renderer's own inputs.
RESERVED_KWARGS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "tools",
        "functions",
        "documents",
        "bos_token",
        "eos_token",
    }
)
# llama.cpp's server passes the date in these forms (``date_string``: Llama 3.x; ``datetime``:
# firefunction-v2).
DATE_STRING_FORMAT = "%d %b %Y"
DATETIME_FORMAT = "%b %d %Y"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}``: renders its body unchanged (it
    marks the assistant's tokens for ``return_assistant_tokens_mask``; llama.cpp ignores it)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it a set)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the tag's name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class Unset(jinja2.Undefined):
    """A name the template was not given. As in llama.cpp's renderer, joined to a string it is the
    empty string (firefunction-v2 appends ``functions`` to its system prompt); otherwise it is
    Jinja's own undefined (iterated as empty, falsy, ``is defined`` false, an error when used as a
    value)."""

    def __add__(self, other: object) -> Any:
        if isinstance(other, str):
            return other
        return super().__add__(other)

    def __radd__(self, other: object) -> Any:
        if isinstance(other, str):
            return other
        return super().__radd__(other)


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    """A chat template compiled in the immutable sandbox with transformers' environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, GenerationTag],
        undefined=Unset,
    )
    env.filters["tojson"] = marks.to_json
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
    generation_prompt: bool = True,
) -> str:
    """The template over ``messages``, with the generation prompt unless ``generation_prompt`` is
    False; no tools, no functions, no documents (each left undefined, as llama.cpp leaves them).

    ``now`` is what ``strftime_now``, ``date_string`` and ``datetime`` read (the current time when
    None). Raises ``jinja2.TemplateError`` (``raise_exception``, or a template error of its own).
    """
    when = now or datetime.now()

    def strftime_now(fmt: str) -> str:
        return when.strftime(fmt)

    context: dict[str, Any] = {
        "strftime_now": strftime_now,
        "date_string": when.strftime(DATE_STRING_FORMAT),
        "datetime": when.strftime(DATETIME_FORMAT),
        **(kwargs or {}),
    }
    try:
        return compile_template(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    except jinja2.exceptions.TemplateError:
        raise
    except Exception as exc:  # a template that fails on its own inputs (TypeError, ...)
        raise jinja2.exceptions.TemplateError(f"{type(exc).__name__}: {exc}") from exc


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
