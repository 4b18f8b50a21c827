"""The front's Prometheus metrics (its own registry, served at ``GET /metrics`` on its port).

``arbiter_runtime_async_backlog`` is SageMaker's ``ApproximateBacklogSize``: async requests queued or
being processed, the number its backlog autoscaling reads (``ApproximateBacklogSizePerInstance``,
with one instance here).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RuntimeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.invocations = Counter(
            "arbiter_runtime_invocations",
            "Runtime API calls by operation and HTTP status returned",
            ["operation", "status"],
            registry=self.registry,
        )
        self.backlog = Gauge(
            "arbiter_runtime_async_backlog",
            "ApproximateBacklogSize: async requests queued or in processing",
            registry=self.registry,
        )
        self.async_in_flight = Gauge(
            "arbiter_runtime_async_in_flight",
            "Async requests the container is processing (at most MaxConcurrentInvocationsPerInstance)",
            registry=self.registry,
        )
        self.async_results = Counter(
            "arbiter_runtime_async_results",
            "Async requests finished, by outcome (completed, failed, expired, timed_out)",
            ["outcome"],
            registry=self.registry,
        )
