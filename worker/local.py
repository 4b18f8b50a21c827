"""`arbiter local`: the whole stack on one machine, as one thing.

A moto server on 127.0.0.1 stands in for S3 and SQS (unless ARBITER_AWS_ENDPOINT_URL names one),
the bucket, queue, dead-letter queue and S3 -> SQS notification are created, and `arbiter serve`,
`arbiter work` and `arbiter runtime` run as child processes. The ports follow one base
(:mod:`worker.local_ports`), claimed before anything starts (a busy one, or one a second stack
holds, refused in one line); "up" is printed once every part answers, with what is still loading
meanwhile (:mod:`worker.local_watch`); Ctrl-C, SIGTERM or SIGHUP (a closed terminal:
:mod:`worker.local_terminal`) stops everything at any moment, a second one at once; the S3 + SQS
state is kept for the next run (:mod:`worker.local_state`), so what the stack accepted is answered
after a restart, and a stop that cannot keep it names each request lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from arbiter.ports import handed_down
from arbiter.signals import STOP_SIGNALS
from worker import local_state
from worker.local_ports import LocalSettings, Part, Ports, plan
from worker.local_terminal import outliving_terminal
from worker.local_watch import first_exit, wait_up
from worker.settings import WorkerSettings


class _Moto:
    """moto's S3 + SQS server in this process, serving on the socket :func:`plan` claimed (moto's
    own ``ThreadedMotoServer`` binds again, and waits forever when it cannot)."""

    def __init__(self, sock: socket.socket) -> None:
        try:
            from moto.moto_server.werkzeug_app import (
                DomainDispatcherApplication,
                MotoRequestHandler,
                create_backend_app,
            )
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise SystemExit(
                "arbiter local needs moto's server: pip install 'arbiter[local]' (or set "
                "ARBITER_AWS_ENDPOINT_URL to an S3/SQS endpoint)"
            ) from exc
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        host, port = sock.getsockname()[:2]
        sock.setblocking(True)
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(
            host, port, app, threaded=True, request_handler=MotoRequestHandler, fd=sock.fileno()
        )
        sock.close()  # the server holds its own copy
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


async def _provision(settings: WorkerSettings) -> dict[str, str]:
    from aiobotocore.session import get_session

    from worker.stack import ensure_stack

    session = get_session()
    async with (
        session.create_client("s3", **settings.client_kwargs()) as s3,
        session.create_client("sqs", **settings.client_kwargs()) as sqs,
    ):
        return await ensure_stack(s3, sqs, settings)


def local_settings(args: argparse.Namespace) -> LocalSettings:
    updates = {"port": args.port, "moto_port": args.moto_port}
    return LocalSettings().model_copy(update={k: v for k, v in updates.items() if v is not None})


class _Stopped(BaseException):
    """A stop signal that came while the event loop was not there to take it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals(handler: Any) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, was in previous.items():
            signal.signal(sig, was)


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def run_local(args: argparse.Namespace) -> int:
    """The stack until a stop signal (SIGINT, SIGTERM, SIGHUP) or a part's exit. Outside the event
    loop a stop signal ends the start at once (128 + its number), with what was started stopped
    and kept; the state's save is not interrupted."""
    with outliving_terminal(), _signals(_raise_stopped):
        try:
            return _run_local(args)
        except _Stopped as stopped:
            return 128 + stopped.signum


def _run_local(args: argparse.Namespace) -> int:
    settings = local_settings(args)
    base = WorkerSettings()
    serve = not args.no_serve and importlib.util.find_spec("adapter.app") is not None
    if not args.no_serve and not serve:
        print("note: `arbiter serve` is not available in this build; not started", flush=True)
    if serve or not args.no_work:  # a missing model refused before anything starts
        from arbiter.engine import check_files
        from arbiter.settings import engine_from_environment

        check_files(engine_from_environment())
    moto = not base.aws_endpoint_url
    # Every port claimed and held from here: a second stack is refused now, in one line.
    with plan(
        settings, serve=serve, runtime=not args.no_runtime, work=not args.no_work, moto=moto
    ) as ports:
        state = settings.state_path(ports.s3.port) if ports.s3 is not None else None
        restored = None
        if state is not None:
            if args.fresh:
                local_state.discard(state)
            else:
                restored = local_state.load(state)  # refused in one line before anything starts
        server = _Moto(ports.s3.sock) if ports.s3 is not None and ports.s3.sock else None
        endpoint = server.endpoint if server is not None else base.aws_endpoint_url or ""
        code = 1
        try:
            code = asyncio.run(_run(args, settings, base, ports, endpoint, (state, restored)))
        finally:
            if server is not None:
                with _signals(signal.SIG_IGN):  # a save cut short would lose the run's state
                    server.stop()
                    if not _keep(state):
                        code = code or 1
        return code


