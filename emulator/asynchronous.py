"""``InvokeEndpointAsync`` and the data plane SageMaker runs behind it.

The call answers 202 at once with ``InferenceId``, ``OutputLocation`` and ``FailureLocation``; the
request waits in a queue (the backlog, ``arbiter_runtime_async_backlog``) that at most
``MaxConcurrentInvocationsPerInstance`` workers drain. Each reads the payload from S3
(``InputLocation``) or the inline body, posts it to the container's ``/invocations``, and writes the
container's answer: a 2xx to the output location, a 4xx/5xx body to the failure location. Either way
a notification goes to the template's success or error topic. A request older than its
``RequestTTLSeconds`` when a worker takes it is expired, and one the container does not answer within
``InvocationTimeoutSeconds`` has timed out: both get an error notification and no object (there is
no model response to store).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp import web

from arbiter.logging import get_logger
from emulator.container import CUSTOM_ATTRIBUTES, ContainerUnreachable, Invocation, passed_back
from emulator.errors import ServiceUnavailable, ValidationError, request_id
from emulator.s3io import READ_BYTES, ObjectWriter, S3Uri, parse_uri
from emulator.state import FRONT, Front
from emulator.template import AsyncSpec

log = get_logger("arbiter.runtime")
PREFIX = "X-Amzn-SageMaker-"
MAX_INLINE = 128_000  # AsyncBodyBlob's max
TTL_S = (60, 21_600, 21_600)  # min, max, default (6 h)
TIMEOUT_S = (1, 3_600, 900)  # min, max, default (15 min)


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class AsyncRequest:
    inference_id: str
    output: S3Uri
    failure: S3Uri | None
    input_location: S3Uri | None
    body: bytes | None
    content_type: str | None
    accept: str | None
    custom_attributes: str | None
    ttl_s: int
    timeout_s: int
    queued_at: float  # the front's clock
    received: datetime = field(default_factory=lambda: datetime.now(UTC))


def _bounded(request: web.Request, name: str, bounds: tuple[int, int, int]) -> int:
    raw = request.headers.get(PREFIX + name)
    if raw is None:
        return bounds[2]
    low, high, _ = bounds
    if not raw.strip().isdigit() or not low <= int(raw) <= high:
        raise ValidationError(f"{name} must be an integer from {low} to {high}; got {raw!r}.")
    return int(raw)


async def read_request(request: web.Request, front: Front) -> AsyncRequest:
    """Validate the call and name its output and failure objects."""
    front.check(request)
    spec = front.spec.asynchronous
    headers = request.headers
    location = headers.get(PREFIX + "InputLocation")
    body = await request.read() if request.can_read_body else b""
    if len(body) > MAX_INLINE:
        raise ValidationError(f"An inline Body is at most {MAX_INLINE} bytes; use InputLocation.")
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
        ttl_s=_bounded(request, "RequestTTLSeconds", TTL_S),
        timeout_s=_bounded(request, "InvocationTimeoutSeconds", TIMEOUT_S),
        queued_at=front.clock(),
    )


async def invoke_endpoint_async(request: web.Request) -> web.Response:
    """``POST /endpoints/{name}/async-invocations``: queued, 202."""
    front = request.app[FRONT]
    queued = await read_request(request, front)
    assert front.queue is not None, "the front is not started"
    front.queue.submit(queued)
    headers = {
        "X-Amzn-SageMaker-OutputLocation": str(queued.output),
        "x-amzn-RequestId": request_id(),
    }
    if queued.failure is not None:
        headers["X-Amzn-SageMaker-FailureLocation"] = str(queued.failure)
    return web.json_response({"InferenceId": queued.inference_id}, status=202, headers=headers)


class AsyncQueue:
    """The backlog and its workers (``MaxConcurrentInvocationsPerInstance`` of them)."""

    def __init__(self, front: Front, s3: Any, sns: Any) -> None:
        self.front = front
        self.spec: AsyncSpec = front.spec.asynchronous
        self.s3 = s3
        self.sns = sns
        self.waiting: asyncio.Queue[AsyncRequest] = asyncio.Queue()
        self.in_flight = 0
        self.workers: list[asyncio.Task[None]] = []
        metrics = front.metrics
        metrics.backlog.set_function(lambda: self.backlog)
        metrics.async_in_flight.set_function(lambda: self.in_flight)

    @property
    def backlog(self) -> int:
        return self.waiting.qsize() + self.in_flight

    def submit(self, queued: AsyncRequest) -> None:
        if self.backlog >= self.front.settings.max_backlog:
            raise ServiceUnavailable(
                f"The local async queue holds {self.backlog} requests "
                "(ARBITER_RUNTIME_MAX_BACKLOG); try again later."
            )
        self.waiting.put_nowait(queued)

    def start(self) -> None:
        self.workers = [
            asyncio.create_task(self._work(), name=f"async-worker-{n}")
            for n in range(self.spec.max_concurrent)
        ]

    async def stop(self, drain_s: float) -> None:
        """Let the requests in flight finish for ``drain_s``, then cancel; queued ones are dropped
        (this queue lives in memory: an async endpoint's backlog does not outlive it here)."""
        idle = [w for w in self.workers if not w.done()]
        if self.in_flight and drain_s > 0:
            await asyncio.wait(idle, timeout=drain_s)
        for worker in self.workers:
            worker.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)
        if self.waiting.qsize():
            log.warning("async_backlog_dropped", requests=self.waiting.qsize())

    async def _work(self) -> None:
        while True:
            queued = await self.waiting.get()
            self.in_flight += 1
            try:
                await self.process(queued)
            except Exception as exc:  # one request's fault never stops a worker
                log.error(
                    "async_invocation_failed", inference_id=queued.inference_id, error=repr(exc)
                )
            finally:
                self.in_flight -= 1

    async def process(self, queued: AsyncRequest) -> None:
        waited = self.front.clock() - queued.queued_at
        if waited > queued.ttl_s:
            reason = (
                f"Request expired: it waited {waited:.0f} s in the queue, over its "
                f"RequestTTLSeconds of {queued.ttl_s}."
            )
            await self._failed(queued, "expired", reason)
            return
        try:
            payload = await self._payload(queued)
        except _InputError as exc:
            await self._failed(queued, "failed", f"ClientError: {exc}")
            return
        invocation = Invocation(
            body=payload,
            content_type=queued.content_type,
            accept=queued.accept,
            custom_attributes=queued.custom_attributes,
            inference_id=queued.inference_id,
        )
        container = self.front.require_container()
        try:
            async with (
                asyncio.timeout(queued.timeout_s),
                container.open(invocation, queued.timeout_s) as reply,
            ):
                content_type, _ = passed_back(reply)
                ok = reply.status < 400
                target = queued.output if ok else queued.failure
                if target is not None:
                    writer = ObjectWriter(self.s3, target, content_type)
                    try:
                        async for chunk in reply.content.iter_any():
                            await writer.write(chunk)
                        await writer.close()
                    except BaseException:
                        await writer.abort()
                        raise
        except TimeoutError:
            reason = (
                f"Invocation timed out: the model did not answer within its "
                f"InvocationTimeoutSeconds of {queued.timeout_s}."
            )
            await self._failed(queued, "timed_out", reason)
            return
        except (ContainerUnreachable, aiohttp.ClientError) as exc:
            await self._failed(queued, "failed", f"ClientError: {exc}")
            return
        if ok:
            self.front.metrics.async_results.labels("completed").inc()
            await self._notify(queued, self.spec.success_topic, "Completed", content_type)
            return
        kind = "client" if reply.status < 500 else "server"
        reason = (
            f"ClientError: Received {kind} error ({reply.status}) from model. See the SageMaker "
            "Endpoint logs in your account for more information."
        )
        await self._failed(queued, "failed", reason, content_type, wrote_failure=True)

    async def _payload(self, queued: AsyncRequest) -> AsyncIterator[bytes]:
        """The input: the inline body, or the S3 object opened now (a missing one is this
        request's failure) and streamed into the container's request (up to 1 GB)."""
        if queued.body is not None:
            return _once(queued.body)
        assert queued.input_location is not None
        try:
            got = await self.s3.get_object(
                Bucket=queued.input_location.bucket, Key=queued.input_location.key
            )
        except Exception as exc:
            raise _InputError(
                f"could not read the input at {queued.input_location} ({exc})"
            ) from exc
        return _stream(got["Body"])

    async def _failed(
        self,
        queued: AsyncRequest,
        outcome: str,
        reason: str,
        content_type: str | None = None,
        *,
        wrote_failure: bool = False,
    ) -> None:
        self.front.metrics.async_results.labels(outcome).inc()
        log.info("async_invocation_failed", inference_id=queued.inference_id, reason=reason)
        await self._notify(
            queued, self.spec.error_topic, "Failed", content_type, reason, wrote_failure
        )

    async def _notify(
        self,
        queued: AsyncRequest,
        topic: str | None,
        status: str,
        content_type: str | None,
        reason: str | None = None,
        wrote_failure: bool = False,
    ) -> None:
        """The notification SageMaker publishes (``eventName`` ``InferenceResult``)."""
        if topic is None:
            return
        topic = self.front.topics.get(topic, topic)  # the ARN the local SNS gave it
        request_params: dict[str, Any] = {"endpointName": self.front.settings.endpoint_name}
        if queued.content_type is not None:
            request_params["contentType"] = queued.content_type
        if queued.input_location is not None:
            request_params["inputLocation"] = str(queued.input_location)
        response_params: dict[str, Any] = {}
        if content_type is not None:
            response_params["contentType"] = content_type
        if status == "Completed":
            response_params["outputLocation"] = str(queued.output)
        elif wrote_failure and queued.failure is not None:
            response_params["failureLocation"] = str(queued.failure)
        message = {
            "awsRegion": self.front.settings.aws_region,
            "eventTime": _iso(datetime.now(UTC)),
            "receivedTime": _iso(queued.received),
            "invocationStatus": status,
            "requestParameters": request_params,
            "responseParameters": response_params,
            "inferenceId": queued.inference_id,
            "eventVersion": "1.0",
            "eventSource": "aws:sagemaker",
            "eventName": "InferenceResult",
        }
        if reason is not None:
            message["failureReason"] = reason
        try:
            await self.sns.publish(TopicArn=topic, Message=json.dumps(message))
        except Exception as exc:  # a lost notification is logged; the object is what counts
            log.error("async_notification_failed", topic=topic, error=repr(exc))


class _InputError(Exception):
    """The async input could not be read from S3."""


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


async def _stream(body: Any) -> AsyncIterator[bytes]:
    async with body:
        while chunk := await body.read(READ_BYTES):
            yield chunk
