"""OpenAI chat completions (`POST /v1/chat/completions`, and ``messages`` on `/invocations`): wire
models, the handler, server-sent events.

The prompt is the model's own chat template around the messages (``arbiter.prompt.render_chat``),
rendered off the event loop; message text can never become a control token. A model without a chat
template (the default Gemma base model) gets a plain ``role: content`` transcript.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any, Literal

import numpy as np
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from adapter.admission import Slot
from adapter.bodies import json_body
from adapter.openapi import JSON, SSE_EVENT, Operation
from adapter.state import REQUEST_LOG, STATE, RequestLog, State
from adapter.streaming import OPEN_STREAM, OpenStream
from arbiter import jsonio
from arbiter.engine import Engine, Generation
from arbiter.errors import ContextLengthExceeded, InvalidDecision
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
    # The chat template's keywords, as llama.cpp's server takes them (``templates.caller_kwargs``).
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Passed to the chat template, e.g. {\"enable_thinking\": false}."
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


def render(
    messages: list[ChatMessage],
    template: str | None,
    bos_text: str,
    eos_text: str,
    template_kwargs: dict[str, Any] | None = None,
) -> Segments:
    """The prompt as (text, is_template) segments, ending where the assistant's reply starts
    (``arbiter.prompt.render_chat``)."""
    pairs = [(m.role, m.text) for m in messages]
    return render_chat(pairs, template, bos_text, eos_text, template_kwargs)


# -- responses -------------------------------------------------------------------------------------


class ChatCompletion(BaseModel):
    """An OpenAI chat completion (chat.completion.chunk events when streamed)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int]


OPERATION = Operation(
    summary="OpenAI chat completions (same as /invocations with messages)",
    request={JSON: ChatCompletionRequest},
    ok="A chat completion, or server-sent events when stream is true",
    ok_bodies={JSON: ChatCompletion, "text/event-stream": SSE_EVENT},
    errors=(400, 401, 408, 413, 415, 422, 500, 503),
)


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
    return ChatCompletion(
        id=cid,
        object="chat.completion",
        created=int(time.time()),
        model=model,
        choices=[
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        ],
        usage=usage(prompt_tokens, completion_tokens),
    ).model_dump()


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


# -- the handler -----------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await json_body(request, state.settings)
    if not isinstance(raw, dict):
        raise InvalidDecision("the body must be a JSON object", code="invalid_type")
    request[REQUEST_LOG].kind = "messages"
    return await respond(request, state, raw)


def _request(raw: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc


async def respond(request: web.Request, state: State, raw: dict[str, Any]) -> web.StreamResponse:
    """A chat completion for a parsed body (this route's, or ``messages`` on /invocations)."""
    chat_request = await asyncio.to_thread(_request, raw)
    engine = state.holder.require()

    def prompt() -> np.ndarray:
        # Off the event loop: a template over hundreds of messages takes a while to render.
        segments = render(
            chat_request.messages,
            engine.chat_template,
            engine.bos_text,
            engine.eos_text,
            chat_request.template_kwargs,
        )
        return engine.encode_segments(segments)

    tokens = await asyncio.to_thread(prompt)
    if len(tokens) >= engine.n_ctx:
        raise ContextLengthExceeded(
            f"the messages are {len(tokens)} tokens; the context holds {engine.n_ctx} tokens",
            param="messages",
        )
    stops = chat_request.stops + ([] if engine.chat_template else PLAIN_STOPS)
    options: dict[str, Any] = {
        "max_tokens": chat_request.token_limit(state.settings.chat_max_tokens),
        "temperature": chat_request.temperature,
        "top_p": chat_request.top_p,
        "stop": stops,
        "seed": chat_request.seed,
    }
    model = chat_request.model or engine.model_info.file
    info = request[REQUEST_LOG]
    async with state.admission.slot() as slot:
        if chat_request.stream:
            usage_ = bool(chat_request.stream_options and chat_request.stream_options.include_usage)
            return await _stream(request, state, slot, engine, tokens, options, model, usage_)
        generation: Generation = await slot.run(lambda: engine.generate(tokens, **options))
    _observe(state, info, generation)
    body = completion(
        completion_id(),
        model,
        generation.text,
        generation.finish_reason,
        generation.prompt_tokens,
        generation.completion_tokens,
    )
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
    options: dict[str, Any],
    model: str,
    include_usage: bool,
) -> web.StreamResponse:
    """Server-sent events: a role chunk, content chunks as text becomes final, a finish chunk."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | None] = asyncio.Queue()  # None: the generation ended
    stopped = threading.Event()

    def on_text(text: str) -> bool:
        if stopped.is_set():
            return False
        loop.call_soon_threadsafe(queue.put_nowait, text)
        return True

    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    stream = OpenStream(response, lambda e: sse({"error": e.to_dict()}) + sse("[DONE]"))
    request[OPEN_STREAM] = stream
    await response.prepare(request)
    cid = completion_id()
    future = slot.start(lambda: engine.generate(tokens, on_text=on_text, **options))
    future.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        await response.write(sse(chunk(cid, model, {"role": "assistant", "content": ""})))
        while (item := await queue.get()) is not None:
            await response.write(sse(chunk(cid, model, {"content": item})))
        generation = future.result()  # a failure is written in-band by the middleware
        _observe(state, request[REQUEST_LOG], generation)
        await response.write(sse(chunk(cid, model, {}, generation.finish_reason)))
        if include_usage:
            counts = usage(generation.prompt_tokens, generation.completion_tokens)
            await response.write(sse(chunk(cid, model, {}, None, counts, choices=False)))
        await response.write(sse("[DONE]"))
        await stream.finish()
    finally:
        stopped.set()  # a client that went away stops the generation at its next token
    return response
