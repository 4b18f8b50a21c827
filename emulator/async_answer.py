"""What one asynchronous request gets from the container: its body (inline, or streamed from S3
where the endpoint's role may read it) posted, and the answer streamed to the output location (2xx)
or the failure location (4xx/5xx); or, when that cannot be done, a failure object saying why.

The workers (``emulator.async_workers``) decide what happens to the message; this decides what is
written. A container that was not reached (:class:`NotReached`) or is full (:class:`Busy`) is not an
answer: the request goes back to the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from arbiter.logging import get_logger
from emulator import limits
from emulator.async_request import AsyncRequest
from emulator.container import Container, ContainerUnreachable, Invocation, passed_back
from emulator.notify import InferenceResult
from emulator.s3io import READ_BYTES, ObjectWriter

log = get_logger("arbiter.runtime")


class NotReached(Exception):
    """The container refused the connection: the request never reached it."""


class _WriteFailed(Exception):
    """An S3 write of an answer failed."""


class Busy(Exception):
    """The container answered 503 ``retryable``: full (of real-time traffic, here where both
    endpoints share it; on AWS the async endpoint has instances of its own). Not an answer."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(f"the container is busy (503, retryable); again in {delay_s:g} s")
        self.delay_s = delay_s


BUSY_PEEK = 64 * 1024  # a busy answer is a small JSON error; a larger 503 body is an answer


class Answering:
    """Answers requests with ``container``, reading inputs under ``readable`` (the endpoint role's
    input prefix, s3://bucket/async/input/) and writing through ``s3``."""

    def __init__(self, container: Container, s3: Any, readable: str, clock: Any) -> None:
        self.container = container
        self.s3 = s3
        self.readable = readable
        self.clock = clock

    async def answer(self, request: AsyncRequest) -> InferenceResult:
        waited = self.clock() - request.queued_at
        if waited > request.ttl_s:
            return await self.failed(
                request,
                f"Request expired: it waited {waited:.0f} s in the queue, over its "
                f"RequestTTLSeconds of {request.ttl_s}.",
            )
        try:
            payload = await self._payload(request)
        except _InputError as exc:
            return await self.failed(request, f"ClientError: {exc}")
        invocation = Invocation(
            body=payload,
            content_type=request.content_type,
            accept=request.accept,
            custom_attributes=request.custom_attributes,
            inference_id=request.inference_id,
        )
        status, content_type = 0, None
        try:
            async with (
                asyncio.timeout(request.timeout_s),
                self.container.open(invocation, request.timeout_s) as reply,
            ):
                status = reply.status
                content_type, _ = passed_back(reply)
                head = await _busy_check(reply) if status == 503 else b""
                target = request.output if status < 400 else request.failure
                if target is None:  # no S3FailurePath: the notification alone
                    await reply.read()
                    return InferenceResult("Failed", content_type, _model_reason(status))
                await _copy(reply, ObjectWriter(self.s3, target, content_type), head)
        except ContainerUnreachable as exc:
            raise NotReached(str(exc)) from exc
        except TimeoutError:
            return await self.failed(
                request,
                "Invocation timed out: the model did not answer within its "
                f"InvocationTimeoutSeconds of {request.timeout_s}.",
            )
        except aiohttp.ClientError as exc:
            return await self.failed(request, f"ClientError: the model broke off ({exc})")
        except _WriteFailed as exc:
            if status < 400:
                return await self.failed(
                    request,
                    f"InternalFailure: the model's answer could not be written to {request.output}"
                    f" ({exc})",
                )
            return InferenceResult("Failed", content_type, f"{_model_reason(status)} ({exc})")
        if status < 400:
            return InferenceResult("Completed", content_type, output_written=True)
        return InferenceResult("Failed", content_type, _model_reason(status), failure_written=True)

    async def failed(self, request: AsyncRequest, reason: str) -> InferenceResult:
        """A failure object saying ``reason`` (unless the endpoint has no failure path)."""
        written = False
        if request.failure is not None:
            body = json.dumps({"inferenceId": request.inference_id, "failureReason": reason})
            try:
                await self.s3.put_object(
                    Bucket=request.failure.bucket,
                    Key=request.failure.key,
                    Body=body.encode(),
                    ContentType="application/json",
                )
                written = True
            except Exception as exc:
                log.error(
                    "async_failure_write_failed",
                    inference_id=request.inference_id,
                    location=str(request.failure),
                    error=repr(exc),
                )
        return InferenceResult(
            "Failed", "application/json" if written else None, reason, False, written
        )

    async def _payload(self, request: AsyncRequest) -> AsyncIterator[bytes]:
        """The inline body, or the S3 object opened now and streamed into the container's request
        (up to 1 GB; never held whole)."""
        if request.body is not None:
            return _once(request.body)
        source = request.input_location
        assert source is not None
        if not str(source).startswith(self.readable):  # the role's s3:GetObject stops here
            raise _InputError(
                f"AccessDenied: the endpoint's role may not read {source} (it reads "
                f"{self.readable}*)"
            )
        try:
            got = await self.s3.get_object(Bucket=source.bucket, Key=source.key)
        except Exception as exc:
            raise _InputError(f"could not read the input at {source} ({exc})") from exc
        size, most = int(got.get("ContentLength") or 0), limits.MAX_ASYNC_INPUT_BYTES
        if size > most:  # the documented limit: a larger input is refused, not answered
            got["Body"].close()
            raise _InputError(
                f"the input at {source} is {size:,} bytes, over Asynchronous Inference's "
                f"{most:,}-byte (1 GB) payload limit"
            )
        return _stream(got["Body"])


def _model_reason(status: int) -> str:
    kind = "client" if status < 500 else "server"
    return (
        f"ClientError: Received {kind} error ({status}) from model. See the SageMaker Endpoint "
        "logs in your account for more information."
    )


async def _busy_check(reply: aiohttp.ClientResponse) -> bytes:
    """The start of a 503's body; :class:`Busy` if it says ``retryable`` (the container's
    admission is full), with its ``Retry-After``."""
    head = await reply.content.read(BUSY_PEEK)
    try:
        error = json.loads(head).get("error", {})
    except (ValueError, AttributeError):
        return head
    if isinstance(error, dict) and error.get("retryable") is True:
        try:
            delay = float(reply.headers.get("Retry-After", "1"))
        except ValueError:
            delay = 1.0
        raise Busy(min(max(delay, 1.0), 30.0))
    return head


async def _copy(reply: aiohttp.ClientResponse, writer: ObjectWriter, head: bytes = b"") -> None:
    """The container's body (``head`` already read of it) into ``writer``; an S3 failure is
    :class:`_WriteFailed`, a container failure passes as it is, and either way a multipart upload
    begun is aborted."""
    try:
        if head:
            try:
                await writer.write(head)
            except Exception as exc:
                raise _WriteFailed(repr(exc)) from exc
        async for chunk in reply.content.iter_any():
            try:
                await writer.write(chunk)
            except Exception as exc:
                raise _WriteFailed(repr(exc)) from exc
        try:
            await writer.close()
        except Exception as exc:
            raise _WriteFailed(repr(exc)) from exc
    except BaseException:
        await _quietly(writer.abort())
        raise


async def _quietly(call: Any) -> Any:
    with contextlib.suppress(Exception):
        return await call
    return None


class _InputError(Exception):
    """The async input could not be read from S3."""


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


async def _stream(body: Any) -> AsyncIterator[bytes]:
    async with body:
        while chunk := await body.read(READ_BYTES):
            yield chunk
