"""The SageMaker Runtime API on this machine (aiohttp): ``create_app(settings)`` builds it.

Routes are the three operations botocore's ``sagemaker-runtime`` model names, under
``/endpoints/{name}/``, plus ``GET /metrics``. At start-up the app opens its connection pool to the
container and its S3 and SNS clients, creates the SNS topics the template declares (idempotent),
and starts the async workers; at shutdown it drains them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.aiohttp import make_aiohttp_handler

from emulator import asynchronous, realtime
from emulator.container import Container
from emulator.errors import errors
from emulator.metrics import RuntimeMetrics
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


def spec_for(settings: RuntimeSettings) -> EndpointSpec:
    return endpoint_spec(
        bucket=settings.bucket,
        max_in_flight=settings.max_in_flight,
        stack=settings.stack,
        region=settings.aws_region,
    )


def create_app(
    settings: RuntimeSettings | None = None,
    spec: EndpointSpec | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    """The front; ``spec`` defaults to the serving template evaluated for ``settings``, ``clock``
    (seconds, monotonic) times the async requests' TTL."""
    settings = settings or RuntimeSettings()
    front = Front(settings, spec or spec_for(settings), RuntimeMetrics(), clock)
    app = web.Application(middlewares=[_count, errors], client_max_size=realtime.MAX_BODY + 1)
    app[FRONT] = front
    for path, handler in OPERATIONS.items():
        app.router.add_post(f"/endpoints/{{name}}/{path}", handler)
    app.router.add_get("/metrics", make_aiohttp_handler(registry=front.metrics.registry))
    app.cleanup_ctx.append(_lifetime)
    return app


@web.middleware
async def _count(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
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
        s3 = await stack.enter_async_context(
            session.create_client("s3", **settings.client_kwargs())
        )
        sns = await stack.enter_async_context(
            session.create_client("sns", **settings.client_kwargs())
        )
        for arn, name in front.spec.topics.items():
            made = (await sns.create_topic(Name=name))["TopicArn"]
            front.topics[arn] = made
        front.container = Container(settings.container_url, http)
        front.queue = asynchronous.AsyncQueue(front, s3, sns)
        front.queue.start()
        try:
            yield
        finally:
            await front.queue.stop(settings.drain_s)
