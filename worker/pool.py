"""`arbiter work`: a pool of worker processes, each with its own engine and queue consumer.

The pool process loads no model. It starts N worker processes (spawned, so no llama.cpp state is
ever forked), restarts one that dies, serves the merged Prometheus metrics of all of them, and on
SIGTERM (or SIGINT) passes SIGTERM on: each worker stops receiving, finishes the job in hand or
releases its message at the drain deadline, and exits 0; so does the pool.

A worker that keeps dying young (a missing model, a bad configuration) is restarted after doubling
delays; past ``max_restarts`` in a row the pool drains the others and exits 1, so that the
orchestrator sees a failed task instead of a pool that restarts a broken worker forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from arbiter.logging import configure
from arbiter.ports import bind
from arbiter.signals import STOP_SIGNALS
from worker.context import WorkerContext
from worker.policies import RestartPolicy
from worker.protection import Bounds, InHand, TaskProtection
from worker.settings import MULTIPROC_ENV, WorkerSettings


def prepare_multiprocess_dir(path: Path) -> Path:
    """Wipe and create the samples directory and point prometheus-client at it (worker processes
    inherit the variable; prometheus-client picks its value class from it at import)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    os.environ[MULTIPROC_ENV] = str(path)
    if "prometheus_client.values" in sys.modules:
        # Imported already (by another module of this process): switch its value class now, so
        # the metrics this process creates from here on are written to the directory too.
        from prometheus_client import values

        values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    return path


def load_engine_factory(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "open_engine")  # type: ignore[no-any-return]


# -- one worker process ----------------------------------------------------------------------------


def worker_main(settings_data: dict[str, Any], index: int, slots: Any = None) -> None:
    """Entry point of a worker process: engine, clients, consumer, until SIGTERM. ``slots``: the
    pool's shared array where this process marks a message in hand (task protection)."""
    configure()
    structlog.contextvars.bind_contextvars(worker=index, pid=os.getpid())
    settings = WorkerSettings.model_validate(settings_data)
    try:
        asyncio.run(_worker(settings, None if slots is None else InHand(slots, index)))
    except Exception:
        structlog.get_logger("arbiter.worker").exception("worker.crashed")
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    # A job cancelled at the drain deadline may still have a chunk computing in a thread; the
    # message is already released, so do not wait for it.
    os._exit(0)


async def _worker(settings: WorkerSettings, in_hand: InHand | None = None) -> None:
    from aiobotocore.session import get_session

    from arbiter.settings import engine_from_environment
    from worker.metrics import WorkerMetrics
    from worker.queue import Consumer, open_queue

    log = structlog.get_logger("arbiter.worker")
    threads = settings.threads_per_process()
    # The engine's settings as `arbiter serve` reads them (SM_LLAMA_CPP_* too), the threads split.
    engine_settings = engine_from_environment().model_copy(update={"n_threads": threads})
    engine = load_engine_factory(settings.worker_engine_factory)(engine_settings)
    log.info("engine.loaded", threads=threads, model=getattr(engine.model_info, "file", None))
    session = get_session()
    metrics = WorkerMetrics(registry=None)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    async with (
        session.create_client("s3", **settings.client_kwargs()) as s3,
        session.create_client("sqs", **settings.client_kwargs()) as sqs,
    ):
        # Started in an SQS outage (a restart after a kill, say): wait for the queue, not die.
        queue = await open_queue(sqs, settings, metrics, stop)
        if queue is None:
            return
        ctx = WorkerContext(settings, s3, sqs, engine, queue, metrics=metrics)
        consumer = Consumer(ctx, in_hand=in_hand)
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, consumer.stop)
        if stop.is_set():
            consumer.stop()
        await consumer.run()


# -- the pool --------------------------------------------------------------------------------------


