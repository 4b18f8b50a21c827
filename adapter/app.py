"""The HTTP service: a SageMaker inference container and a local decision API (aiohttp).

``create_app(settings, engine_factory)`` builds the app; the engine is loaded in a thread at start-up
(``/ping`` answers 503 until it is ready) and every model call runs off the event loop through the
admission control (``adapter.admission``). Errors become ``{"error": {...}}`` in one middleware.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import structlog
from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler
from pydantic import ValidationError

from adapter import chat, execution, systemone_http
from adapter.admission import Admission, Slot
from adapter.bodies import JSONL_TYPES, MB, read_body, require_json
from adapter.jsonlines_http import LinesResponse
from adapter.metrics import Metrics
from adapter.streaming import OPEN_STREAM, OpenStream
from arbiter import jsonio
from arbiter.engine import Engine, Generation
from arbiter.errors import (
    ArbiterError,
    ContextLengthExceeded,
    InvalidDecision,
    MalformedRequest,
    MethodNotAllowed,
    ModelNotReady,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
)
from arbiter.lines import validation_error
from arbiter.logging import get_logger, request_id
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.settings import ServerSettings
from arbiter.systemone import SystemOneInvalid

OPENAPI_PATH = Path(__file__).with_name("openapi.json")
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"

log = get_logger("arbiter.http")


class EngineHolder:
    """Owns the engine's lifetime: loaded in a thread at start-up, closed at shutdown."""

    def __init__(self, factory: Callable[[], Engine]) -> None:
        self._factory = factory
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.loaded = asyncio.Event()

    async def load(self) -> None:
        started = time.perf_counter()
        try:
            self.engine = await asyncio.to_thread(self._factory)
        except Exception as exc:
            self.error = exc
            log.error("model_load_failed", error=str(exc), exc_info=True)
        else:
            log.info(
                "model_loaded",
                model=self.engine.model_info.file,
                seconds=round(time.perf_counter() - started, 3),
            )
        finally:
            self.loaded.set()

    def require(self) -> Engine:
        if self.engine is not None:
            return self.engine
        if self.error is not None:
            raise (
                self.error
                if isinstance(self.error, ArbiterError)
                else ArbiterError(f"the model failed to load: {self.error}")
            )
        raise ModelNotReady("the model is still loading; retry shortly", retry_after=1)


@dataclass
class State:
    settings: ServerSettings
    holder: EngineHolder
    admission: Admission
    metrics: Metrics
    openapi: bytes
    batch_payload_mb: int | None = None  # measured once (adapter.execution)
    warming: bool = False  # /ping waits for the start-up measurement under Batch Transform
    sizing: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class RequestLog:
    """What one request did, for its log line and metrics (filled in by the handler)."""

    kind: str = "-"
    decisions: int = 0
    tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


STATE = web.AppKey("state", State)
CLOSE_ENGINE = web.AppKey("close_engine", bool)
REQUEST_LOG = web.RequestKey("request_log", RequestLog)


# -- errors, headers, logging --------------------------------------------------------------------


def error_response(error: ArbiterError) -> web.Response:
    headers = {}
    if isinstance(error, Unavailable):
        headers["Retry-After"] = str(error.retry_after)
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response({"error": error.to_dict()}, status=error.status, headers=headers)


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
async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
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
    except Exception as exc:
        error = _as_error(exc)
        stream = request.get(OPEN_STREAM)
        if stream is not None and stream.response.prepared:
            # The status line is sent: the error goes into the stream, which then ends cleanly.
            await stream.fail(error)
            info.extra["stream_error"] = error.code
            response = stream.response
        else:
            response = error_response(error)
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


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    # Every response, streamed ones included, echoes the custom attributes (SageMaker passes the
    # container's value back to the caller) and names the request id used in the logs.
    attributes = request.headers.get(CUSTOM_ATTRIBUTES)
    if attributes is not None:
        response.headers[CUSTOM_ATTRIBUTES] = attributes
    rid = structlog.contextvars.get_contextvars().get("request_id")
    if rid:
        response.headers["X-Request-Id"] = rid


# -- small routes ------------------------------------------------------------------------------


