"""The HTTP service: a SageMaker inference container and a local decision API (aiohttp).

``create_app(settings, engine_factory)`` builds the app; the engine is loaded in a thread at start-up
(``/ping`` answers 503 until it is ready), and a shutdown during the load cancels it rather than
waiting for it (``load_cancel``); every model call runs off the event loop through the admission
control (``adapter.admission``). ``ROUTES`` is the route table, one module per route family;
errors become responses in one middleware (``adapter.middleware``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.aiohttp import make_aiohttp_handler

from adapter import chat, execution, invocations, middleware, openapi, systemone, text_completions
from adapter.admission import Admission
from adapter.metrics import Metrics
from adapter.state import CLOSE_ENGINE, STATE, EngineHolder, State
from arbiter.engine import Engine
from arbiter.errors import ModelNotReady
from arbiter.logging import get_logger
from arbiter.settings import MB, ServerSettings

METRICS_HANDLER = web.AppKey[Handler]("metrics_handler")

log = get_logger("arbiter.http")


PING = openapi.Operation(summary="Health: 200 once the model is loaded", ok="Ready")


async def ping(request: web.Request) -> web.Response:
    """`GET /ping`: 200 once the model is loaded (and, under Batch Transform, measured)."""
    state = request.app[STATE]
    state.holder.require()
    if state.warming:
        raise ModelNotReady("measuring this machine's speed for Batch Transform", retry_after=1)
    return web.json_response({"status": "ok"})


MODELS = openapi.Operation(
    summary="The served model (OpenAI list shape, with Arbiter's model metadata)",
    ok="Model list",
    errors=(401, 500, 503),
)


async def models(request: web.Request) -> web.Response:
    """`GET /v1/models`: the served model in OpenAI's list shape and in the TypeSafe SDK's."""
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
                    # The read check at load (``engine.read_check``): the probes' label mass.
                    "meta": {
                        **info.model_dump(),
                        "read_check": _read_check(engine),
                        # How probabilities are calibrated, and the abstention thresholds.
                        "calibration": _calibration(engine),
                    },
                }
            ],
            # The TypeSafe SDK's models.list() reads this key.
            "models": systemone.models_listing(engine),
        }
    )


def _calibration(engine: Engine) -> dict[str, object] | None:
    info = getattr(engine, "calibration_info", None)  # a fake engine may have none
    return info() if info is not None else None


def _read_check(engine: Engine) -> dict[str, object] | None:
    check = getattr(engine, "read_check", None)  # a fake engine may have none
    return check.to_dict() if check is not None else None


METRICS = openapi.Operation(
    summary="Prometheus metrics",
    ok="Prometheus text format",
    ok_bodies={"text/plain": {"type": "string"}},
    errors=(),
)


async def metrics(request: web.Request) -> web.StreamResponse:
    """`GET /metrics`: this app's registry (prometheus-client's own handler)."""
    return await request.app[METRICS_HANDLER](request)


API_DOCUMENT = openapi.Operation(summary="This document", ok="OpenAPI 3.1", errors=())


async def api_document(request: web.Request) -> web.Response:
    """`GET /openapi.json`: the generated document (``adapter.openapi``)."""
    return web.Response(body=request.app[STATE].openapi, content_type="application/json")


@dataclass(frozen=True)
class Route:
    """One route: what serves it, and what the OpenAPI document says about it."""

    method: str
    path: str
    handler: Handler
    operation: openapi.Operation


ROUTES = (
    Route("GET", "/ping", ping, PING),
    Route("POST", "/invocations", invocations.invocations, invocations.OPERATION),
    Route("GET", "/execution-parameters", execution.execution_parameters, execution.OPERATION),
    Route("POST", "/v1/chat/completions", chat.chat_completions, chat.OPERATION),
    Route("POST", "/v1/completions", text_completions.completions, text_completions.OPERATION),
    Route("GET", "/v1/models", models, MODELS),
    Route("GET", "/metrics", metrics, METRICS),
    Route("GET", "/openapi.json", api_document, API_DOCUMENT),
    Route("POST", "/v1/systemone", systemone.systemone_route, systemone.OPERATION),
)


def create_app(
    settings: ServerSettings | None = None,
    engine_factory: Callable[[], Engine] | None = None,
    metrics: Metrics | None = None,
    *,
    close_engine: bool = True,
    load_cancel: threading.Event | None = None,
) -> web.Application:
    """The aiohttp app. ``engine_factory`` builds the engine (in a thread, at start-up); the app
    closes it at shutdown unless ``close_engine`` is False (an engine shared across apps). A
    shutdown while it loads sets ``load_cancel``, which the factory's engine watches (``Engine``'s
    ``cancel``): the default factory's does."""
    settings = settings or ServerSettings()
    load_cancel = load_cancel or threading.Event()
    if engine_factory is None:
        from arbiter.engine import open_engine

        engine_factory = partial(open_engine, cancel=load_cancel)
    app_metrics = metrics or Metrics()
    admission = Admission(
        settings.max_in_flight,
        settings.max_queue,
        settings.queue_timeout_s,
        settings.retry_after_s,
        on_reject=lambda reason: app_metrics.rejected.labels(reason).inc(),
        on_cancel=lambda stage: app_metrics.cancelled.labels(stage).inc(),
    )
    app_metrics.in_flight.set_function(lambda: admission.in_flight)
    app_metrics.queued.set_function(lambda: admission.queued)
    holder = EngineHolder(engine_factory, load_cancel)
    app_metrics.prefix_cache_bytes.set_function(lambda: _cache_bytes(holder))
    state = State(
        settings=settings,
        holder=holder,
        admission=admission,
        metrics=app_metrics,
        openapi=openapi.PATH.read_bytes(),
    )
    app = web.Application(
        middlewares=[middleware.errors, middleware.api_key],
        client_max_size=int(settings.max_body_mb * MB),
    )
    app[STATE] = state
    app[CLOSE_ENGINE] = close_engine
    app[METRICS_HANDLER] = make_aiohttp_handler(registry=app_metrics.registry)
    app.on_response_prepare.append(middleware.on_prepare)
    app.cleanup_ctx.append(_engine_lifetime)
    for route in ROUTES:
        if route.method == "GET":
            app.router.add_get(route.path, route.handler)  # and HEAD
        else:
            app.router.add_route(route.method, route.path, route.handler)
    return app


def _cache_bytes(holder: EngineHolder) -> float:
    cache = getattr(holder.engine, "cache", None)  # a fake engine may have none
    return float(cache.bytes_used) if cache is not None else 0.0


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]

    async def load() -> None:
        await state.holder.load()
        if state.holder.engine is not None:
            state.metrics.set_model(state.holder.engine.model_info)
            check = getattr(state.holder.engine, "read_check", None)
            if check is not None and check.allowed_mass is not None:
                state.metrics.read_check_mass.set(check.allowed_mass)
            if state.settings.sagemaker_batch and state.settings.batch_max_payload_mb is None:
                state.warming = True  # measured before /ping says ready, and Batch Transform asks
                try:
                    await execution.batch_payload(state)
                except Exception as exc:  # measured again when asked; serving goes on
                    log.error("batch_payload_sizing_failed", error=repr(exc))
                finally:
                    state.warming = False

    task = asyncio.create_task(load())
    yield
    if not task.done():
        state.holder.cancel()  # a stop while it loads: the load is cancelled, not awaited
    await task  # ends within a fraction of a second of the cancel (or at once: it is over)
    engine = state.holder.engine
    if engine is not None:
        state.metrics.model_ready.set(0)
        if app[CLOSE_ENGINE]:
            await asyncio.to_thread(engine.close)
