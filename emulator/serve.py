"""`arbiter runtime`: the SageMaker Runtime API on its port until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import signal
import sys

from emulator.settings import RuntimeSettings


def serve(settings: RuntimeSettings) -> int:
    from arbiter.logging import configure

    configure(level="info")
    return asyncio.run(_serve(settings))


async def _serve(settings: RuntimeSettings) -> int:
    from aiohttp import web

    from emulator.app import create_app
    from emulator.state import FRONT

    app = create_app(settings)
    # handler_cancellation: a caller that hangs up cancels its container call too.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as exc:  # the port is taken: one line, not a traceback
        print(
            f"arbiter runtime: cannot listen on {settings.host}:{settings.port} ({exc.strerror}); "
            "set ARBITER_RUNTIME_PORT",
            file=sys.stderr,
            flush=True,
        )
        await runner.cleanup()
        return 2
    port = runner.addresses[0][1]
    spec = app[FRONT].spec
    print(
        f"SageMaker runtime API: http://{settings.host}:{port}  endpoint name: "
        f"{settings.endpoint_name}  (variant {spec.variant}, container {settings.container_url}, "
        f"async: {spec.asynchronous.max_concurrent} at once, output {spec.asynchronous.output_path})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    return 0