async def ping(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.holder.require()
    if state.warming:
        raise ModelNotReady("measuring this machine's speed for Batch Transform", retry_after=1)
    return web.json_response({"status": "ok"})


async def execution_parameters(request: web.Request) -> web.Response:
    state = request.app[STATE]
    s = state.settings
    return web.json_response(
        {
            "MaxConcurrentTransforms": s.max_in_flight,
            "BatchStrategy": "MULTI_RECORD",
            "MaxPayloadInMB": s.batch_max_payload_mb or await _batch_payload(state),
        }
    )


async def _batch_payload(state: State) -> int:
    """MaxPayloadInMB from this machine's measured speed, measured once under a compute slot."""
    async with state.sizing:
        if state.batch_payload_mb is None:
            engine = state.holder.require()
            async with state.admission.slot() as slot:
                speed = await slot.run(execution.measure, engine)
            timeout_s = state.settings.batch_invocation_timeout_s
            state.batch_payload_mb = execution.payload_mb(speed, timeout_s)
            fits = (
                state.batch_payload_mb * speed.seconds_per_mb <= timeout_s * execution.BUDGET_SHARE
            )
            (log.info if fits else log.warning)(
                "batch_payload_sized",
                max_payload_mb=state.batch_payload_mb,
                seconds_per_mb=round(speed.seconds_per_mb, 1),
                lines_per_s=round(speed.lines_per_s, 2),
                invocation_timeout_s=timeout_s,
                fits=fits,
                advice=None
                if fits
                else "raise ModelClientConfig.InvocationsTimeoutInSeconds (at most 3600) and "
                "ARBITER_BATCH_INVOCATION_TIMEOUT_S to match",
            )
        return state.batch_payload_mb


async def models(request: web.Request) -> web.Response:
    engine = request.app[STATE].holder.require()
    info = engine.model_info
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": info.file,
                    "object": "model",
                    "created": 0,
                    "owned_by": "arbiter",
                    "meta": info.model_dump(),
                }
            ],
            # The TypeSafe SDK's models.list() reads this key.
            "models": systemone_http.models_listing(engine),
        }
    )


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].openapi, content_type="application/json")


# -- /invocations ------------------------------------------------------------------------------


async def invocations(request: web.Request) -> web.StreamResponse:
    """Dispatch on the content type, then on the body: decision, decisions or messages."""
    state = request.app[STATE]
    if "Content-Type" in request.headers and request.content_type in JSONL_TYPES:
        request[REQUEST_LOG].kind = "jsonlines"
        return await _jsonlines(request, state)
    raw = await _json_body(request, state)
    if not isinstance(raw, dict):
        raise InvalidDecision(
            "the body must be a JSON object with one of: decision, decisions, messages",
            code="invalid_type",
        )
    kinds = [key for key in ("decision", "decisions", "messages") if key in raw]
    if not kinds and isinstance(raw.get("questions"), dict):
        request[REQUEST_LOG].kind = "systemone"
        return await _systemone(request, state, raw)
    if len(kinds) != 1:
        raise InvalidDecision(
            "the body must have exactly one of: decision, decisions, messages "
            "(or a System One questions map)" + (f" (found {', '.join(kinds)})" if kinds else ""),
            param=None,
            code="unknown_request_shape",
        )
    request[REQUEST_LOG].kind = kinds[0]
    if kinds[0] == "decision":
        return await _single(request, state, raw)
    if kinds[0] == "decisions":
        return await _many(request, state, raw)
    return await _chat(request, state, raw)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await _json_body(request, state)
    if not isinstance(raw, dict):
        raise InvalidDecision("the body must be a JSON object", code="invalid_type")
    request[REQUEST_LOG].kind = "messages"
    return await _chat(request, state, raw)


async def _read_json_body(request: web.Request, state: State) -> bytes:
    """A JSON body, declared as such, within ARBITER_MAX_BODY_MB, sent without stalling."""
    require_json(request)
    s = state.settings
    return await read_body(
        request, int(s.max_body_mb * MB), s.body_read_timeout_s, "ARBITER_MAX_BODY_MB"
    )


