"""OpenAI chat completions (`POST /v1/chat/completions`, and ``messages`` on `/invocations`): wire
models, the handler, server-sent events.

The prompt is the model's own chat template around the messages (``arbiter.prompt.render_chat``),
rendered and tokenized off the event loop inside the request's admission slot, after the messages'
floor from bytes is checked against the context (``arbiter.engine.cost``): a 5 MB message is
refused in microseconds and never holds the tokenizer. Message text can never become a control
token. A model without a chat template (the default Gemma base model) gets a plain ``role:
content`` transcript.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from adapter import budgets
from adapter.admission import Slot
from adapter.bodies import json_body
from adapter.completions import (
    ChatChoice,
    Delta,
    Usage,
    chat_choices,
    fingerprint,
    logprobs_body,
    stream_events,
    usage,
)
from adapter.openapi import JSON, SSE_EVENT, Operation
from adapter.parameters import GenerationArgs, GenerationFields, generation_args, refuse_unsupported
from adapter.state import REQUEST_LOG, STATE, RequestLog, State
from arbiter.engine import Engine, Generation
from arbiter.errors import ContextLengthExceeded, InvalidDecision, UnsupportedParameter
from arbiter.lines import validation_error
from arbiter.prompt import PLAIN_STOPS, Segments, render_chat
from arbiter.schema import Text
from arbiter.templates import caller_kwargs

# More messages than any context here can hold (each costs a few template tokens at least); the
# cap keeps a 6 MB body from becoming minutes of validation and template rendering.
MAX_MESSAGES = 1024


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """A message: its role, its content (null only on an assistant message, as OpenAI allows),
    and its ``name`` (given to the chat template). Any other field is refused by name unless it
    is null or empty (``refusal: null``, ``tool_calls: []``: what a client echoes back of a reply)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    @model_validator(mode="after")
    def _null_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content may be null on an assistant message only, not {self.role}")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def unsupported(self) -> list[str]:
        """The fields set that this server does not honour (``tool_calls``, ``audio``, ...)."""
        return [k for k, v in (self.model_extra or {}).items() if v not in (None, [], {}, "")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(GenerationFields):
    """The OpenAI request: messages, and the generation fields (``adapter.parameters``). A field
    that is neither is refused by name (``unsupported_parameter``), never ignored."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # The chat template's keywords, as llama.cpp's server takes them (``templates.caller_kwargs``).
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description='Passed to the chat template, e.g. {"enable_thinking": false}.'
    )
    reasoning_effort: Text | None = Field(
        default=None, description='Passed to the template; "none" turns thinking off.'
    )
    enable_thinking: bool | None = Field(
        default=None, description="The template's thinking switch (unset: the template's default)."
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        caller_kwargs(value)
        return value

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return caller_kwargs(self.chat_template_kwargs, self.reasoning_effort, self.enable_thinking)


# -- prompt ----------------------------------------------------------------------------------------


def render(
    messages: list[ChatMessage],
    template: str | None,
    bos_text: str,
    eos_text: str,
    template_kwargs: dict[str, Any] | None = None,
    prefill: bool = True,
) -> Segments:
    """The prompt as (text, is_template) segments, ending where the assistant's reply starts, or,
    with ``prefill`` and a last assistant message, inside it (``arbiter.prompt.render_chat``)."""
    pairs = [(m.role, m.text) for m in messages]
    names = [m.name for m in messages]
    return render_chat(
        pairs, template, bos_text, eos_text, template_kwargs, names=names, prefill=prefill
    )


# -- responses -------------------------------------------------------------------------------------


class ChatCompletion(BaseModel):
    """An OpenAI chat completion (chat.completion.chunk events when streamed)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


OPERATION = Operation(
    summary="OpenAI chat completions (same as /invocations with messages)",
    request={JSON: ChatCompletionRequest},
    ok="A chat completion, or server-sent events when stream is true",
    ok_bodies={JSON: ChatCompletion, "text/event-stream": SSE_EVENT},
    errors=(400, 401, 408, 413, 415, 500, 503),
)


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion(cid: str, model: str, generation: Generation, system: str) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": system,
        "choices": chat_choices(generation),
        "usage": usage(generation.prompt_tokens, generation.completion_tokens),
    }


