"""The SageMaker Runtime API on this machine (aiohttp): ``create_app(settings)`` builds it.

Routes are the three operations botocore's ``sagemaker-runtime`` model names, under
``/endpoints/{name}/``, plus ``GET /metrics``. At start-up the app opens its connection pool to the
container and its S3 and SNS clients, creates the SNS topics the template declares (idempotent),
and starts the async workers; at shutdown it drains them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.aiohttp import make_aiohttp_handler

from emulator import asynchronous, realtime
from emulator.async_workers import AsyncWorkers
from emulator.backlog import BACKLOG, Backlog
from emulator.container import Container
from emulator.errors import errors
from emulator.metrics import RuntimeMetrics
from emulator.protocol import FrontHandler
from emulator.readiness import Readiness
from emulator.settings import RuntimeSettings
from emulator.state import FRONT, Front
from emulator.template import EndpointSpec, endpoint_spec

OPERATIONS: dict[str, Handler] = {
    "invocations": realtime.invoke_endpoint,
    "async-invocations": asynchronous.invoke_endpoint_async,
    "invocations-response-stream": realtime.invoke_with_response_stream,
}
_NAMES = {
    "invocations": "InvokeEndpoint",
    "async-invocations": "InvokeEndpointAsync",
    "invocations-response-stream": "InvokeEndpointWithResponseStream",
}


def endpoints_for(settings: RuntimeSettings) -> dict[str, EndpointSpec]:
    """The endpoints the front serves: each name with the template evaluated for its mode."""
    named = {"realtime": settings.endpoint_name, "async": settings.async_endpoint_name}
    return {
        name: endpoint_spec(
            bucket=settings.bucket,
            max_in_flight=settings.max_in_flight,
            stack=settings.stack,
            region=settings.aws_region,
            mode=mode,
        )
        for mode, name in named.items()
        if name
    }


def create_app(
    settings: RuntimeSettings | None = None,
    endpoints: dict[str, EndpointSpec] | None = None,
    clock: Callable[[], float] = time.time,
) -> web.Application:
    """The front; ``endpoints`` default to the serving template evaluated for ``settings``, ``clock``
    (seconds, wall clock: a request's age counts across a restart) times the async requests' TTL."""
    settings = settings or RuntimeSettings()
    front = Front(settings, endpoints or endpoints_for(settings), RuntimeMetrics(), clock)
    app = web.Application(middlewares=[_count, errors], client_max_size=realtime.MAX_BODY + 1)
    app[FRONT] = front
    for path, handler in OPERATIONS.items():
        app.router.add_post(f"/endpoints/{{name}}/{path}", handler)
    app.router.add_get("/metrics", make_aiohttp_handler(registry=front.metrics.registry))
    app.cleanup_ctx.append(_lifetime)
    return app


@web.middleware
async def _count(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    finally:
        if isinstance(request.protocol, FrontHandler):  # the next request's headers are timed
            request.protocol.next_request()
    operation = _NAMES.get(request.path.rsplit("/", 1)[-1])
    if operation is not None and request.path.startswith("/endpoints/"):
        request.app[FRONT].metrics.invocations.labels(operation, str(response.status)).inc()
    return response


async def _lifetime(app: web.Application) -> AsyncIterator[None]:
    from aiobotocore.session import get_session

    front = app[FRONT]
    settings = front.settings
    session = get_session()
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        )
        s3, sns, sqs = [
            await stack.enter_async_context(session.create_client(name, **settings.client_kwargs()))
            for name in ("s3", "sns", "sqs")
        ]
        front.container = Container(settings.container_url, http)
        workers, watch = None, None
        served = front.asynchronous()
        if served is not None:
            name, spec = served
            for arn, topic in front.endpoints[name].topics.items():
                front.topics[arn] = (await sns.create_topic(Name=topic))["TopicArn"]
            backlog = await Backlog.open(
                sqs, settings.backlog_queue(), settings.visibility_s, settings.max_backlog
            )
            app[BACKLOG] = backlog
            front.metrics.backlog.set_function(lambda: backlog.size)
            workers = AsyncWorkers(
                spec=spec,
                backlog=backlog,
                readiness=Readiness(http, settings.container_url),
                container=front.container,
                s3=s3,
                sns=sns,
                topics=front.topics,
                metrics=front.metrics,
                clock=front.clock,
                endpoint=name,
                region=settings.aws_region,
                readable=settings.readable_prefix(),
            )
            workers.start()
            watch = asyncio.create_task(backlog.watch())
        try:
            yield
        finally:
            if workers is not None and watch is not None:
                await workers.stop(settings.drain_s)
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
