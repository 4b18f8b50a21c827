"""What the parts of one worker share, built once by its consumer and handed to each of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from arbiter.scorer import Scorer
from worker.jobs import Offload
from worker.policies import ExponentialBackoff
from worker.settings import WorkerSettings
from worker.tries import Tries


@dataclass(frozen=True)
class QueueInfo:
    """The job queue: its URL, its redrive policy's ``maxReceiveCount`` and dead-letter queue."""

    url: str
    max_receive_count: int | None
    dlq_url: str | None

    def tries(self, settings: WorkerSettings) -> Tries:
        """The worker's tries on this queue (:mod:`worker.tries`)."""
        return Tries(
            settings.max_receive_count,
            self.max_receive_count,
            ExponentialBackoff(settings.backoff_base_s, settings.backoff_max_s),
            settings.max_outage_s,
            settings.circuit_probe_max_s + settings.wait_time_s,
        )


@dataclass(frozen=True)
class WorkerContext:
    """One worker's settings, clients, engine and queue (:class:`QueueInfo`). ``tries``: its tries on the queue
    (:mod:`worker.tries`; None, no limit: a fan-out run by hand); ``metrics``: its
    :class:`~worker.metrics.WorkerMetrics` (None, none); ``run``: how engine calls run off the
    event loop (None: ``asyncio.to_thread``)."""

    settings: WorkerSettings
    s3: Any
    sqs: Any
    engine: Scorer
    queue: QueueInfo
    tries: Tries | None = None
    metrics: Any = None
    run: Offload | None = None
