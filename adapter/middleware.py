"""Every request passes here: its id and log context, the API key, and the one place where an error
becomes a response (System One's FastAPI-shaped 401 and 422 included), counted and logged.

Handlers raise typed errors (``arbiter.errors``) and never build an error response themselves. Once a
streamed response has started, the error is written in-band instead (``adapter.streaming``).
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import traceback
import uuid

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from adapter.state import REQUEST_LOG, STATE, RequestLog, State
from adapter.streaming import OPEN_STREAM, OpenStream
from arbiter.errors import (
    ArbiterError,
    MalformedRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
)
from arbiter.logging import get_logger

CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
_ID_KEYS = {"request_id", "request-id", "requestid", "x-request-id", "rid", "trace_id"}
_MAX_ID = 128
SYSTEMONE_PATH = "/v1/systemone"

log = get_logger("arbiter.http")


def request_id(custom_attributes: str | None, inference_id: str | None = None) -> str:
    """The request id for logs: from ``X-Amzn-SageMaker-Custom-Attributes``, else generated.

    The attributes are opaque to SageMaker; a ``request_id=...`` (or ``request-id``, ``trace_id``)
    pair in a comma- or semicolon-separated list is used, or the whole value when it is a single
    token. Then SageMaker's ``X-Amzn-SageMaker-Inference-Id``; then a random id.
    """
    if custom_attributes and custom_attributes.strip():
        for part in re.split(r"[,;]", custom_attributes):
            key, sep, value = part.partition("=")
            if sep and key.strip().lower() in _ID_KEYS and value.strip():
                return value.strip()[:_MAX_ID]
        if "=" not in custom_attributes:
            return custom_attributes.strip()[:_MAX_ID]
    if inference_id and inference_id.strip():
        return inference_id.strip()[:_MAX_ID]
    return uuid.uuid4().hex


# -- errors ----------------------------------------------------------------------------------------


# OpenAI's own routes answer a refused request with 400 (as OpenAI and llama.cpp's server do: the
# ``openai`` client raises BadRequestError for it), where Arbiter's other routes answer 422.
OPENAI_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})


def error_response(error: ArbiterError, openai: bool = False) -> web.Response:
    """``{"error": {type, code, message, param}}`` with the error's status (422 as 400 on
    ``openai`` routes), or FastAPI's ``{"detail": ...}`` for an API that speaks it;
    ``Retry-After`` on a 503, ``WWW-Authenticate`` on a 401."""
    headers = {}
    if isinstance(error, Unavailable):
        headers["Retry-After"] = str(error.retry_after)
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    body = {"detail": error.detail} if error.detail is not None else {"error": error.to_dict()}
    status = 400 if openai and error.status == 422 else error.status
    return web.json_response(body, status=status, headers=headers)


def _as_error(exc: Exception) -> ArbiterError:
    if isinstance(exc, ArbiterError):
        return exc
    if isinstance(exc, web.HTTPException):
        return _from_http(exc)
    log.error("internal_error", error=repr(exc), trace=traceback.format_exc())
    return ArbiterError("internal error; see the server log")


def _from_http(exc: web.HTTPException) -> ArbiterError:
    reason = exc.text or exc.reason
    if exc.status == 404:
        return NotFound(f"no route {reason}" if reason == "Not Found" else reason)
    if exc.status == 405:
        return MethodNotAllowed(reason)
    if exc.status == 413:
        return PayloadTooLarge(reason)
    if exc.status == 400:
        return MalformedRequest(reason)
    generic = ArbiterError(reason)
    generic.status = exc.status  # type: ignore[misc]
    return generic


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id and log context, the one error mapping, the request's metrics and log line."""
    state = request.app[STATE]
    route = _route(request)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(
        request_id=request_id(
            request.headers.get(CUSTOM_ATTRIBUTES),
            request.headers.get("X-Amzn-SageMaker-Inference-Id"),
        ),
        route=route,
    )
    info = request[REQUEST_LOG] = RequestLog()
    started = time.perf_counter()
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        _finish(state, info, route, 499, started, "client_gone")
        raise
    except ConnectionResetError:
        # A write into a stream whose client went away: theirs, not an internal error (the work
        # stops with its slot, ``adapter.admission``).
        _finish(state, info, route, 499, started, "client_gone")
        open_stream: OpenStream | None = request.get(OPEN_STREAM)
        if open_stream is None or not open_stream.response.prepared:
            raise
        open_stream.closed = True
        return open_stream.response
    except Exception as exc:
        error = _as_error(exc)
        info.extra["error"] = error.code
        stream = request.get(OPEN_STREAM)
        if stream is not None and stream.response.prepared:
            # The status line is sent: the error goes into the stream, which then ends cleanly.
            await stream.fail(error)
            info.extra["stream_error"] = error.code
            response = stream.response
        else:
            response = error_response(error, openai=route in OPENAI_ROUTES)
    _finish(state, info, route, response.status, started)
    return response


def _finish(
    state: State,
    info: RequestLog,
    route: str,
    status: int,
    started: float,
    event: str = "request",
) -> None:
    seconds = time.perf_counter() - started
    state.metrics.requests.labels(route, info.kind, str(status)).inc()
    state.metrics.request_seconds.labels(route, info.kind).observe(seconds)
    if route in ("/ping", "/metrics"):
        return  # polled constantly; counted, not logged
    log.info(
        event,
        status=status,
        kind=info.kind,
        decisions=info.decisions,
        tokens=info.tokens,
        seconds=round(seconds, 4),
        **info.extra,
    )


# -- the API key -----------------------------------------------------------------------------------


def authorized(request: web.Request, api_key: str | None) -> bool:
    """True when no key is configured, or the bearer token matches it exactly.

    Compared as UTF-8 bytes: ``hmac.compare_digest`` refuses non-ASCII ``str`` (a 500 for any
    client that sent one); aiohttp hands undecodable header bytes over as surrogate escapes.
    """
    if not api_key:
        return True
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    sent = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, api_key.encode("utf-8"))


@web.middleware
async def api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With ARBITER_API_KEY set, every compute route needs the bearer token: /v1/* and
    /invocations (unless ARBITER_API_KEY_EXEMPT_INVOCATIONS, for a SageMaker endpoint, where IAM
    guards /invocations and the Authorization header never reaches the container)."""
    s = request.app[STATE].settings
    guarded = request.path.startswith("/v1/") or (
        request.path == "/invocations" and not s.api_key_exempt_invocations
    )
    if guarded and not authorized(request, s.api_key):
        error = Unauthorized(
            "missing or invalid API key: send 'Authorization: Bearer <ARBITER_API_KEY>'",
            param="Authorization",
        )
        if request.path == SYSTEMONE_PATH:
            error.detail = error.message  # the System One API's own 401 body
        raise error
    return await handler(request)


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, streamed ones included, echoes the custom attributes (SageMaker passes the
    container's value back to the caller) and names the request id used in the logs."""
    attributes = request.headers.get(CUSTOM_ATTRIBUTES)
    if attributes is not None:
        response.headers[CUSTOM_ATTRIBUTES] = attributes
    rid = structlog.contextvars.get_contextvars().get("request_id")
    if rid:
        response.headers["X-Request-Id"] = rid
