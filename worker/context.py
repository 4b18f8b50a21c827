"""What the parts of one worker share, built once by its consumer and handed to each of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from arbiter.scorer import Scorer
from worker.jobs import Runner
from worker.settings import WorkerSettings
from worker.tries import Tries


@dataclass(frozen=True)
class WorkerContext:
    """One worker's settings, clients, engine and queue. ``tries``: its tries on the queue
    (:mod:`worker.tries`; None, no limit: a fan-out run by hand); ``metrics``: its
    :class:`~worker.metrics.WorkerMetrics` (None, none); ``run``: how engine calls run off the
    event loop (None: ``asyncio.to_thread``)."""

    settings: WorkerSettings
    s3: Any
    sqs: Any
    engine: Scorer
    queue_url: str
    dlq_url: str | None = None
    tries: Tries | None = None
    metrics: Any = None
    run: Runner | None = None
