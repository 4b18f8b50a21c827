"""`arbiter serve` (the SageMaker container's entry point) and `arbiter bench http`."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from arbiter.errors import ArbiterError


def register(subparsers: Any, bench_subparsers: Any = None) -> None:
    """Add ``serve`` to the top-level commands and ``http`` under ``bench``."""
    serve = subparsers.add_parser(
        "serve", help="run the HTTP server (SageMaker /ping + /invocations, chat, metrics)"
    )
    serve.add_argument("--host", default=None, help="interface (default ARBITER_HOST or 0.0.0.0)")
    serve.add_argument("--port", type=int, default=None, help="port (default: env, else 8080)")
    serve.add_argument("--model", type=Path, default=None, help="a .gguf (else ARBITER_MODEL...)")
    serve.set_defaults(func=cmd_serve)

    if bench_subparsers is not None:
        http = bench_subparsers.add_parser(
            "http", help="HTTP overhead vs the engine, and an overload soak"
        )
        http.add_argument("--model", type=Path, default=None)
        http.add_argument("--repeats", type=int, default=20, help="single-decision samples")
        http.add_argument("--overload-s", type=float, default=20.0)
        http.add_argument("--clients", type=int, default=32)
        http.add_argument("--json", action="store_true", help="print JSON (last line: the summary)")
        http.set_defaults(func=cmd_bench_http)


def cmd_bench_http(args: argparse.Namespace) -> int:
    from bench.http_bench import main

    return main(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from arbiter.logging import configure, get_logger
    from arbiter.settings import from_environment

    try:
        engine_settings, server_settings, unknown = from_environment()
    except ArbiterError as exc:
        print(f"arbiter serve: {exc.message}", file=sys.stderr)
        return 2
    updates = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    server_settings = server_settings.model_copy(update=updates)
    if args.model is not None:
        engine_settings = engine_settings.model_copy(update={"model": args.model})
    configure(json=server_settings.log_json, level=server_settings.log_level)
    log = get_logger("arbiter.serve")
    if unknown:
        log.warning(
            "sm_llama_cpp_ignored",
            names=unknown,
            note="these llama-server flags have no meaning in Arbiter and are ignored",
        )
    return asyncio.run(_serve(server_settings, engine_settings, log))


async def _serve(server_settings: Any, engine_settings: Any, log: Any) -> int:
    from aiohttp import web

    from adapter.app import STATE, create_app
    from arbiter.engine import Engine

    app = create_app(server_settings, lambda: Engine(engine_settings))
    # handler_cancellation: a client that disconnects cancels its handler, so it leaves the queue.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, server_settings.host, server_settings.port)
    await site.start()
    log.info(
        "listening",
        host=server_settings.host,
        port=server_settings.port,
        max_in_flight=server_settings.max_in_flight,
        max_queue=server_settings.max_queue,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    holder = app[STATE].holder
    await asyncio.wait(
        [asyncio.ensure_future(holder.loaded.wait()), asyncio.ensure_future(stop.wait())],
        return_when=asyncio.FIRST_COMPLETED,
    )
    code = 0
    if holder.error is not None:
        log.error("exiting: the model could not be loaded", error=str(holder.error))
        code = 1
    else:
        await stop.wait()
        log.info("shutting down")
    await runner.cleanup()
    return code
