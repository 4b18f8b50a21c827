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
from typing import Any

from arbiter.logging import get_logger
from emulator.async_answer import Answering, Busy, NotReached
from emulator.backlog import Backlog, Held
from emulator.container import Container
from emulator.metrics import RuntimeMetrics
from emulator.notify import message, publish
from emulator.readiness import Readiness
from emulator.recording import StoreGate, unrecorded_delay
from emulator.template import AsyncSpec

log = get_logger("arbiter.runtime")
TAKE_WAIT_S = 1  # each take long-polls this long, so a stopping worker notices within it
RETRY_UNRECORDED_S = 30


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
        self.sns = sns
        self.topics = topics
        self.metrics = metrics
        self.endpoint = endpoint
        self.region = region
        self.answering = Answering(container, s3, readable, clock)
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
        left = None
        with contextlib.suppress(Exception):
            left = await self.backlog.count()
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
                    await self.answering.failed(
                        request, f"InternalFailure: {held.unreadable}; not run"
                    )
                    if held.unreadable is not None
                    else await self.answering.answer(request)
                )
            except NotReached as exc:
                self.readiness.lost()
                await self.backlog.release(held)
                log.warning("async_requeued", inference_id=request.inference_id, why=str(exc))
                return
            except Busy as exc:  # back to the queue, and this worker waits as the 503 asks
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
