"""OpenAI text completions (`POST /v1/completions`): the chat path's sampler chain over a raw
prompt.

The prompt is the caller's whole text, so it is tokenized as llama.cpp's server does it: special
tokens written in it are parsed (a caller may write a chat template by hand), and BOS is added if
the model wants one. ``logprobs`` is the legacy API's number of alternatives (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adapter import budgets
from adapter.bodies import json_body
from adapter.completions import Delta, Usage, fingerprint, stream_events, usage
from adapter.openapi import JSON, SSE_EVENT, Operation
from adapter.parameters import GenerationFields, generation_args, refuse_unsupported
from adapter.state import REQUEST_LOG, STATE
from arbiter.engine import Generation, TokenLogprob
from arbiter.engine.sampling import MAX_TOP_LOGPROBS
from arbiter.errors import ContextLengthExceeded, InvalidDecision, UnsupportedParameter
from arbiter.lines import validation_error
from arbiter.schema import Text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CompletionRequest(GenerationFields):
    """The legacy OpenAI request: a prompt and the generation fields (``adapter.parameters``)."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Text = Field(min_length=1)
    logprobs: int | None = Field(  # type: ignore[assignment]
        default=None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per token (0-20)."
    )
    echo: bool = Field(default=False, description="The prompt before the completion.")
    best_of: int | None = Field(default=None, ge=1, description="Only best_of = n.")
    stream: bool = False
    stream_options: StreamOptions | None = None


class TextChoice(BaseModel):
    text: str
    index: int
    logprobs: dict[str, Any] | None = None
    finish_reason: str


class TextCompletion(BaseModel):
    """An OpenAI text completion (text_completion events when streamed)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[TextChoice]
    usage: Usage


OPERATION = Operation(
    summary="OpenAI text completions: the chat path's sampling over a raw prompt",
    request={JSON: CompletionRequest},
    ok="A text completion, or server-sent events when stream is true",
    ok_bodies={JSON: TextCompletion, "text/event-stream": SSE_EVENT},
    errors=(400, 401, 408, 413, 415, 500, 503),
)


def legacy_logprobs(entries: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": [offset + e.start for e in entries],
    }


def _request(raw: Any) -> CompletionRequest:
    if not isinstance(raw, dict):
        raise InvalidDecision("the body must be a JSON object", code="invalid_type")
    refuse_unsupported(raw, CompletionRequest)
    if raw.get("top_logprobs") is not None:
        raise UnsupportedParameter(
            "top_logprobs: text completions take logprobs as the number of alternatives",
            param="top_logprobs",
        )
    try:
        body = CompletionRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    if body.best_of not in (None, body.n):
        raise UnsupportedParameter("best_of: only best_of equal to n", param="best_of")
    if body.echo and body.logprobs is not None:
        raise UnsupportedParameter(
            "echo: with logprobs it needs the logits of every prompt position; not computed",
            param="echo",
        )
    return body


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await json_body(request, state.settings)
    request[REQUEST_LOG].kind = "completion"
    body = await asyncio.to_thread(_request, raw)
    engine = state.holder.require()
    engine.cost.check_chat([body.prompt], param="prompt")  # before it takes a slot
    # The legacy logprobs is a count; generation_args reads the chat API's pair.
    fields = body.model_copy(
        update={"logprobs": body.logprobs is not None, "top_logprobs": body.logprobs}
    )
    events = _TextEvents(
        f"cmpl-{uuid.uuid4().hex}",
        body.model or engine.model_info.file,
        fingerprint(engine.model_info),
        body.prompt if body.echo else "",
        body.n,
    )

    def observe(generation: Generation) -> None:
        info = request[REQUEST_LOG]
        info.tokens = generation.prompt_tokens + generation.completion_tokens
        state.metrics.prompt_tokens.observe(generation.prompt_tokens)
        state.metrics.prefill_seconds.observe(generation.prefill_s)
        state.metrics.completion_tokens.inc(generation.completion_tokens)

    async with state.admission.slot() as slot:
        # Tokenized, and the grammar compiled, within the in-flight bound (as chat is).
        tokens = await slot.run(engine.encode_segments, [(body.prompt, True)])
        if len(tokens) >= engine.n_ctx:
            raise ContextLengthExceeded(
                f"the prompt is {len(tokens)} tokens; the context holds {engine.n_ctx} tokens",
                param="prompt",
            )
        args = await slot.run(
            generation_args,
            fields,
            engine,
            state.settings.chat_max_tokens,
            [],
            budgets.limits(state.settings, engine, slot),
        )
        if body.stream:
            events.include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream_events(
                request,
                slot,
                lambda on_delta: engine.generate(tokens, on_delta=on_delta, **args.kwargs()),
                events,
                observe,
            )
        generation = await slot.run(lambda: engine.generate(tokens, **args.kwargs()))
    observe(generation)
    return web.json_response(events.whole(generation))


@dataclass
class _TextEvents:
    cid: str
    model: str
    system: str
    echo: str
    n: int
    include_usage: bool = False

    def _body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.cid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "system_fingerprint": self.system,
            "choices": choices,
        }

    def whole(self, generation: Generation) -> dict[str, Any]:
        body = self._body(
            [
                {
                    "text": self.echo + c.text,
                    "index": c.index,
                    "logprobs": legacy_logprobs(c.logprobs, len(self.echo)),
                    "finish_reason": c.finish_reason,
                }
                for c in generation.choices
            ]
        )
        body["usage"] = usage(generation.prompt_tokens, generation.completion_tokens)
        return body

    def opening(self) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        return [
            self._body([{"text": self.echo, "index": i, "logprobs": None, "finish_reason": None}])
            for i in range(self.n)
        ]

    def delta(self, delta: Delta) -> dict[str, Any]:
        index, text, logprobs = delta
        choice = {"text": text, "index": index, "logprobs": legacy_logprobs(logprobs, 0)}
        return self._body([{**choice, "finish_reason": None}])

    def closing(self, generation: Generation) -> list[dict[str, Any]]:
        bodies = [
            self._body(
                [{"text": "", "index": c.index, "logprobs": None, "finish_reason": c.finish_reason}]
            )
            for c in generation.choices
        ]
        if self.include_usage:
            end = self._body([])
            end["usage"] = usage(generation.prompt_tokens, generation.completion_tokens)
            bodies.append(end)
        return bodies
