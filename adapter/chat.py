"""OpenAI chat completions: wire models, prompt rendering with the model's chat template, SSE.

The prompt is the model's own chat template (jinja, as llama.cpp's server renders it) around the
messages. Message text is kept apart from template text so that it is tokenized without special-token
parsing: a message can never become a control token. A model without a chat template (the default
Gemma base model) gets a plain ``role: content`` transcript ending in ``assistant:``.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from typing import Any, Literal

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, field_validator

from arbiter import jsonio
from arbiter.errors import InvalidDecision
from arbiter.schema import Text

Segments = list[tuple[str, bool]]  # (text, is_template_text)
# More messages than any context here can hold (each costs a few template tokens at least); the
# cap keeps a 6 MB body from becoming minutes of validation and template rendering.
MAX_MESSAGES = 1024


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The OpenAI request fields Arbiter honours; other OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    n: int = Field(default=1, ge=1, le=1, description="Only one choice is generated.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


# -- prompt ----------------------------------------------------------------------------------------

PLAIN_STOPS = ["\nuser:", "\nsystem:"]


_MARK = "\u0000ARBITER_MESSAGE_{}\u0000"
_MARKS = re.compile("\u0000ARBITER_MESSAGE_([0-9]+)\u0000")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=4)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render(
    messages: list[ChatMessage], template: str | None, bos_text: str, eos_text: str
) -> Segments:
    """The prompt as (text, is_template) segments, ending where the assistant's reply starts.

    Each message enters the template as a numbered mark; one pass over the rendered text splits
    it at the marks and checks that every message is placed exactly once (linear in the text:
    a check per message over the whole text was quadratic in the number of messages).
    """
    if not template:
        return _plain(messages)
    roles = [("system" if m.role == "developer" else m.role) for m in messages]
    try:
        text = _compiled(template).render(
            messages=[{"role": r, "content": _MARK.format(i)} for i, r in enumerate(roles)],
            add_generation_prompt=True,
            bos_token=bos_text,
            eos_token=eos_text,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidDecision(
            f"the model's chat template refused these messages: {exc}",
            param="messages",
            code="chat_template_error",
        ) from exc
    placed = [0] * len(messages)
    segments: Segments = []
    end = 0
    for match in _MARKS.finditer(text):
        index = int(match.group(1))
        if index >= len(placed):
            placed.append(0)  # not a mark of ours: fails the check below
            break
        placed[index] += 1
        if match.start() > end:
            segments.append((text[end : match.start()], True))
        segments.append((messages[index].text, False))
        end = match.end()
    if end < len(text):
        segments.append((text[end:], True))
    if any(count != 1 for count in placed):
        raise InvalidDecision(
            "the model's chat template does not place every message exactly once",
            param="messages",
            code="chat_template_error",
        )
    return segments


def _plain(messages: list[ChatMessage]) -> Segments:
    lines = [f"{'system' if m.role == 'developer' else m.role}: {m.text.strip()}" for m in messages]
    return [("\n".join(lines) + "\nassistant:", False)]


# -- responses -------------------------------------------------------------------------------------


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    cid: str, model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk(
    cid: str,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    *,
    choices: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": (
            [{"index": 0, "delta": delta, "finish_reason": finish_reason}] if choices else []
        ),
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    payload = data.encode() if isinstance(data, str) else jsonio.dumps(data)
    return b"data: " + payload + b"\n\n"
