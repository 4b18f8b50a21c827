"""The workers behind ``InvokeEndpointAsync``: ``MaxConcurrentInvocationsPerInstance`` of them take
requests from the backlog (``emulator.backlog``), only while the container's ``/ping`` passes
(``emulator.readiness``), and answer each one.

Every request taken ends in one of three ways, each logged with its inference id:

- answered: the container's 2xx body at the output location, or its 4xx/5xx body at the failure
  location, and the notification; the message is deleted;
- failed before or around the container (expired in the queue, input unreadable, no answer within
  ``InvocationTimeoutSeconds``, the connection broken, an answer that could not be written): a
  failure object (JSON with the ``failureReason``) at the failure location and the error
  notification; if even that write fails, the notification alone says why;
- handed back to the queue (visibility 0): the container refused the connection (it went away
  after its ping), or the front is stopping and the drain time ran out; or, after its
  ``Retry-After``, the container answered 503 ``retryable`` (busy: here real-time traffic shares
  its admission, where on AWS the async endpoint has instances of its own). The request's TTL
  bounds how long it may wait so. A request whose outcome could be neither written nor notified
  is handed back too, and waits for the store (``emulator.recording``), not the container's time.
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
from emulator.backlog import Backlog, Held
from emulator.container import Container, ContainerUnreachable, Invocation, passed_back
from emulator.metrics import RuntimeMetrics
from emulator.notify import Outcome, message, publish
from emulator.readiness import Readiness
from emulator.recording import StoreGate, unrecorded_delay
from emulator.s3io import READ_BYTES, ObjectWriter
from emulator.template import AsyncSpec

log = get_logger("arbiter.runtime")
TAKE_WAIT_S = 1  # each take long-polls this long, so a stopping worker notices within it
RETRY_UNRECORDED_S = 30


class _NotReached(Exception):
    """The container refused the connection: the request never reached it."""


class _WriteFailed(Exception):
    """An S3 write of an answer failed."""


class _Busy(Exception):
    """The container answered 503 ``retryable``: full (of real-time traffic, here where both
    endpoints share it; on AWS the async endpoint has instances of its own). Not an answer."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(f"the container is busy (503, retryable); again in {delay_s:g} s")
        self.delay_s = delay_s


BUSY_PEEK = 64 * 1024  # a busy answer is a small JSON error; a larger 503 body is an answer