def _keep(state: Path | None) -> bool:
    """The S3 + SQS state saved for the next run, or each request lost with it named; False if
    it could not be saved."""
    if state is None:
        why = "the local S3 + SQS state is not kept between runs"
    else:
        try:
            kept = local_state.save(state)
        except Exception as exc:  # a full disk, a path made unusable: say what is lost
            why = f"could not keep the local S3 + SQS state in {state} ({exc})"
        else:
            print(f"kept the local S3 + SQS state in {state} ({kept})", flush=True)
            return True
    lost = local_state.unanswered()
    if lost:
        why += f"; lost with it, {len(lost)} accepted and not yet answered:"
    if lost or state is not None:  # not kept, and nothing lost: the start line said so
        print("\n  ".join([f"arbiter local: {why}", *lost]), flush=True)
    return state is None


def _child_env(
    args: argparse.Namespace, settings: LocalSettings, ports: Ports, endpoint: str
) -> dict[str, str]:
    env = {**os.environ, "ARBITER_AWS_ENDPOINT_URL": endpoint}
    if not env.get("AWS_ACCESS_KEY_ID"):
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    if args.processes:
        env["ARBITER_WORKER_PROCESSES"] = str(args.processes)
    if ports.container is not None:
        env["ARBITER_PORT"] = str(ports.container.port)
    if ports.runtime is not None:
        env["ARBITER_RUNTIME_PORT"] = str(ports.runtime.port)
        env["ARBITER_RUNTIME_CONTAINER_URL"] = container_url(settings, ports)
    env["ARBITER_METRICS_PORT"] = str(ports.metrics.port if ports.metrics else 0)
    # A stop hands back what each part holds after this long (the queues keep it, and the state
    # file keeps the queues), so Ctrl-C ends the stack within seconds.
    env.setdefault("ARBITER_DRAIN_DEADLINE_S", f"{settings.drain_s:g}")
    env.setdefault("ARBITER_RUNTIME_DRAIN_S", f"{settings.drain_s:g}")
    return env


def container_url(settings: LocalSettings, ports: Ports) -> str:
    """The container the runtime calls: the one this stack starts, unless one is named."""
    if settings.container_url:
        return settings.container_url
    port = ports.container.port if ports.container is not None else settings.port
    host = settings.host if settings.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    return f"http://{host if ':' not in host else f'[{host}]'}:{port}"


