"""What the worker's tests build the same way: settings against the moto endpoint, a queue
consumer with a registry of its own, and a metric's value."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from worker.context import WorkerContext
from worker.metrics import WorkerMetrics
from worker.queue import Consumer, describe_queue
from worker.settings import WorkerSettings


def settings_for(endpoint: str, **kw: Any) -> WorkerSettings:
    """Worker settings for bucket ``jobs`` on ``endpoint``: short polls, no backoff delay."""
    base: dict[str, Any] = {
        "aws_endpoint_url": endpoint,
        "bucket": "jobs",
        "wait_time_s": 1,
        "visibility_timeout_s": 30,
        "backoff_base_s": 0,
    }
    return WorkerSettings(**{**base, **kw})


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels or None) or 0.0


async def make_consumer(
    settings: WorkerSettings, s3: Any, sqs: Any, engine: Any, **kw: Any
) -> tuple[Consumer, CollectorRegistry]:
    """A queue consumer over ``engine`` and the registry its metrics go to."""
    registry = CollectorRegistry()
    queue = await describe_queue(sqs, settings)
    ctx = WorkerContext(settings, s3, sqs, engine, queue, metrics=WorkerMetrics(registry))
    return Consumer(ctx, **kw), registry
