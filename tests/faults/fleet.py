"""A fleet of queue consumers in this process, each talking to S3 and SQS through a port of its own
on a fault proxy (tests/faults/proxy.py), so a plan can lose, refuse, fake and duplicate any of
their requests, and kill any of them between two calls. A killed worker's tasks are cancelled and
its requests are dropped unsent from the kill on (no ``finally`` of it touches the world); a fresh
worker takes its place, as the pool restarts a process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from tests.awaiting import where_they_wait
from tests.aws import CREDS
from tests.fakes import FakeEngine
from tests.faults.proxy import Call, FaultProxy
from worker.context import WorkerContext
from worker.metrics import WorkerMetrics
from worker.queue import Consumer, open_queue
from worker.settings import WorkerSettings


class _Worker:
    def __init__(self, number: int) -> None:
        self.number = number
        self.consumer: Consumer | None = None
        self.task: asyncio.Task[None] | None = None
        self.handles: set[asyncio.Task[Any]] = set()
        self.stack = contextlib.AsyncExitStack()
        self.registry = CollectorRegistry()
        self.killed = asyncio.Event()  # set when the proxy kills it (ends a wait at its start)


class Fleet:
    """``workers`` consumers over ``engine(n)`` (a fake engine by default), behind ``decide``."""

    def __init__(
        self,
        endpoint: str,
        settings: WorkerSettings,
        decide: Callable[[Call], str] = lambda call: "forward",
        workers: int = 2,
        engine: Callable[[int], Any] = lambda n: FakeEngine(),
    ) -> None:
        self.endpoint, self.settings, self.size, self.engine = endpoint, settings, workers, engine
        self.proxy = FaultProxy(endpoint, decide, self._killed)
        self.workers: dict[int, _Worker] = {}
        self.dead_letters: list[dict[str, Any]] = []  # the DLQ's records, once checked
        self.kills = 0
        self._next = 0
        self._dead: list[int] = []
        self._wake = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Fleet:
        await self.proxy.start()
        for _ in range(self.size):
            await self._spawn()
        self._supervisor = asyncio.create_task(self._supervise())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        await asyncio.gather(*(self._stop(w, graceful=True) for w in list(self.workers.values())))
        await self.proxy.close()

    def registries(self) -> list[CollectorRegistry]:
        return [w.registry for w in self.workers.values()]

    async def _spawn(self) -> None:
        """Start a worker; one that fails to start (killed, or its queue look-up refused) is
        discarded and another started, as the pool restarts a process that dies at start."""
        for _ in range(20):
            try:
                await self._start_one()
                return
            except Exception:
                continue
        raise AssertionError("no worker could start")

    async def _start_one(self) -> None:
        from aiobotocore.session import get_session

        number = self._next
        self._next += 1
        worker = _Worker(number)
        self.workers[number] = worker
        url = await self.proxy.endpoint(number)
        kw = {**self.settings.client_kwargs(), "endpoint_url": url, **CREDS}
        session = get_session()
        metrics = WorkerMetrics(worker.registry)
        try:
            s3 = await worker.stack.enter_async_context(session.create_client("s3", **kw))
            sqs = await worker.stack.enter_async_context(session.create_client("sqs", **kw))
            # As `arbiter work` does: a worker started in an SQS outage waits for the queue.
            queue = await open_queue(sqs, self.settings, metrics, worker.killed)
            if queue is None:
                raise ConnectionError(f"worker {number} was killed while it started")
        except BaseException:
            self.workers.pop(number, None)
            with contextlib.suppress(Exception):
                await worker.stack.aclose()
            raise
        ctx = WorkerContext(self.settings, s3, sqs, self.engine(number), queue, metrics=metrics)
        consumer = Consumer(ctx)
        consumer.handle = self._tracked(worker, consumer.handle)  # type: ignore[method-assign]
        worker.consumer = consumer
        worker.task = asyncio.create_task(consumer.run())

    @staticmethod
    def _tracked(worker: _Worker, handle: Callable[..., Awaitable[None]]) -> Any:
        @functools.wraps(handle)
        async def tracked(*args: Any, **kw: Any) -> None:
            task = asyncio.current_task()
            assert task is not None
            worker.handles.add(task)
            try:
                await handle(*args, **kw)
            finally:
                worker.handles.discard(task)

        return tracked

    def _killed(self, number: int) -> None:
        if (worker := self.workers.get(number)) is not None:
            worker.killed.set()
        self.kills += 1
        self._dead.append(number)
        self._wake.set()

    async def _supervise(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dead:
                worker = self.workers.get(self._dead.pop())
                if worker is not None:
                    await self._stop(worker, graceful=False)
                    await self._spawn()

    async def _stop(self, worker: _Worker, graceful: bool) -> None:
        """Stop a worker: drained (``graceful``), or killed: its tasks cancelled at once."""
        if worker.consumer is None or worker.task is None:  # killed while it started
            return
        worker.consumer.stop()
        if not graceful:
            for task in (worker.task, *worker.handles):
                task.cancel()
        # asyncio.wait, not wait_for: a cancellation of this task itself must not be swallowed.
        await asyncio.wait({worker.task}, timeout=30)
        tasks = [worker.task, *worker.handles]
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=10)
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a killed worker's errors are expected
        with contextlib.suppress(Exception):
            await worker.stack.aclose()
        self.workers.pop(worker.number, None)

    def idle(self) -> bool:
        """No worker is handling a message (one SQS showed again behind a slow holder may still
        be in hand after the queue looks empty)."""
        return not any(w.handles for w in self.workers.values())

    async def run_until(
        self, done: Callable[[], Awaitable[bool]], within_s: float = 60, interval: float = 0.2
    ) -> None:
        """Let the fleet work until ``done()`` (checked on direct clients) holds with every worker
        idle, or fail."""
        deadline = asyncio.get_running_loop().time() + within_s
        while not (await done() and self.idle() and await done()):
            if asyncio.get_running_loop().time() > deadline:
                waiting = where_they_wait(asyncio.all_tasks() - {asyncio.current_task()})
                raise AssertionError(
                    f"not done within {within_s} s; the workers wait at:\n{waiting}"
                )
            await asyncio.sleep(interval)