async def _run(
    args: argparse.Namespace,
    settings: LocalSettings,
    base: WorkerSettings,
    ports: Ports,
    endpoint: str,
    kept: tuple[Path | None, local_state.Held | None],
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:  # a closed terminal's SIGHUP too: the state is kept as for Ctrl-C
        loop.add_signal_handler(sig, stop.set)
    worker_settings = base.model_copy(update={"aws_endpoint_url": endpoint})
    env = _child_env(args, settings, ports, endpoint)
    _say_starting(ports, endpoint, kept)
    stack = await _provision(worker_settings)
    children = _spawn(args, ports, env)
    try:
        exited = asyncio.create_task(first_exit(children))
        stopped = asyncio.create_task(stop.wait())
        processes = int(env.get("ARBITER_WORKER_PROCESSES") or base.worker_processes)
        up = asyncio.create_task(wait_up(ports, container_url(settings, ports), processes))
        done = await _first(up, exited, stopped)
        if done is up:
            _say_up(worker_settings, stack, endpoint, up.result())
            if args.submit is not None:
                container = container_url(settings, ports) if ports.container else None
                demo = asyncio.create_task(_demo(worker_settings, args.submit, container))
                await _first(demo, exited, stopped)
            await _first(exited, stopped)
        crashed = exited.done() and not stop.is_set()
        if crashed:
            name, code = exited.result()
            print(
                f"arbiter local: {name} exited with status {code}; stopping the stack", flush=True
            )
        for task in (up, exited, stopped):
            task.cancel()
        return await _stop(children, stop, settings.drain_s + 20) or int(crashed)
    except BaseException:
        for child in children.values():
            if child.poll() is None:
                child.kill()
        raise


async def _first(*tasks: asyncio.Task[Any]) -> asyncio.Task[Any]:
    """The first of ``tasks`` to finish (the others keep running); a task that failed raises."""
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        if task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
            return task
    raise AssertionError("asyncio.wait returned nothing")  # pragma: no cover


def _say_starting(
    ports: Ports, endpoint: str, kept: tuple[Path | None, local_state.Held | None]
) -> None:
    state, restored = kept
    lines = ["arbiter local: starting (ARBITER_PORT moves every port; Ctrl-C stops)"]
    for part in ports.parts():
        lines.append(f"  {part.name}: {part.host}:{part.port}")
    lines.append(f"  S3 + SQS endpoint: {endpoint}")
    if state is None:
        lines.append("  S3 + SQS state: not kept between runs")
    elif restored is None:
        lines.append(f"  S3 + SQS state: new, kept at stop in {state}")
    else:
        lines.append(f"  S3 + SQS state: restored from {state} ({restored})")
    print("\n".join(lines), flush=True)


def _say_up(settings: WorkerSettings, stack: dict[str, str], endpoint: str, seconds: float) -> None:
    print(
        f"arbiter local is up ({seconds:.0f} s)\n"
        f"  bucket:            s3://{settings.bucket}/{settings.input_prefix} -> "
        f"{settings.output_prefix}\n"
        f"  queue:             {stack['queue_url']} (dead letters: {stack['dlq_url']})\n"
        f"submit a job from another shell:\n"
        f"  ARBITER_AWS_ENDPOINT_URL={endpoint} arbiter submit examples/job.jsonl\n"
        f"Ctrl-C stops everything.",
        flush=True,
    )


async def _demo(settings: WorkerSettings, path: Any, container: str | None) -> None:
    """Submit a job the way `arbiter submit` does and show what came back; the last line names
    this stack's own container (``container``: its URL, None when it has none)."""
    from aiobotocore.session import get_session

    from worker.submit import submit

    summary = await submit(settings, path, timeout_s=900)
    if summary is None:
        print("the example job did not finish in 15 minutes", flush=True)
        return
    if "rejected" in summary:
        print(f"the job was rejected: {summary['rejected']}", flush=True)
        return
    brief = {k: summary[k] for k in ("lines", "ok", "failed", "errors_by_code", "seconds")}
    print(f"job summary: {json.dumps(brief)}", flush=True)
    async with get_session().create_client("s3", **settings.client_kwargs()) as s3:
        got = await s3.get_object(Bucket=settings.bucket, Key=summary["results_key"])
        async with got["Body"] as body:
            lines = (await body.read()).decode().splitlines()
    print(f"first results of {len(lines)} (s3://{settings.bucket}/{summary['results_key']}):")
    for line in lines[:5]:
        record = json.loads(line)
        outcome = record.get("result") or record.get("error")
        brief = (
            {
                "choice": outcome["choice"],
                "probabilities": [round(p, 3) for p in outcome["probabilities"]],
            }
            if "result" in record
            else {"error": outcome["code"]}
        )
        print(f"  line {record['line']} {record['id']}: {json.dumps(brief)}", flush=True)
    ping = f" (curl {container}/ping)" if container else ""
    print(f"the stack keeps running{ping}; Ctrl-C stops it.", flush=True)


def _spawn(
    args: argparse.Namespace, ports: Ports, env: dict[str, str]
) -> dict[str, subprocess.Popen[bytes]]:
    """The parts, by the name a user reads; each is handed the port claimed for it, and this
    process lets go of it (a part that dies must leave its port closed, not waiting)."""
    commands: list[tuple[str, Part | None]] = []
    if ports.container is not None:
        commands.append(("serve", ports.container))
    if not args.no_work:
        commands.append(("work", ports.metrics))
    if ports.runtime is not None:  # the SageMaker Runtime API; it prints its URL
        commands.append(("runtime", ports.runtime))
    names = {
        "serve": "the container (arbiter serve)",
        "work": "the worker pool (arbiter work)",
        "runtime": "the SageMaker runtime API (arbiter runtime)",
    }
    children = {}
    for command, part in commands:
        socks = [part.sock] if part is not None and part.sock is not None else []
        children[names[command]] = subprocess.Popen(
            [sys.executable, "-m", "arbiter", command],
            env={**env, **handed_down(socks)},
            pass_fds=[sock.fileno() for sock in socks],
        )
        for sock in socks:
            sock.close()
    return children


async def _stop(
    children: dict[str, subprocess.Popen[bytes]], again: asyncio.Event, timeout_s: float
) -> int:
    """SIGTERM to each child, then wait while they hand back what they hold; a second Ctrl-C or
    SIGTERM, or ``timeout_s``, kills the rest. 1 if one had to be killed."""
    again.clear()
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    print("arbiter local: stopping (Ctrl-C again to kill at once)", flush=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while any(c.poll() is None for c in children.values()):
        if again.is_set() or loop.time() > deadline:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(again.wait(), 0.1)
    status = 0
    for child in children.values():
        if child.poll() is None:
            child.kill()
            child.wait()
            status = 1
    return status