async def _json_body(request: web.Request, state: State) -> Any:
    return await asyncio.to_thread(jsonio.loads, await _read_json_body(request, state))


def _validate(raw: Any, prefix: str) -> DecisionRequest:
    if not isinstance(raw, dict):
        raise InvalidDecision(f"{prefix} must be a JSON object", param=prefix, code="invalid_type")
    try:
        return DecisionRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc, prefix) from exc


async def _single(request: web.Request, state: State, raw: dict[str, Any]) -> web.Response:
    decision = _validate(raw["decision"], "decision")
    engine = state.holder.require()
    request[REQUEST_LOG].decisions = 1

    def work() -> tuple[DecisionResult | ArbiterError, bytes]:
        outcome = engine.score([decision])[0]
        state.metrics.observe_decision(outcome)
        if isinstance(outcome, ArbiterError):
            return outcome, b""
        return outcome, jsonio.dumps({"result": outcome.model_dump()})

    async with state.admission.slot() as slot:
        outcome, body = await slot.run(work)
    if isinstance(outcome, ArbiterError):
        raise outcome.with_param_prefix("decision")
    request[REQUEST_LOG].tokens = outcome.prompt.input_tokens
    return web.Response(body=body, content_type="application/json")


def _validate_many(raw: Any, limit: int) -> list[DecisionRequest]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= limit:
        raise InvalidDecision(
            f"decisions must be an array of 1 to {limit} decisions (ARBITER_MAX_DECISIONS)",
            param="decisions",
            code="invalid_batch_size",
        )
    decisions = [_validate(item, f"decisions.{i}") for i, item in enumerate(raw)]
    seen: set[str] = set()
    for i, decision in enumerate(decisions):
        if decision.id in seen:
            raise InvalidDecision(
                f"decisions.{i}.id: duplicate id {decision.id!r}; ids must be unique in a request",
                param=f"decisions.{i}.id",
                code="duplicate_id",
            )
        seen.add(decision.id)
    return decisions


async def _many(request: web.Request, state: State, raw: dict[str, Any]) -> web.Response:
    arrived = time.perf_counter()
    decisions = await asyncio.to_thread(
        _validate_many, raw["decisions"], state.settings.max_decisions
    )
    engine = state.holder.require()
    request[REQUEST_LOG].decisions = len(decisions)

    def work() -> tuple[list[DecisionResult | ArbiterError], float]:
        started = time.perf_counter()
        outcomes = engine.score(decisions)
        for outcome in outcomes:
            state.metrics.observe_decision(outcome)
        return outcomes, time.perf_counter() - started

    async with state.admission.slot() as slot:
        admitted = time.perf_counter()
        outcomes, engine_s = await slot.run(work)
    failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, ArbiterError)]
    if len(failed) == len(outcomes):
        index, first = failed[0]
        raise first.with_param_prefix(f"decisions.{index}")
    request[REQUEST_LOG].tokens = sum(
        o.prompt.input_tokens for o in outcomes if isinstance(o, DecisionResult)
    )
    results = [
        {"id": d.id, "error": o.with_param_prefix(f"decisions.{i}").to_dict()}
        if isinstance(o, ArbiterError)
        else o.model_dump()
        for i, (d, o) in enumerate(zip(decisions, outcomes, strict=True))
    ]
    timing = {
        "decisions": len(decisions),
        "failed": len(failed),
        "queue_s": admitted - arrived,
        "engine_s": engine_s,
        "total_s": time.perf_counter() - arrived,
    }
    body = await asyncio.to_thread(jsonio.dumps, {"results": results, "timing": timing})
    return web.Response(body=body, content_type="application/json")


# -- System One --------------------------------------------------------------------------------


async def systemone_route(request: web.Request) -> web.Response:
    """`POST /v1/systemone`: the TypeSafe System One API, 422s in FastAPI's shape."""
    state = request.app[STATE]
    request[REQUEST_LOG].kind = "systemone"
    body = await _read_json_body(request, state)
    try:
        raw = await asyncio.to_thread(systemone_http.parse_body, body)
    except SystemOneInvalid as exc:
        return systemone_http.invalid(exc)
    return await _systemone(request, state, raw)


