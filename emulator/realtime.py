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

import aiohttp
from aiohttp import web

from emulator import eventstream
from emulator.container import (
    CUSTOM_ATTRIBUTES,
    INFERENCE_ID,
    ContainerUnreachable,
    Invocation,
    passed_back,
)
from emulator.errors import TIMED_OUT, ModelError, ServiceUnavailable, ValidationError, request_id
from emulator.state import FRONT, INVOKED_VARIANT, Front

MAX_BODY = 6_291_456  # BodyBlob's max: 6 MB both ways


async def _body(request: web.Request) -> bytes:
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise ValidationError(f"Request payload is over {MAX_BODY} bytes (6 MB).")
    body = await request.read()
    if len(body) > MAX_BODY:
        raise ValidationError(f"Request payload is over {MAX_BODY} bytes (6 MB).")
    return body


def _model_error(front: Front, status: int, body: bytes) -> ModelError:
    return ModelError(
        status,
        body.decode("utf-8", "replace"),
        endpoint=front.settings.endpoint_name,
        region=front.settings.aws_region,
    )


def _reply_headers(front: Front, custom_attributes: str | None) -> dict[str, str]:
    headers = {INVOKED_VARIANT: front.spec.variant, "x-amzn-RequestId": request_id()}
    if custom_attributes is not None:
        headers[CUSTOM_ATTRIBUTES] = custom_attributes
    return headers


async def invoke_endpoint(request: web.Request) -> web.Response:
    """``POST /endpoints/{name}/invocations``."""
    front = request.app[FRONT]
    front.check(request)
    invocation = Invocation(
        body=await _body(request),
        content_type=request.headers.get("Content-Type"),
        accept=request.headers.get("Accept"),
        custom_attributes=request.headers.get(CUSTOM_ATTRIBUTES),
        inference_id=request.headers.get(INFERENCE_ID),
    )
    timeout = front.settings.invocation_timeout_s
    try:
        reply = await front.require_container().invoke(invocation, timeout)
    except TimeoutError as exc:
        raise ModelError(
            0, TIMED_OUT, endpoint=front.settings.endpoint_name, region=front.settings.aws_region
        ) from exc
    except ContainerUnreachable as exc:
        raise ServiceUnavailable(f"{exc}; is `arbiter serve` running?") from exc
    except aiohttp.ClientError as exc:
        raise _model_error(
            front, 0, f"the container closed the connection ({exc})".encode()
        ) from exc
    if reply.status >= 400:
        raise _model_error(front, reply.status, reply.body)
    headers = _reply_headers(front, reply.custom_attributes)
    if reply.content_type is not None:
        headers["Content-Type"] = reply.content_type
    return web.Response(status=200, body=reply.body, headers=headers)


async def invoke_with_response_stream(request: web.Request) -> web.StreamResponse:
    """``POST /endpoints/{name}/invocations-response-stream``."""
    front = request.app[FRONT]
    front.check(request)
    invocation = Invocation(
        body=await _body(request),
        content_type=request.headers.get("Content-Type"),
        accept=request.headers.get("X-Amzn-SageMaker-Accept"),
        custom_attributes=request.headers.get(CUSTOM_ATTRIBUTES),
        inference_id=request.headers.get(INFERENCE_ID),
    )
    timeout = front.settings.invocation_timeout_s
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    container = front.require_container()
    stream: web.StreamResponse | None = None
    try:
        async with asyncio.timeout_at(deadline), container.open(invocation, timeout) as reply:
            if reply.status >= 400:
                raise _model_error(front, reply.status, await reply.read())
            content_type, attributes = passed_back(reply)
            headers = _reply_headers(front, attributes)
            headers["Content-Type"] = eventstream.CONTENT_TYPE
            if content_type is not None:
                headers["X-Amzn-SageMaker-Content-Type"] = content_type
            stream = web.StreamResponse(status=200, headers=headers)
            await stream.prepare(request)
            async for chunk in reply.content.iter_any():
                for part in eventstream.payload_parts(chunk):
                    await stream.write(part)
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
        raise ServiceUnavailable(f"{exc}; is `arbiter serve` running?") from exc
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


async def _stream_error(stream: web.StreamResponse, code: str, message: str) -> None:
    """End a started stream with a ``ModelStreamError`` event; a client gone too is no error."""
    try:
        await stream.write(
            eventstream.exception("ModelStreamError", {"Message": message, "ErrorCode": code})
        )
        await stream.write_eof()
    except (ConnectionError, RuntimeError):
        pass
