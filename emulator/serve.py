"""`arbiter runtime`: the SageMaker Runtime API on its port until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import sys

from arbiter.signals import STOP_SIGNALS
from emulator.settings import RuntimeSettings


def serve(settings: RuntimeSettings) -> int:
    from arbiter.logging import configure
    from emulator.aws_guard import RuntimeRefused, check_aws

    try:
        check_aws(settings)
    except RuntimeRefused as exc:  # one line, no traceback, before anything is touched
        print(f"arbiter runtime: refused: {exc}", file=sys.stderr, flush=True)
        return 2
    configure(level="info")
    return asyncio.run(_serve(settings))


async def _serve(settings: RuntimeSettings) -> int:
    from aiohttp import web

    from arbiter.errors import ArbiterError
    from arbiter.ports import bind
    from emulator.app import create_app
    from emulator.protocol import FrontRunner
    from emulator.state import FRONT

    try:  # the port first: taken, it is one line before a queue or topic is touched
        sock = bind(settings.host, settings.port, "the runtime API", "ARBITER_RUNTIME_PORT")
    except ArbiterError as exc:
        print(f"arbiter runtime: {exc.message}", file=sys.stderr, flush=True)
        return 2
    app = create_app(settings)
    # handler_cancellation: a caller that hangs up cancels its container call too.
    runner = FrontRunner(app, settings.body_timeout_s, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    port = runner.addresses[0][1]
    front = app[FRONT]
    served = []
    for name, spec in front.endpoints.items():
        if spec.asynchronous is None:
            served.append(f"{name} (real-time, variant {spec.variant})")
        else:
            served.append(
                f"{name} (async, variant {spec.variant}, {spec.asynchronous.max_concurrent} at "
                f"once, output {spec.asynchronous.output_path})"
            )
    print(
        f"SageMaker runtime API: http://{settings.host}:{port}  endpoint name: "
        f"{', '.join(served)}  container {settings.container_url}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    return 0