def chunk(
    cid: str,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    *,
    choices: bool = True,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    system: str | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    body: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": system,
        "choices": [choice] if choices else [],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


# -- the handler -----------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await json_body(request, state.settings)
    if not isinstance(raw, dict):
        raise InvalidDecision("the body must be a JSON object", code="invalid_type")
    request[REQUEST_LOG].kind = "messages"
    return await respond(request, state, raw)


def _request(raw: dict[str, Any]) -> ChatCompletionRequest:
    refuse_unsupported(raw, ChatCompletionRequest)
    try:
        parsed = ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    for i, message in enumerate(parsed.messages):
        for key in message.unsupported():
            raise UnsupportedParameter(
                f"messages[{i}].{key} is not supported: messages carry role, content and name",
                param=f"messages.{i}.{key}",
            )
    return parsed


async def respond(request: web.Request, state: State, raw: dict[str, Any]) -> web.StreamResponse:
    """A chat completion for a parsed body (this route's, or ``messages`` on /invocations)."""
    chat_request = await asyncio.to_thread(_request, raw)
    engine = state.holder.require()
    engine.cost.check_chat([m.text for m in chat_request.messages])  # before it takes a slot

    def prompt() -> np.ndarray:
        # Off the event loop: a template over hundreds of messages takes a while to render.
        segments = render(
            chat_request.messages,
            engine.chat_template,
            engine.bos_text,
            engine.eos_text,
            chat_request.template_kwargs,
            state.settings.chat_prefill_assistant,
        )
        return engine.encode_segments(segments)

    extra_stops = [] if engine.chat_template else PLAIN_STOPS
    model = chat_request.model or engine.model_info.file
    info = request[REQUEST_LOG]
    async with state.admission.slot() as slot:
        tokens = await slot.run(prompt)  # tokenized within the in-flight bound
        if len(tokens) >= engine.n_ctx:
            raise ContextLengthExceeded(
                f"the messages are {len(tokens)} tokens; the context holds {engine.n_ctx} tokens",
                param="messages",
            )
        # The grammar compiles against the vocabulary: within the in-flight bound too.
        args = await slot.run(
            generation_args,
            chat_request,
            engine,
            state.settings.chat_max_tokens,
            extra_stops,
            budgets.limits(state.settings, engine, slot),
        )
        if chat_request.stream:
            usage_ = bool(chat_request.stream_options and chat_request.stream_options.include_usage)
            return await _stream(request, state, slot, engine, tokens, args, model, usage_)
        generation: Generation = await slot.run(lambda: engine.generate(tokens, **args.kwargs()))
    _observe(state, info, generation)
    body = completion(completion_id(), model, generation, fingerprint(engine.model_info))
    return web.json_response(body)


def _observe(state: State, info: RequestLog, generation: Generation) -> None:
    info.tokens = generation.prompt_tokens + generation.completion_tokens
    info.extra["finish_reason"] = generation.finish_reason
    state.metrics.prompt_tokens.observe(generation.prompt_tokens)
    state.metrics.prefill_seconds.observe(generation.prefill_s)
    state.metrics.completion_tokens.inc(generation.completion_tokens)


async def _stream(
    request: web.Request,
    state: State,
    slot: Slot,
    engine: Engine,
    tokens: np.ndarray,
    args: GenerationArgs,
    model: str,
    include_usage: bool,
) -> web.StreamResponse:
    """Server-sent events: a role chunk per choice, content chunks as text becomes final (with
    their tokens' log-probabilities when asked for), a finish chunk per choice."""
    events = _ChatEvents(completion_id(), model, fingerprint(engine.model_info), args.n)
    events.include_usage = include_usage
    return await stream_events(
        request,
        slot,
        lambda on_delta: engine.generate(tokens, on_delta=on_delta, **args.kwargs()),
        events,
        lambda generation: _observe(state, request[REQUEST_LOG], generation),
    )


@dataclass
class _ChatEvents:
    cid: str
    model: str
    system: str
    n: int
    include_usage: bool = False

    def opening(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [
            chunk(self.cid, self.model, role, index=i, system=self.system) for i in range(self.n)
        ]

    def delta(self, delta: Delta) -> dict[str, Any]:
        index, text, logprobs = delta
        content = {"content": text}
        return chunk(
            self.cid,
            self.model,
            content,
            index=index,
            system=self.system,
            logprobs=logprobs_body(logprobs),
        )

    def closing(self, generation: Generation) -> list[dict[str, Any]]:
        bodies = [
            chunk(self.cid, self.model, {}, c.finish_reason, index=c.index, system=self.system)
            for c in generation.choices
        ]
        if self.include_usage:
            counts = usage(generation.prompt_tokens, generation.completion_tokens)
            bodies.append(chunk(self.cid, self.model, {}, None, counts, choices=False))
        return bodies