class AsyncWorkers:
    """Start with :meth:`start`; :meth:`stop` drains them (SIGTERM)."""

    def __init__(
        self,
        *,
        spec: AsyncSpec,
        backlog: Backlog,
        readiness: Readiness,
        container: Container,
        s3: Any,
        sns: Any,
        topics: dict[str, str],
        metrics: RuntimeMetrics,
        clock: Any,
        endpoint: str,
        region: str,
        readable: str,
    ) -> None:
        self.spec = spec
        self.backlog = backlog
        self.readiness = readiness
        self.container = container
        self.s3 = s3
        self.sns = sns
        self.topics = topics
        self.metrics = metrics
        self.clock = clock
        self.endpoint = endpoint
        self.region = region
        self.readable = readable  # the endpoint role's input prefix (s3://bucket/async/input/)
        self.gate = StoreGate(s3)
        self.stopping = asyncio.Event()
        self.held: dict[int, Held] = {}
        self.tasks: list[asyncio.Task[None]] = []
        metrics.async_in_flight.set_function(lambda: len(self.held))

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(self._work(n), name=f"async-worker-{n}")
            for n in range(self.spec.max_concurrent)
        ]

    async def stop(self, drain_s: float) -> None:
        """Take no more work; give the requests in flight ``drain_s`` to finish, then hand each
        one back to the queue (a restarted front answers it)."""
        self.stopping.set()
        holding = [held.request.inference_id for held in self.held.values()]
        log.info("async_draining", in_flight=holding, drain_s=drain_s)
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=drain_s)
        for n, task in enumerate(self.tasks):
            if n in self.held:  # past the drain time: handed back (see _work)
                task.cancel()
        # An idle worker is in a take of at most TAKE_WAIT_S: cancelling it there could leave a
        # message received but unread (back only after its visibility timeout), so it is awaited.
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=TAKE_WAIT_S + 5)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        left = await _quietly(self.backlog.count())
        log.info("async_stopped", backlog_left=left)

    async def _ready(self) -> bool:
        """Wait for the container's ping; False once the front is stopping (a worker waiting for
        a container that never came must not hold the stop for its drain time)."""
        ready = asyncio.ensure_future(self.readiness.wait())
        stopping = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (ready, stopping):
                task.cancel()
            await asyncio.gather(ready, stopping, return_exceptions=True)
        return self._taking()

    def _taking(self) -> bool:
        """Whether a worker may take work: after a SIGTERM, none (before a take, and for what a
        take in flight when it came brought back)."""
        return not self.stopping.is_set()  # SIGTERM: no more work taken

    async def _work(self, n: int) -> None:
        while True:
            try:
                if not await self._ready():
                    return
                held = await self.backlog.take(TAKE_WAIT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the queue unreachable: wait, as for the container
                log.warning("async_take_failed", error=repr(exc))
                await asyncio.sleep(1)
                continue
            if not self._taking():
                if held is not None:  # it arrived during the poll the SIGTERM found
                    await self.backlog.release(held)
                return
            if held is None:
                continue
            self.held[n] = held
            try:
                await self._handle(held)
            except asyncio.CancelledError:
                await asyncio.shield(self.backlog.release(held))
                log.warning("async_requeued", inference_id=held.request.inference_id, why="stop")
                raise
            except Exception as exc:  # one request's fault never stops a worker
                log.error(
                    "async_invocation_broke",
                    inference_id=held.request.inference_id,
                    error=repr(exc),
                    exc_info=exc,
                )
                await self.backlog.release(held, RETRY_UNRECORDED_S)
            finally:
                self.held.pop(n, None)

    async def _handle(self, held: Held) -> None:
        request = held.request
        if held.unreadable is None and not await self.gate.open(request.output.bucket):
            delay = unrecorded_delay(held.receives, RETRY_UNRECORDED_S)
            await self.backlog.release(held, delay)
            log.warning("async_requeued", inference_id=request.inference_id, why="store down")
            return
        async with self.backlog.holding(held):
            try:
                outcome = (
                    await self._failed(request, f"InternalFailure: {held.unreadable}; not run")
                    if held.unreadable is not None
                    else await self.answer(request)
                )
            except _NotReached as exc:
                self.readiness.lost()
                await self.backlog.release(held)
                log.warning("async_requeued", inference_id=request.inference_id, why=str(exc))
                return
            except _Busy as exc:  # back to the queue, and this worker waits as the 503 asks
                delay = max(1, round(exc.delay_s))
                await self.backlog.release(held, delay)
                log.warning("async_requeued", inference_id=request.inference_id, why=str(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
                return
            topic = (
                self.spec.success_topic if outcome.status == "Completed" else self.spec.error_topic
            )
            notified = False
            if topic is not None:
                text = message(request, outcome, endpoint=self.endpoint, region=self.region)
                notified = await publish(
                    self.sns, self.topics.get(topic, topic), text, request.inference_id
                )
        label = "completed" if outcome.status == "Completed" else "failed"
        self.metrics.async_results.labels(label).inc()
        log.info(
            f"async_{label}",
            inference_id=request.inference_id,
            reason=outcome.reason,
            notified=notified,
            output=str(request.output) if outcome.output_written else None,
            failure=str(request.failure) if outcome.failure_written else None,
        )
        if outcome.output_written or outcome.failure_written or notified:
            await self.backlog.done(held)
        else:  # nothing recorded anywhere: it is not answered, so it goes back (emulator.recording)
            self.gate.shut = True
            delay = unrecorded_delay(held.receives, RETRY_UNRECORDED_S)
            log.error("async_unrecorded", inference_id=request.inference_id, retry_s=delay)
            await self.backlog.release(held, delay)

    async def answer(self, request: AsyncRequest) -> Outcome:
        waited = self.clock() - request.queued_at
        if waited > request.ttl_s:
            return await self._failed(
                request,
                f"Request expired: it waited {waited:.0f} s in the queue, over its "
                f"RequestTTLSeconds of {request.ttl_s}.",
            )
        try:
            payload = await self._payload(request)
        except _InputError as exc:
            return await self._failed(request, f"ClientError: {exc}")
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
                    return Outcome("Failed", content_type, _model_reason(status))
                await _copy(reply, ObjectWriter(self.s3, target, content_type), head)
        except ContainerUnreachable as exc:
            raise _NotReached(str(exc)) from exc
        except TimeoutError:
            return await self._failed(
                request,
                "Invocation timed out: the model did not answer within its "
                f"InvocationTimeoutSeconds of {request.timeout_s}.",
            )
        except aiohttp.ClientError as exc:
            return await self._failed(request, f"ClientError: the model broke off ({exc})")
        except _WriteFailed as exc:
            if status < 400:
                return await self._failed(
                    request,
                    f"InternalFailure: the model's answer could not be written to {request.output}"
                    f" ({exc})",
                )
            return Outcome("Failed", content_type, f"{_model_reason(status)} ({exc})")
        if status < 400:
            return Outcome("Completed", content_type, output_written=True)
        return Outcome("Failed", content_type, _model_reason(status), failure_written=True)

    async def _failed(self, request: AsyncRequest, reason: str) -> Outcome:
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
        return Outcome("Failed", "application/json" if written else None, reason, False, written)

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
        if size > most:  # documented, and now enforced: before, 1.1 GB was answered
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
    """The start of a 503's body; :class:`_Busy` if it says ``retryable`` (the container's
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
        raise _Busy(min(max(delay, 1.0), 30.0))
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
