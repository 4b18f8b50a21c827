"""Prometheus metrics of the worker pool, defined here and nowhere else.

Worker processes write their samples to ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's
multiprocess mode; :func:`worker.pool.prepare_multiprocess_dir` sets the variable before any
process imports prometheus_client); the pool process serves the merged view on the metrics port.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from worker.settings import MULTIPROC_ENV


class WorkerMetrics:
    """The worker's metrics. ``registry=None`` registers nowhere (multiprocess mode: the samples
    go to files that the pool's collector reads); tests pass their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.jobs = Counter(
            "arbiter_worker_jobs_total",
            "Jobs by outcome (ok, failed, rejected, duplicate, superseded, ignored, unreadable, "
            "lease_lost: stopped as its message's visibility could not be kept; "
            "split: cut into shards, repaired: a split job's message back, its unfinished shards "
            "sent again, merged: a split job's results and summary written).",
            ["outcome"],
            registry=registry,
        )
        self.lines = Counter(
            "arbiter_worker_lines_total",
            "Job lines by outcome (ok, error).",
            ["outcome"],
            registry=registry,
        )
        self.task_protected = Gauge(
            "arbiter_worker_task_protected",
            "1 while the pool holds the ECS task's scale-in protection (worker/protection.py).",
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.task_protection_errors = Counter(
            "arbiter_worker_task_protection_errors_total",
            "Calls to the ECS agent's task-protection endpoint that failed or were refused.",
            registry=registry,
        )
        self.ready = Gauge(
            "arbiter_worker_ready",
            "Worker processes with their engine loaded and their queue found, taking messages "
            "(`arbiter local` waits for all of them before it says it is up).",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.decisions_per_s = Gauge(
            "arbiter_worker_decisions_per_second",
            "Decisions per second of the latest job, summed over live worker processes.",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.job_seconds = Histogram(
            "arbiter_worker_job_seconds",
            "Wall time of a job, from receive to the summary written.",
            buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
            registry=registry,
        )
        self.receive_latency = Histogram(
            "arbiter_worker_receive_latency_seconds",
            "Age of a message when a worker received it (SentTimestamp to receive).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=registry,
        )
        self.visibility_extensions = Counter(
            "arbiter_worker_visibility_extensions_total",
            "Heartbeats that extended a running job's message visibility.",
            registry=registry,
        )
        self.dlq_moves = Counter(
            "arbiter_worker_dlq_moves_total",
            "Messages the worker sent to the dead-letter queue: after their last allowed receive "
            "failed (reason=max_receives), or at once: not a job (reason=unreadable), or a job no "
            "retry can fix, such as a deleted input (reason=permanent); a copy of a shard's "
            "message when its last allowed receive failed (reason=shard_failed).",
            ["reason"],
            registry=registry,
        )
        self.shards = Counter(
            "arbiter_worker_shards_total",
            "Shards of split jobs by outcome: scored (ok), found done already or lost to another "
            "attempt (duplicate), failed for good (failed).",
            ["outcome"],
            registry=registry,
        )
        self.merges = Counter(
            "arbiter_worker_merges_total",
            "Merges of split jobs by outcome: the summary written (ok).",
            ["outcome"],
            registry=registry,
        )
        self.merge_seconds = Histogram(
            "arbiter_worker_merge_seconds",
            "Wall time of a merge, from its message's receive to the summary written.",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.circuit_open = Gauge(
            "arbiter_worker_circuit_open",
            "1 while a worker's circuit breaker for the dependency (store: S3, queue: SQS) is "
            "open: it takes no message until the dependency answers again (the largest over "
            "live worker processes).",
            ["dependency"],
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.circuit_opens = Counter(
            "arbiter_worker_circuit_opens_total",
            "Times a worker's circuit breaker opened (its dependency stopped answering).",
            ["dependency"],
            registry=registry,
        )
        self.outage_retries = Counter(
            "arbiter_worker_outage_retries_total",
            "Receives that failed on a store or queue fault (5xx, throttling, timeouts, "
            "connection errors, 409, denied): given back with backoff, not counted as a try.",
            ["dependency"],
            registry=registry,
        )
        self.restarts = Counter(
            "arbiter_worker_restarts_total",
            "Worker processes restarted after dying.",
            registry=registry,
        )


def multiprocess_registry() -> CollectorRegistry:
    """A registry that reads every process's samples at each scrape."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry


def mark_process_dead(pid: int) -> None:
    """Drop a dead process's live gauges (counters and histograms keep their samples)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
