"""Request bodies from untrusted clients: a declared type, a size limit, and no waiting forever.

Bodies are read before any compute slot is taken, and every read waits at most
``ARBITER_BODY_READ_TIMEOUT_S`` for the next bytes: a client that sends a few bytes and stalls gets a
408 instead of holding a connection (and, on the JSON Lines path, never the model).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import StreamReader, web

from arbiter import jsonio
from arbiter.errors import PayloadTooLarge, RequestTimeout, UnsupportedMediaType
from arbiter.settings import MB, ServerSettings

JSON_TYPES = {"application/json", "text/json"}
JSONL_TYPES = {
    "application/jsonlines",
    "application/jsonl",
    "application/x-jsonlines",
    "application/json-lines",
    "application/x-ndjson",
}


def require_json(request: web.Request) -> None:
    """The body must be declared as JSON: a cross-site page can POST ``text/plain`` or a form
    without a CORS preflight, never ``application/json`` (SageMaker always sends a type)."""
    ctype = request.content_type if "Content-Type" in request.headers else None
    if ctype is not None and (ctype in JSON_TYPES or ctype.endswith("+json")):
        return
    raise UnsupportedMediaType(
        (f"Content-Type {ctype!r} is not supported here" if ctype else "Content-Type is missing")
        + "; send application/json (or application/jsonlines to /invocations)",
        param="Content-Type",
    )


async def _next(stream: StreamReader, idle_s: float) -> bytes:
    try:
        async with asyncio.timeout(idle_s):
            return await stream.readany()
    except TimeoutError:
        raise RequestTimeout(
            f"no body bytes for {idle_s:g} s (ARBITER_BODY_READ_TIMEOUT_S); send the body "
            "without pauses"
        ) from None


async def read_body(request: web.Request, limit: int, idle_s: float, setting: str) -> bytes:
    """The whole body, at most ``limit`` bytes (``setting`` names the limit in the error)."""
    too_large = f"the body is over {limit / MB:g} MB ({setting})"
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(too_large)
    parts: list[bytes] = []
    total = 0
    while data := await _next(request.content, idle_s):
        total += len(data)
        if total > limit:
            raise PayloadTooLarge(too_large)
        parts.append(data)
    return b"".join(parts)


async def read_json(request: web.Request, settings: ServerSettings) -> bytes:
    """A JSON body, declared as such, within ARBITER_MAX_BODY_MB, sent without stalling."""
    require_json(request)
    limit = int(settings.max_body_mb * MB)
    return await read_body(request, limit, settings.body_read_timeout_s, "ARBITER_MAX_BODY_MB")


async def json_body(request: web.Request, settings: ServerSettings) -> Any:
    """The parsed JSON body (parsed off the event loop: a 6 MB body takes a while)."""
    return await asyncio.to_thread(jsonio.loads, await read_json(request, settings))


async def body_pieces(stream: StreamReader, max_total: int, idle_s: float) -> AsyncIterator[bytes]:
    """A streamed body's bytes as they arrive, without holding it.

    Raises ``PayloadTooLarge`` past ``max_total`` bytes (after the bytes within the limit, so the
    lines they complete are still answered) and ``RequestTimeout`` when the client stalls.
    """
    total = 0
    while data := await _next(stream, idle_s):
        total += len(data)
        if total > max_total:
            yield data[: len(data) - (total - max_total)]
            raise PayloadTooLarge(
                f"the body is over {max_total / MB:g} MB (ARBITER_MAX_JSONL_MB); the lines "
                "before this point were answered"
            )
        yield data
