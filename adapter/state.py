"""What the handlers share, under typed keys: the app's state and each request's log record.

No module globals: ``create_app`` builds one ``State`` per app (tests build apps with their own
settings, engine and metrics side by side).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from adapter.admission import Admission
from adapter.metrics import Metrics
from arbiter.engine import Engine
from arbiter.errors import ArbiterError, LoadCancelled, ModelNotReady
from arbiter.logging import get_logger
from arbiter.settings import ServerSettings

log = get_logger("arbiter.http")


@dataclass(frozen=True)
class Throughput:
    """How fast this container scores JSON Lines, measured once (``adapter.execution``) to size
    Batch Transform's payloads."""

    seconds_per_mb: float
    lines_per_s: float


class EngineHolder:
    """Owns the engine's lifetime: loaded in a thread at start-up, closed at shutdown; a load
    still running at shutdown is cancelled through ``cancel_event``, which the factory's engine
    watches."""

    def __init__(
        self, factory: Callable[[], Engine], cancel_event: threading.Event | None = None
    ) -> None:
        self._factory = factory
        self.cancel_event = cancel_event or threading.Event()
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.loaded = asyncio.Event()

    def cancel(self) -> None:
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return isinstance(self.error, LoadCancelled)

    async def load(self) -> None:
        started = time.perf_counter()
        try:
            self.engine = await asyncio.to_thread(self._factory)
        except LoadCancelled as exc:
            self.error = exc
            log.info("model_load_cancelled", seconds=round(time.perf_counter() - started, 3))
        except Exception as exc:
            self.error = exc
            # A refusal says what is wrong in its message; anything else keeps its traceback.
            refused = isinstance(exc, ArbiterError)
            log.error("model_load_failed", error=str(exc), exc_info=not refused)
        else:
            log.info(
                "model_loaded",
                model=self.engine.model_info.file,
                seconds=round(time.perf_counter() - started, 3),
            )
        finally:
            self.loaded.set()

    def require(self) -> Engine:
        """The engine, or the error that answers the request: 503 while it loads, the load's own
        error after it failed."""
        if self.engine is not None:
            return self.engine
        if self.error is not None:
            raise (
                self.error
                if isinstance(self.error, ArbiterError)
                else ArbiterError(f"the model failed to load: {self.error}")
            )
        raise ModelNotReady("the model is still loading; retry shortly", retry_after=1)


@dataclass
class State:
    settings: ServerSettings
    holder: EngineHolder
    admission: Admission
    metrics: Metrics
    openapi: bytes
    batch_speed: Throughput | None = None  # measured once (adapter.execution)
    batch_sized: dict[float, int] = field(default_factory=dict)  # MaxPayloadInMB by timeout, logged
    warming: bool = False  # /ping waits for the start-up measurement under Batch Transform
    sizing: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class RequestLog:
    """What one request did, for its log line and metrics (filled in by the handler)."""

    kind: str = "-"
    decisions: int = 0
    tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


STATE = web.AppKey("state", State)
CLOSE_ENGINE = web.AppKey("close_engine", bool)
REQUEST_LOG = web.RequestKey("request_log", RequestLog)
