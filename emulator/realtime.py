"""``InvokeEndpoint`` and ``InvokeEndpointWithResponseStream``: one container call each.

The body goes to the container's ``POST /invocations`` with SageMaker's header mapping; a 2xx comes
back as the operation's output (``x-Amzn-Invoked-Production-Variant`` added), a 4xx or 5xx as
``ModelError`` (424), no answer within 60 s as ``ModelError`` with ``OriginalStatusCode`` 0. The
streaming operation frames the container's body, chunk by chunk as it arrives, as ``PayloadPart``
events; a container that breaks off or runs out of time mid-stream ends it with a
``ModelStreamError`` event (``StreamBroken``, ``ModelInvocationTimeExceeded``), as SageMaker does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from emulator import eventstream, limits
from emulator.container import (
    CUSTOM_ATTRIBUTES,
    INFERENCE_ID,
    ContainerUnreachable,
    Invocation,
    ResponseTooLarge,
    passed_back,
)
from emulator.errors import (
    TIMED_OUT,
    ModelError,
    ModelNotReady,
    RequestTimeout,
    ValidationError,
    request_id,
)
from emulator.protocol import unsent
from emulator.state import FRONT, INVOKED_VARIANT, Front
from emulator.template import EndpointSpec

MAX_BODY = limits.MAX_REALTIME_BYTES  # BodyBlob's max: 6 MB both ways


def _too_large(size: int | str) -> ValidationError:
    return ValidationError(
        f"1 validation error detected: Value at 'body' of {size} bytes failed to satisfy "
        f"constraint: Member must have length less than or equal to {MAX_BODY}"
    )


async def _body(request: web.Request, operation: str) -> bytes:
    """The call's constraints (botocore's model), then its body, read no further than 6 MB."""
    limits.check(operation, request.headers, {"EndpointName": request.match_info["name"]})
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise _too_large(request.content_length)
    body = bytearray()
    async with timely_body(request):
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > MAX_BODY:
                raise _too_large(f"over {MAX_BODY}")
    return bytes(body)


@contextlib.asynccontextmanager
async def timely_body(request: web.Request) -> AsyncIterator[None]:
    """The body within ``ARBITER_RUNTIME_BODY_TIMEOUT_S``, or 408 and the connection closed."""
    limit = request.app[FRONT].settings.body_timeout_s
    try:
        async with asyncio.timeout(limit):
            yield
    except TimeoutError as exc:
        raise RequestTimeout(f"The request body did not arrive within {limit:g} s.") from exc


def _not_ready(exc: Exception) -> ModelNotReady:
    return ModelNotReady(f"The model is not ready: {exc}; is `arbiter serve` running? Retry.")


def _model_error(front: Front, status: int, body: bytes) -> ModelError:
    return ModelError(
        status,
        body.decode("utf-8", "replace"),
        endpoint=front.settings.endpoint_name,
        region=front.settings.aws_region,
    )


def _attributes_back(front: Front, operation: str, attributes: str | None) -> str | None:
    """The container's custom attributes, as the operation returns them: at most 1,024
    characters (botocore's model). Longer is the model's fault, answered as ModelError (AWS
    documents the limit, not what it does past it), never passed back whole."""
    most = limits.output_maximum(operation, "CustomAttributes")
    if attributes is not None and most is not None and len(attributes) > most:
        message = (
            f"the model's {CUSTOM_ATTRIBUTES} is {len(attributes)} characters; {operation} "
            f"returns at most {most}"
        )
        raise _model_error(front, 0, message.encode())
    return attributes


def _reply_headers(variant: str, custom_attributes: str | None) -> dict[str, str]:
    headers = {INVOKED_VARIANT: variant, "x-amzn-RequestId": request_id()}
    if custom_attributes is not None:
        headers[CUSTOM_ATTRIBUTES] = custom_attributes
    return headers


async def invoke_endpoint(request: web.Request) -> web.Response:
    """``POST /endpoints/{name}/invocations``."""
    front = request.app[FRONT]
    spec = front.check(request, "InvokeEndpoint")
    invocation = Invocation(
        body=await _body(request, "InvokeEndpoint"),
        content_type=request.headers.get("Content-Type"),
        accept=request.headers.get("Accept"),
        custom_attributes=request.headers.get(CUSTOM_ATTRIBUTES),
        inference_id=request.headers.get(INFERENCE_ID),
    )
    timeout = front.settings.invocation_timeout_s
    try:
        reply = await front.require_container().invoke(invocation, timeout, MAX_BODY)
    except ResponseTooLarge as exc:  # AWS documents the limit, not its error: ours, as a ModelError
        raise _model_error(
            front, 0, f"{exc} (InvokeEndpoint returns at most 6 MB; use async)".encode()
        ) from exc
    except TimeoutError as exc:
        raise ModelError(
            0, TIMED_OUT, endpoint=front.settings.endpoint_name, region=front.settings.aws_region
        ) from exc
    except ContainerUnreachable as exc:  # nothing listens: no model to answer yet
        raise _not_ready(exc) from exc
    except aiohttp.ClientError as exc:
        raise _model_error(
            front, 0, f"the container closed the connection ({exc})".encode()
        ) from exc
    if reply.status >= 400:
        raise _model_error(front, reply.status, reply.body)
    attributes = _attributes_back(front, "InvokeEndpoint", reply.custom_attributes)
    headers = _reply_headers(spec.variant, attributes)
    if reply.content_type is not None:
        headers["Content-Type"] = reply.content_type
    return web.Response(status=200, body=reply.body, headers=headers)


async def invoke_with_response_stream(request: web.Request) -> web.StreamResponse:
    """``POST /endpoints/{name}/invocations-response-stream``."""
    front = request.app[FRONT]
    spec = front.check(request, "InvokeEndpointWithResponseStream")
    invocation = Invocation(
        body=await _body(request, "InvokeEndpointWithResponseStream"),
        content_type=request.headers.get("Content-Type"),
        accept=request.headers.get("X-Amzn-SageMaker-Accept"),
        custom_attributes=request.headers.get(CUSTOM_ATTRIBUTES),
        inference_id=request.headers.get(INFERENCE_ID),
    )
    deadline = asyncio.get_running_loop().time() + front.settings.invocation_timeout_s
    watching: list[asyncio.Task[None]] = []
    try:
        return await _stream(request, front, spec, invocation, deadline, watching)
    finally:
        for watch in watching:
            watch.cancel()


async def _stream(
    request: web.Request,
    front: Front,
    spec: EndpointSpec,
    invocation: Invocation,
    deadline: float,
    watching: list[asyncio.Task[None]],
) -> web.StreamResponse:
    timeout = front.settings.invocation_timeout_s
    container = front.require_container()
    stream: web.StreamResponse | None = None
    try:
        async with asyncio.timeout_at(deadline), container.open(invocation, timeout) as reply:
            if reply.status >= 400:
                raise _model_error(front, reply.status, await reply.read())
            content_type, attributes = passed_back(reply)
            operation = "InvokeEndpointWithResponseStream"
            headers = _reply_headers(spec.variant, _attributes_back(front, operation, attributes))
            headers["Content-Type"] = eventstream.CONTENT_TYPE
            if content_type is not None:
                headers["X-Amzn-SageMaker-Content-Type"] = content_type
            stream = web.StreamResponse(status=200, headers=headers)
            await stream.prepare(request)
            idle = front.settings.stream_idle_timeout_s
            written = [0]
            watch = asyncio.create_task(_until_stalled(request, written, idle))
            watching.append(watch)
            async for chunk in reply.content.iter_any():
                try:
                    parts = eventstream.payload_parts(chunk)
                except Exception as exc:  # the front's own fault, after the 200 went out
                    await _end_stream(
                        stream,
                        eventstream.exception(
                            "InternalStreamFailure",
                            {"Message": f"The stream failed inside the front ({exc!r})."},
                        ),
                    )
                    return stream
                for part in parts:
                    try:
                        async with asyncio.timeout(idle):
                            await stream.write(part)
                        written[0] += len(part)
                    except TimeoutError:  # the client reads nothing: drop it, and the call
                        if request.transport is not None:
                            request.transport.abort()
                        return stream
    except TimeoutError as exc:
        if stream is None:
            raise ModelError(
                0,
                TIMED_OUT,
                endpoint=front.settings.endpoint_name,
                region=front.settings.aws_region,
            ) from exc
        await _stream_error(
            stream,
            "ModelInvocationTimeExceeded",
            f"The model did not finish its response within {timeout:g} s.",
        )
        return stream
    except ContainerUnreachable as exc:
        raise _not_ready(exc) from exc
    except aiohttp.ClientError as exc:
        if stream is None:
            raise _model_error(
                front, 0, f"the container closed the connection ({exc})".encode()
            ) from exc
        await _stream_error(
            stream, "StreamBroken", f"The connection to the model was closed ({exc})."
        )
        return stream
    assert stream is not None
    await stream.write_eof()
    return stream


async def _until_stalled(request: web.Request, written: list[int], idle: float) -> None:
    """Drop the connection once its client has taken nothing for ``idle`` s while bytes wait for
    it. A write blocks only once every buffer on the way is full (the front's send buffer grows
    to 4 MB); the bytes the client's kernel has not acknowledged (``emulator.protocol.unsent``)
    tell it within ``idle`` of the client's receive buffer filling. Until then a client that
    stops reading acknowledges like one that reads (docs/sagemaker-local.md)."""
    loop = asyncio.get_running_loop()
    taken_before, since = -1, loop.time()
    while True:
        await asyncio.sleep(min(1.0, idle / 4))
        waiting = unsent(request.transport)
        if waiting is None:  # closed, or not a platform that says: the write timeout remains
            return
        taken, now = written[0] - waiting, loop.time()
        if waiting == 0 or taken > taken_before:
            taken_before, since = taken, now
        elif now - since >= idle:
            if request.transport is not None:
                request.transport.abort()  # and with it the container's call
            return


async def _stream_error(stream: web.StreamResponse, code: str, message: str) -> None:
    """End a started stream with a ``ModelStreamError`` event."""
    event = eventstream.exception("ModelStreamError", {"Message": message, "ErrorCode": code})
    await _end_stream(stream, event)


async def _end_stream(stream: web.StreamResponse, event: bytes) -> None:
    """A started stream ends with an exception event, never a fresh error response (the 200 is
    sent); a client gone too is no error."""
    try:
        await stream.write(event)
        await stream.write_eof()
    except (ConnectionError, RuntimeError):
        pass