class Pool:
    """N worker processes kept alive until :meth:`stop`, or until one of them crash-loops."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: dict[int, Any] = {}
        self._started_at: dict[int, float] = {}
        self._crashes: dict[int, int] = {}
        self._restart_at: dict[int, float] = {}
        self._stopping = asyncio.Event()
        self.restarts = RestartPolicy(
            settings.restart_delay_s,
            settings.restart_max_delay_s,
            settings.max_restarts,
            settings.restart_reset_s,
        )
        self.log = structlog.get_logger("arbiter.pool")
        # Which workers hold a message, for the task's scale-in protection (on ECS only).
        protect = settings.task_protection and settings.ecs_agent_uri
        self.slots = self._ctx.RawArray("i", settings.worker_processes) if protect else None

    def _start(self, index: int) -> None:
        proc = self._ctx.Process(
            target=worker_main,
            args=(self.settings.model_dump(), index, self.slots),
            name=f"arbiter-worker-{index}",
        )
        proc.start()
        self._procs[index] = proc
        self._started_at[index] = time.monotonic()
        self.log.info("pool.worker_started", worker=index, worker_pid=proc.pid)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> int:
        """Supervise until stopped; 0 after a drain, 1 if a worker crash-looped."""
        from worker.metrics import WorkerMetrics, mark_process_dead

        metrics = WorkerMetrics(registry=None)
        for index in range(self.settings.worker_processes):
            self._start(index)
        protecting = self._protect(metrics)
        status = 0
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=0.2)
            if self._stopping.is_set():
                break
            now = time.monotonic()
            for index, at in list(self._restart_at.items()):
                if now >= at:
                    del self._restart_at[index]
                    metrics.restarts.inc()
                    self._start(index)
            for index, proc in list(self._procs.items()):
                if proc.exitcode is None or index in self._restart_at:
                    continue
                if not self._died(index, proc, now, mark_process_dead):
                    status = 1
                    self._stopping.set()
                    break
        try:
            await self._shutdown(mark_process_dead)
        finally:
            if protecting is not None:
                protecting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await protecting
            for proc in self._procs.values():  # whatever happened above, leave no worker behind
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(5)
        return status

    def _protect(self, metrics: Any) -> asyncio.Task[None] | None:
        """The task's scale-in protection, kept while any worker holds a message."""
        if self.slots is None or self.settings.ecs_agent_uri is None:
            return None
        bounds = Bounds(
            self.settings.task_protection_minutes,
            self.settings.task_protection_idle_s,
            window_s=self.settings.task_protection_window_minutes * 60,
            rest_s=self.settings.task_protection_rest_s,
        )
        protection = TaskProtection(self.settings.ecs_agent_uri, metrics, bounds)
        slots = self.slots
        return asyncio.create_task(protection.run(lambda: any(slots), self._stopping))

    def _died(self, index: int, proc: Any, now: float, mark_dead: Callable[[int], None]) -> bool:
        """Schedule the restart of a dead worker; False if it is crash-looping (give up)."""
        mark_dead(proc.pid)
        if self.slots is not None:  # its message goes back to the queue: it holds none now
            self.slots[index] = 0
        lived = now - self._started_at[index]
        crashes = self.restarts.crashes(self._crashes.get(index, 0), lived)
        self._crashes[index] = crashes
        delay = self.restarts.delay(crashes)
        self.log.error(
            "pool.worker_died",
            worker=index,
            exitcode=proc.exitcode,
            lived_s=round(lived, 1),
            crashes_in_a_row=crashes,
            restart_in_s=delay,
        )
        if delay is None:
            self.log.error(
                "pool.crash_loop",
                worker=index,
                crashes_in_a_row=crashes,
                hint="the worker dies at or soon after its start; see its last log lines",
            )
            return False
        self._restart_at[index] = now + delay
        return True

    async def _shutdown(self, mark_dead: Callable[[int], None]) -> None:
        self.log.info("pool.draining", deadline_s=self.settings.drain_deadline_s)
        for proc in self._procs.values():
            if proc.exitcode is None and proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        # Workers release their message at the deadline; leave them a little longer to do it.
        limit = time.monotonic() + self.settings.drain_deadline_s + 15
        while time.monotonic() < limit:
            if all(p.exitcode is not None for p in self._procs.values()):
                break
            await asyncio.sleep(0.1)
        for index, proc in self._procs.items():
            if proc.exitcode is None:
                self.log.error("pool.worker_killed", worker=index)
                proc.kill()
                proc.join(5)
            with contextlib.suppress(OSError):
                mark_dead(proc.pid)
        self.log.info("pool.stopped")


async def _serve_metrics(sock: socket.socket) -> Any:
    from aiohttp import web
    from prometheus_client.aiohttp import make_aiohttp_handler

    from worker.metrics import multiprocess_registry

    app = web.Application()
    app.router.add_get("/metrics", make_aiohttp_handler(registry=multiprocess_registry()))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    return runner


async def run_pool(settings: WorkerSettings, metrics_dir: Path | None = None) -> int:
    """Run the pool until SIGTERM/SIGINT; returns the exit status (0 after a drain, 1 after a
    crash loop)."""
    log = structlog.get_logger("arbiter.pool")
    # Bound before anything else: a busy port is one line (status 2), not a traceback after the
    # workers were spawned.
    sock = (
        bind(
            settings.metrics_host,
            settings.metrics_port,
            "the pool's metrics",
            "ARBITER_METRICS_PORT",
        )
        if settings.metrics_port
        else None
    )
    owned = metrics_dir is None and not os.environ.get(MULTIPROC_ENV)
    if os.environ.get(MULTIPROC_ENV) and metrics_dir is None:
        metrics_dir = Path(os.environ[MULTIPROC_ENV])
    metrics_dir = metrics_dir or Path(tempfile.mkdtemp(prefix="arbiter-metrics-"))
    prepare_multiprocess_dir(metrics_dir)
    pool = Pool(settings)
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, pool.stop)
    runner = await _serve_metrics(sock) if sock is not None else None
    if runner is not None:
        log.info(
            "pool.metrics",
            url=f"http://{settings.metrics_host}:{settings.metrics_port}/metrics",
        )
    try:
        return await pool.run()
    finally:
        if runner is not None:
            await runner.cleanup()
        if owned:
            shutil.rmtree(metrics_dir, ignore_errors=True)
