"""structlog, configured once: JSON lines (console rendering on a terminal), request context merged in.

Handlers bind ``request_id`` and ``route`` with ``bind_contextvars``; work sent to a thread with
``asyncio.to_thread`` keeps them. Prompts and state text are never logged.
"""

from __future__ import annotations

import logging
import re
import sys
import uuid
from typing import Any, TextIO

import structlog

_ID_KEYS = {"request_id", "request-id", "requestid", "x-request-id", "rid", "trace_id"}
_MAX_ID = 128


def configure(json: bool | None = None, level: str = "info", stream: TextIO | None = None) -> None:
    """Set up structlog for the process: JSON unless ``stream`` is a terminal (or ``json`` says)."""
    stream = stream or sys.stderr
    use_json = json if json is not None else not stream.isatty()
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
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str = "arbiter") -> Any:
    return structlog.get_logger(name)


def request_id(custom_attributes: str | None, inference_id: str | None = None) -> str:
    """The request id for logs: from ``X-Amzn-SageMaker-Custom-Attributes``, else generated.

    The attributes are opaque to SageMaker; a ``request_id=...`` (or ``request-id``, ``trace_id``)
    pair in a comma- or semicolon-separated list is used, or the whole value when it is a single
    token. Then SageMaker's ``X-Amzn-SageMaker-Inference-Id``; then a random id.
    """
    if custom_attributes and custom_attributes.strip():
        for part in re.split(r"[,;]", custom_attributes):
            key, sep, value = part.partition("=")
            if sep and key.strip().lower() in _ID_KEYS and value.strip():
                return value.strip()[:_MAX_ID]
        if "=" not in custom_attributes:
            return custom_attributes.strip()[:_MAX_ID]
    if inference_id and inference_id.strip():
        return inference_id.strip()[:_MAX_ID]
    return uuid.uuid4().hex
