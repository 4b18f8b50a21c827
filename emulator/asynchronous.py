"""``InvokeEndpointAsync``: the call is validated, its output and failure objects named, the request
put in the durable backlog (``emulator.backlog``), and only then answered 202 with ``InferenceId``,
``OutputLocation`` and ``FailureLocation``. The workers behind it are ``emulator.async_workers``.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from emulator import limits
from emulator.async_request import AsyncRequest, now_iso
from emulator.backlog import BACKLOG
from emulator.container import CUSTOM_ATTRIBUTES
from emulator.errors import ValidationError, request_id
from emulator.realtime import timely_body
from emulator.s3io import parse_uri
from emulator.state import FRONT, Front

PREFIX = "X-Amzn-SageMaker-"
MAX_INLINE = limits.body_maximum("InvokeEndpointAsync") or 128_000  # AsyncBodyBlob's max
TTL_DEFAULT_S = 21_600  # 6 h (the defaults are the API reference's; the bounds are the model's)
TIMEOUT_DEFAULT_S = 900  # 15 min


def _seconds(request: web.Request, name: str, default: int) -> int:
    raw = request.headers.get(PREFIX + name)  # its bounds were checked against the model
    return default if raw is None else int(raw.strip())


async def _inline(request: web.Request) -> bytes:
    """The inline body, read no further than its 128,000 bytes."""
    body = bytearray()
    async with timely_body(request):
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > MAX_INLINE:
                raise ValidationError(
                    "1 validation error detected: Value at 'body' failed to satisfy constraint: "
                    f"Member must have length less than or equal to {MAX_INLINE} (use InputLocation)"
                )
    return bytes(body)


async def read_request(request: web.Request, front: Front) -> AsyncRequest:
    """Validate the call and name its output and failure objects."""
    endpoint = front.check(request, "InvokeEndpointAsync")
    limits.check(
        "InvokeEndpointAsync", request.headers, {"EndpointName": request.match_info["name"]}
    )
    spec = endpoint.asynchronous
    assert spec is not None  # the check said it is an async endpoint
    headers = request.headers
    location = headers.get(PREFIX + "InputLocation")
    body = await _inline(request)
    if (location is None) == (not body):
        raise ValidationError("Provide exactly one of InputLocation and Body.")
    try:
        source = parse_uri(location) if location is not None else None
    except ValueError as exc:
        raise ValidationError(
            f"InputLocation: {exc} (this local endpoint reads s3:// URIs)"
        ) from exc
    given_id = headers.get(PREFIX + "Inference-Id")
    inference_id = given_id or str(uuid.uuid4())
    name = uuid.uuid4().hex if given_id else inference_id
    extension = headers.get(PREFIX + "S3OutputPathExtension", "")
    filename = headers.get(PREFIX + "Filename")
    output = parse_uri(spec.output_path).join(extension, filename or f"{name}.out")
    failure = (
        parse_uri(spec.failure_path).join(extension, f"{name}-error.out")
        if spec.failure_path
        else None
    )
    return AsyncRequest(
        inference_id=inference_id,
        output=output,
        failure=failure,
        input_location=source,
        body=body or None,
        content_type=headers.get(PREFIX + "Content-Type"),
        accept=headers.get(PREFIX + "Accept"),
        custom_attributes=headers.get(CUSTOM_ATTRIBUTES),
        ttl_s=_seconds(request, "RequestTTLSeconds", TTL_DEFAULT_S),
        timeout_s=_seconds(request, "InvocationTimeoutSeconds", TIMEOUT_DEFAULT_S),
        queued_at=front.clock(),
        received=now_iso(),
    )


async def invoke_endpoint_async(request: web.Request) -> web.Response:
    """``POST /endpoints/{name}/async-invocations``: queued, 202."""
    front = request.app[FRONT]
    queued = await read_request(request, front)
    await request.app[BACKLOG].put(queued)
    headers = {
        "X-Amzn-SageMaker-OutputLocation": str(queued.output),
        "x-amzn-RequestId": request_id(),
    }
    if queued.failure is not None:
        headers["X-Amzn-SageMaker-FailureLocation"] = str(queued.failure)
    return web.json_response({"InferenceId": queued.inference_id}, status=202, headers=headers)
