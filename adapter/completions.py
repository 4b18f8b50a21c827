"""What a generation looks like on the wire: OpenAI's choices, log-probabilities and stream chunks,
and the server-sent events that carry them (chat and text completions alike).

A choice's ``logprobs`` is ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}``
as OpenAI writes it; the tokens of a choice join to its content exactly (``TokenLogprob``). When
streamed, each content chunk carries the log-probabilities of the tokens whose text it completes.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

from aiohttp import web
from pydantic import BaseModel

from adapter.admission import Slot
from adapter.streaming import OPEN_STREAM, OpenStream
from arbiter import jsonio
from arbiter.engine import Generation, TokenLogprob
from arbiter.engine.sampling import OnDelta
from arbiter.schema import ModelInfo

# (choice index, text, log-probabilities) as the engine hands them on; None: generation ended.
Delta = tuple[int, str, list[TokenLogprob] | None]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ContentLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ContentLogprob] | None
    refusal: list[ContentLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def fingerprint(info: ModelInfo) -> str:
    """OpenAI's ``system_fingerprint``: what a fixed ``seed`` reproduces on (the model file, the
    llama.cpp build, where and how it computes)."""
    parts = (info.sha256, info.llama_cpp_build, info.n_gpu_layers, info.threads)
    return "arbiter-" + hashlib.blake2b(repr(parts).encode(), digest_size=6).hexdigest()


def logprobs_body(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    content = [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.bytes),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in e.top
            ],
        }
        for e in entries
    ]
    return {"content": content, "refusal": None}


def chat_choices(generation: Generation) -> list[dict[str, Any]]:
    return [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": logprobs_body(c.logprobs),
            "finish_reason": c.finish_reason,
        }
        for c in generation.choices
    ]


class DeltaQueue:
    """The engine's deltas, from its thread to the event loop; ``stop()`` makes the engine's next
    hand-over return False, which ends the generation (a client that went away)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Delta | None] = asyncio.Queue()
        self._stopped = threading.Event()

    def on_delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> bool:
        if self._stopped.is_set():
            return False
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, text, logprobs))
        return True

    def end(self, _: object = None) -> None:
        """The generation ended (a future's done callback, on the loop)."""
        self._queue.put_nowait(None)

    def stop(self) -> None:
        self._stopped.set()

    async def drain(self, write: Callable[[Delta], Awaitable[None]]) -> None:
        while (item := await self._queue.get()) is not None:
            await write(item)


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    payload = data.encode() if isinstance(data, str) else jsonio.dumps(data)
    return b"data: " + payload + b"\n\n"


class Events(Protocol):
    """The chunks of one API's stream (chat.completion.chunk, text_completion)."""

    def opening(self) -> list[dict[str, Any]]: ...

    def delta(self, delta: Delta) -> dict[str, Any]: ...

    def closing(self, generation: Generation) -> list[dict[str, Any]]: ...


async def stream_events(
    request: web.Request,
    slot: Slot,
    generate: Callable[[OnDelta], Generation],
    events: Events,
    observe: Callable[[Generation], None],
) -> web.StreamResponse:
    """Server-sent events: the opening chunks, a chunk per delta as text becomes final, the
    closing chunks, ``[DONE]``. A failure after the first byte is written in-band (``streaming``);
    a client that goes away stops the generation at its next token."""
    deltas = DeltaQueue()
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    stream = OpenStream(response, lambda e: sse({"error": e.to_dict()}) + sse("[DONE]"))
    request[OPEN_STREAM] = stream
    await response.prepare(request)
    future = slot.start(lambda: generate(deltas.on_delta))
    future.add_done_callback(deltas.end)

    async def write(delta: Delta) -> None:
        await response.write(sse(events.delta(delta)))

    try:
        for body in events.opening():
            await response.write(sse(body))
        await deltas.drain(write)
        generation = future.result()  # a failure is written in-band by the middleware
        observe(generation)
        for body in events.closing(generation):
            await response.write(sse(body))
        await response.write(sse("[DONE]"))
        await stream.finish()
    finally:
        deltas.stop()
    return response
