"""structlog, configured once per process, the same for the server and the worker pool.

JSON lines (console rendering on a terminal), the context bound with ``bind_contextvars`` merged in
(``request_id`` and ``route`` in the server, ``worker`` and ``pid`` in a worker process); work sent to
a thread with ``asyncio.to_thread`` keeps it. Prompts and state text are never logged.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, TextIO, cast

import structlog
from structlog.typing import FilteringBoundLogger


class _Writer:
    """Writes each line to ``stream``, or to whatever ``sys.stderr`` is at the time (a process
    that swaps its stderr, a test capturing it, logs where it points now). A log line that cannot
    be written (the stream closed by whoever started us) is dropped: losing a log line must never
    stop a request, a drain or a restart."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        out = self._stream or sys.stderr
        with contextlib.suppress(OSError, ValueError, AttributeError):
            out.write(message + "\n")
            out.flush()

    log = debug = info = warn = warning = fatal = failure = err = error = critical = exception = msg


def configure(json: bool | None = None, level: str = "info", stream: TextIO | None = None) -> None:
    """Set up structlog for the process: JSON unless ``stream`` (stderr) is a terminal, or as
    ``json`` says; ``level`` is debug, info, warning or error."""
    out = stream or sys.stderr
    use_json = json if json is not None else not out.isatty()
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if use_json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=lambda *_: _Writer(stream),
        # Loggers are made at import time (module globals): they must follow a later configure.
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "arbiter") -> FilteringBoundLogger:
    return cast(FilteringBoundLogger, structlog.get_logger(name))