async def _systemone(request: web.Request, state: State, raw: Any) -> web.Response:
    engine = state.holder.require()
    try:
        async with state.admission.slot() as slot:
            body, questions, tokens = await systemone_http.answer(raw, engine, slot.run)
    except SystemOneInvalid as exc:
        return systemone_http.invalid(exc)
    request[REQUEST_LOG].decisions = questions
    request[REQUEST_LOG].tokens = tokens
    return web.json_response(body)


@web.middleware
async def api_key_guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """With ARBITER_API_KEY set, every compute route needs the bearer token: /v1/* and
    /invocations (unless ARBITER_API_KEY_EXEMPT_INVOCATIONS, for a SageMaker endpoint, where IAM
    guards /invocations and the Authorization header never reaches the container)."""
    s = request.app[STATE].settings
    guarded = request.path.startswith("/v1/") or (
        request.path == "/invocations" and not s.api_key_exempt_invocations
    )
    if guarded and not systemone_http.authorized(request, s.api_key):
        if request.path == "/v1/systemone":
            return systemone_http.unauthorized()  # the System One API's own 401 body
        raise Unauthorized(
            "missing or invalid API key: send 'Authorization: Bearer <ARBITER_API_KEY>'",
            param="Authorization",
        )
    return cast(web.StreamResponse, await handler(request))


# -- JSON Lines --------------------------------------------------------------------------------


async def _jsonlines(request: web.Request, state: State) -> web.StreamResponse:
    """One decision per line in, one result or error per line out (``adapter.jsonlines_http``)."""
    s = state.settings
    if request.content_length is not None and request.content_length > s.max_jsonl_mb * MB:
        raise PayloadTooLarge(f"the body is over {s.max_jsonl_mb:g} MB (ARBITER_MAX_JSONL_MB)")
    engine = state.holder.require()
    lines = LinesResponse(request, engine, state.admission, state.metrics, s, request[REQUEST_LOG])
    return await lines.run()


# -- chat completions --------------------------------------------------------------------------


def _chat_request(raw: dict[str, Any]) -> chat.ChatCompletionRequest:
    try:
        return chat.ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc


