"""`arbiter serve`: the HTTP server on its port until SIGTERM (the SageMaker container's command)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from structlog.typing import FilteringBoundLogger

from arbiter.errors import ArbiterError
from arbiter.settings import EngineSettings, ServerSettings
from arbiter.signals import STOP_SIGNALS

if TYPE_CHECKING:
    from arbiter.engine.model_files import ModelFiles


def serve(host: str | None = None, port: int | None = None, model: Path | None = None) -> int:
    """Read the settings (``ARBITER_*``, SageMaker's, ``SM_LLAMA_CPP_*``), configure logging, and
    serve until SIGTERM or SIGINT; 1 when the model cannot be loaded, 2 for a refused setting.
    The model's, adapters' and profile's files are found and checked once, before the port is
    bound (a refusal there reaches ``arbiter``'s main as one line, status 2, not a server that
    starts to die); the engine then loads those files."""
    from arbiter.logging import configure, get_logger
    from arbiter.settings import from_environment

    try:
        engine_settings, server_settings, unknown = from_environment()
    except ArbiterError as exc:
        print(f"arbiter serve: {exc.message}", file=sys.stderr)
        return 2
    updates = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    server_settings = server_settings.model_copy(update=updates)
    if model is not None:
        engine_settings = engine_settings.model_copy(update={"model": model})
    # The files and the chat template, then the weights (check_before_listening).
    files = check_before_listening(engine_settings)
    from arbiter.ports import bind

    # The port next: a busy one is refused in one line before the model starts loading.
    sock = bind(server_settings.host, server_settings.port, "the container", "ARBITER_PORT")
    configure(json=server_settings.log_json, level=server_settings.log_level)
    log = get_logger("arbiter.serve")
    from arbiter import memory

    allocator = memory.tune()  # before any thread: freed large buffers go back to the system
    if allocator:
        log.info("allocator_tuned", **{k.lower().strip("_"): v for k, v in allocator.items()})
    if unknown:
        log.warning(
            "sm_llama_cpp_ignored",
            names=unknown,
            note="these llama-server flags have no meaning in Arbiter and are ignored",
        )
    return asyncio.run(_serve(server_settings, engine_settings, files, log, sock))


def check_before_listening(settings: EngineSettings) -> ModelFiles:
    """The files the engine will load, found once, and what refuses them before the port opens,
    each in one line (``ModelLoadError``): the model, its adapters, its prompt profile
    (``check_files``), and its chat template rendering a decision (from the GGUF's header:
    milliseconds). Loading the weights, and what needs them, follows after `listening`."""
    from arbiter.engine import check_files
    from arbiter.engine.prompting import check_template
    from arbiter.models import require_weights

    files = check_files(settings, weights=False)
    # The template before the weights: it needs only a vocabulary, and is the more specific
    # refusal when a file is wrong twice (a vocabulary-only GGUF whose template cannot render).
    check_template(files.model.path, settings, files.profile)
    require_weights(files.model.path)
    return files


def listening(settings: ServerSettings) -> tuple[str, str]:
    """Who can reach the server, and what guards it: the start-up line says both."""
    host = settings.host
    if host in ("", "0.0.0.0", "::"):
        where = "every interface (other machines can reach it)"
    elif host == "localhost" or _is_loopback(host):
        where = "loopback only (this machine); set ARBITER_HOST=0.0.0.0 to serve others"
    else:
        where = f"the interface {host}"
    if not settings.api_key:
        guard = "no API key: whoever reaches it can compute (set ARBITER_API_KEY)"
    elif settings.api_key_exempt_invocations:
        guard = "ARBITER_API_KEY guards /v1/*; /invocations is left to SageMaker's IAM"
    else:
        guard = "ARBITER_API_KEY guards /invocations and /v1/*"
    return where, guard


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _serve(
    server_settings: ServerSettings,
    engine_settings: EngineSettings,
    files: ModelFiles | None,
    log: FilteringBoundLogger,
    sock: socket.socket,
) -> int:
    from aiohttp import web

    from adapter.app import create_app
    from adapter.state import STATE
    from arbiter.engine import open_engine

    def progress(event: str, fields: dict[str, Any]) -> None:  # each step of the load, as it starts
        log.info(event, **fields)

    cancel = threading.Event()  # a stop while the model loads cancels the load
    app = create_app(
        server_settings,
        lambda: open_engine(engine_settings, files=files, progress=progress, cancel=cancel),
        load_cancel=cancel,
    )
    # handler_cancellation: a client that disconnects cancels its handler, so it leaves the queue.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    where, guard = listening(server_settings)
    exposed = not server_settings.api_key and not where.startswith("loopback")
    (log.warning if exposed else log.info)(
        "listening",
        url=f"http://{_url_host(server_settings.host)}:{sock.getsockname()[1]}",
        host=server_settings.host,
        port=sock.getsockname()[1],
        reach=where,
        api_key=guard,
        max_in_flight=server_settings.max_in_flight,
        max_queue=server_settings.max_queue,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
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
        loading = not holder.loaded.is_set()
        log.info("shutting down", model_load="cancelled" if loading else "done")
        holder.cancel()  # a load still running stops within a fraction of a second
    await runner.cleanup()
    return code