async def _chat(request: web.Request, state: State, raw: dict[str, Any]) -> web.StreamResponse:
    chat_request = await asyncio.to_thread(_chat_request, raw)
    engine = state.holder.require()

    def prompt() -> Any:
        # Off the event loop: a template over hundreds of messages takes a while to render.
        segments = chat.render(
            chat_request.messages, engine.chat_template, engine.bos_text, engine.eos_text
        )
        return engine.encode_segments(segments)

    tokens = await asyncio.to_thread(prompt)
    if len(tokens) >= engine.n_ctx:
        raise ContextLengthExceeded(
            f"the messages are {len(tokens)} tokens; the context holds {engine.n_ctx} tokens",
            param="messages",
        )
    stops = chat_request.stops + ([] if engine.chat_template else chat.PLAIN_STOPS)
    options = {
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
            usage = bool(chat_request.stream_options and chat_request.stream_options.include_usage)
            return await _stream_chat(request, state, slot, engine, tokens, options, model, usage)
        generation: Generation = await slot.run(lambda: engine.generate(tokens, **options))
    _observe_generation(state, info, generation)
    body = chat.completion(
        chat.completion_id(),
        model,
        generation.text,
        generation.finish_reason,
        generation.prompt_tokens,
        generation.completion_tokens,
    )
    return web.json_response(body)


def _observe_generation(state: State, info: RequestLog, generation: Generation) -> None:
    info.tokens = generation.prompt_tokens + generation.completion_tokens
    info.extra["finish_reason"] = generation.finish_reason
    state.metrics.prompt_tokens.observe(generation.prompt_tokens)
    state.metrics.prefill_seconds.observe(generation.prefill_s)
    state.metrics.completion_tokens.inc(generation.completion_tokens)


_DONE = object()


async def _stream_chat(
    request: web.Request,
    state: State,
    slot: Slot,
    engine: Engine,
    tokens: Any,
    options: dict[str, Any],
    model: str,
    include_usage: bool,
) -> web.StreamResponse:
    """Server-sent events: a role chunk, content chunks as text becomes final, a finish chunk."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    stopped = threading.Event()

    def on_text(text: str) -> bool:
        if stopped.is_set():
            return False
        loop.call_soon_threadsafe(queue.put_nowait, text)
        return True

    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    stream = OpenStream(response, lambda e: chat.sse({"error": e.to_dict()}) + chat.sse("[DONE]"))
    request[OPEN_STREAM] = stream
    await response.prepare(request)
    cid = chat.completion_id()
    future = slot.start(lambda: engine.generate(tokens, on_text=on_text, **options))
    future.add_done_callback(lambda _: queue.put_nowait(_DONE))
    try:
        await response.write(chat.sse(chat.chunk(cid, model, {"role": "assistant", "content": ""})))
        while (item := await queue.get()) is not _DONE:
            await response.write(chat.sse(chat.chunk(cid, model, {"content": item})))
        generation = future.result()  # a failure is written in-band by the middleware
        _observe_generation(state, request[REQUEST_LOG], generation)
        await response.write(chat.sse(chat.chunk(cid, model, {}, generation.finish_reason)))
        if include_usage:
            counts = chat.usage(generation.prompt_tokens, generation.completion_tokens)
            await response.write(chat.sse(chat.chunk(cid, model, {}, None, counts, choices=False)))
        await response.write(chat.sse("[DONE]"))
        await stream.finish()
    finally:
        stopped.set()  # a client that went away stops the generation at its next token
    return response


# -- factory -----------------------------------------------------------------------------------


def create_app(
    settings: ServerSettings | None = None,
    engine_factory: Callable[[], Engine] | None = None,
    metrics: Metrics | None = None,
    *,
    close_engine: bool = True,
) -> web.Application:
    """The aiohttp app. ``engine_factory`` builds the engine (in a thread, at start-up); the app
    closes it at shutdown unless ``close_engine`` is False (an engine shared across apps)."""
    settings = settings or ServerSettings()
    if engine_factory is None:
        from arbiter.engine import open_engine

        engine_factory = open_engine
    metrics = metrics or Metrics()
    admission = Admission(
        settings.max_in_flight,
        settings.max_queue,
        settings.queue_timeout_s,
        settings.retry_after_s,
        on_reject=lambda reason: metrics.rejected.labels(reason).inc(),
    )
    metrics.in_flight.set_function(lambda: admission.in_flight)
    metrics.queued.set_function(lambda: admission.queued)
    state = State(
        settings=settings,
        holder=EngineHolder(engine_factory),
        admission=admission,
        metrics=metrics,
        openapi=OPENAPI_PATH.read_bytes(),
    )
    app = web.Application(
        middlewares=[middleware, api_key_guard], client_max_size=int(settings.max_body_mb * MB)
    )
    app[STATE] = state
    app[CLOSE_ENGINE] = close_engine
    app.on_response_prepare.append(_on_prepare)
    app.cleanup_ctx.append(_engine_lifetime)
    app.router.add_get("/ping", ping)
    app.router.add_post("/invocations", invocations)
    app.router.add_get("/execution-parameters", execution_parameters)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/systemone", systemone_route)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", make_aiohttp_handler(registry=metrics.registry))
    app.router.add_get("/openapi.json", openapi)
    return app


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]

    async def load() -> None:
        await state.holder.load()
        if state.holder.engine is not None:
            state.metrics.set_model(state.holder.engine.model_info)
            if state.settings.sagemaker_batch and state.settings.batch_max_payload_mb is None:
                state.warming = True  # measured before /ping says ready, and Batch Transform asks
                try:
                    await _batch_payload(state)
                except Exception as exc:  # measured again when asked; serving goes on
                    log.error("batch_payload_sizing_failed", error=repr(exc))
                finally:
                    state.warming = False

    task = asyncio.create_task(load())
    yield
    await task  # a load still running finishes before the engine can be closed
    engine = state.holder.engine
    if engine is not None:
        state.metrics.model_ready.set(0)
        if app[CLOSE_ENGINE]:
            await asyncio.to_thread(engine.close)
