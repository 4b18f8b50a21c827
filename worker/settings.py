"""The worker pool's configuration: every ``ARBITER_*`` variable the worker reads is named here."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from aiobotocore.config import AioConfig
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from arbiter.settings import cpu_count

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Where prometheus-client's multiprocess mode keeps every process's samples (the pool sets it).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class _Env(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ARBITER_", extra="ignore", populate_by_name=True)


class StoreSettings(_Env):
    """Where jobs come from and go to: the endpoint, the bucket and its prefixes, the queues."""

    aws_endpoint_url: str | None = Field(
        default=None,
        description="S3 and SQS endpoint (a moto server, LocalStack); unset: the AWS default.",
    )
    aws_region: str = Field(default="us-east-1", description="Region of the bucket and queues.")
    aws_max_attempts: int = Field(
        default=3,
        ge=1,
        le=20,
        description="Sends of each S3 or SQS request (botocore's standard retry mode); past "
        "them the worker gives the message back and waits out the outage itself.",
    )
    bucket: str = Field(default="arbiter-jobs", min_length=3, description="Job bucket.")
    input_prefix: str = Field(default="incoming/", description="Jobs are dropped under this.")
    output_prefix: str = Field(
        default="results/",
        min_length=1,
        max_length=512,
        description="Results go here (output keys must fit S3's 1,024 bytes).",
    )
    queue_name: str = Field(default="arbiter-jobs", description="Queue of S3 notifications.")
    queue_url: str | None = Field(
        default=None, description="Queue URL; unset: looked up from queue_name."
    )
    dlq_name: str = Field(default="arbiter-jobs-dlq", description="Dead-letter queue name.")
    shard_prefix: str = Field(
        default="shards/",
        min_length=1,
        max_length=256,
        description="Where a split job's shard inputs, outputs and markers live while it runs.",
    )
    tmp_dir: str | None = Field(
        default=None, description="Where results are spooled before upload."
    )

    @model_validator(mode="after")
    def _prefixes_apart(self) -> StoreSettings:
        a, b = self.input_prefix, self.output_prefix
        if a.startswith(b) or b.startswith(a):
            raise ValueError(
                f"output_prefix {b!r} and input_prefix {a!r} overlap: results would be "
                "picked up as new jobs"
            )
        for name, other in (("input_prefix", a), ("output_prefix", b)):
            c = self.shard_prefix
            if c.startswith(other) or other.startswith(c):
                raise ValueError(
                    f"shard_prefix {c!r} and {name} {other!r} overlap: shards would be picked up "
                    "as jobs or mixed with results"
                )
        return self

    def client_config(self) -> AioConfig:
        """botocore's standard retry mode (throttling, 5xx, timeouts and connection errors, within
        a retry quota), ``aws_max_attempts`` sends of each request: beyond that, a store or queue
        fault is the worker's to wait out (:mod:`worker.faults`), not botocore's."""
        return AioConfig(retries={"mode": "standard", "total_max_attempts": self.aws_max_attempts})

    def client_kwargs(self) -> dict[str, Any]:
        """aiobotocore client arguments. A loopback endpoint (moto) with no credentials in the
        environment gets moto's dummy ones, so `arbiter local` needs no AWS set-up."""
        kwargs: dict[str, Any] = {"region_name": self.aws_region, "config": self.client_config()}
        if self.aws_endpoint_url:
            kwargs["endpoint_url"] = self.aws_endpoint_url
            host = urlsplit(self.aws_endpoint_url).hostname or ""
            if host in _LOOPBACK and not os.environ.get("AWS_ACCESS_KEY_ID"):
                kwargs["aws_access_key_id"] = "testing"
                kwargs["aws_secret_access_key"] = "testing"
        return kwargs


class QueueSettings(_Env):
    """How a worker takes messages: long polls, leases, tries, backoff, the circuit breaker."""

    max_receive_count: int = Field(
        default=5,
        ge=1,
        le=997,
        description="Tries the worker allows a job, shard or merge message; then a job goes to the "
        "DLQ and a shard fails for good. Only failures of the engine or the data count (a store "
        "or queue fault is retried without spending one). The queue's redrive allows 3 more.",
    )
    wait_time_s: int = Field(default=20, ge=0, le=20, description="SQS long-poll wait.")
    visibility_timeout_s: int = Field(
        default=60, ge=1, le=43_200, description="Visibility a job message is given (and renewed)."
    )
    heartbeat_s: float | None = Field(
        default=None,
        gt=0,
        description="Visibility renewal interval; unset: a third of the timeout.",
    )
    backoff_base_s: float = Field(
        default=2.0,
        ge=0,
        description="Retry delay after a message's first failed receive (or its first store or "
        "queue fault); doubles.",
    )
    backoff_max_s: float = Field(default=300.0, ge=0, le=43_200, description="Retry delay cap.")
    drain_deadline_s: float = Field(
        default=25.0, ge=0, description="On SIGTERM: time to finish the job in hand, then release."
    )
    max_outage_s: float = Field(
        default=86_400.0,
        gt=0,
        description="A message that fails on nothing but store or queue faults (5xx, throttling, "
        "timeouts, 409, denied) is retried with backoff without spending a try; past this long "
        "it is given up (a shard failed, a job dead-lettered) before SQS's retention drops it.",
    )
    circuit_probe_s: float = Field(
        default=1.0,
        gt=0,
        description="While the store is down, the worker receives nothing and probes it after "
        "this long, doubling up to circuit_probe_max_s.",
    )
    circuit_probe_max_s: float = Field(
        default=30.0, gt=0, description="Longest wait between two probes of a store that is down."
    )

    @model_validator(mode="after")
    def _heartbeat_within_visibility(self) -> QueueSettings:
        if self.heartbeat_s is not None and self.heartbeat_s > self.visibility_timeout_s / 2:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s:g}) must be at most half of visibility_timeout_s "
                f"({self.visibility_timeout_s}): a late or failed renewal would let a second "
                "worker take a running job"
            )
        return self

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s or max(0.5, self.visibility_timeout_s / 3)


class JobSettings(_Env):
    """How a job is read, scored, split and written back."""

    chunk_decisions: int = Field(
        default=256, ge=1, description="Lines parsed and scored per engine call (bounds memory)."
    )
    chunk_mb: float = Field(
        default=16.0, gt=0, description="A chunk is scored early once its lines hold this much."
    )
    max_line_bytes: int = Field(
        default=6 * 1024 * 1024,
        ge=256,
        description="Longest job line or .json element; a longer one is a payload_too_large line.",
    )
    multipart_threshold_mb: float = Field(
        default=16.0, ge=0, description="Results larger than this are uploaded in parts."
    )
    part_size_mb: float = Field(
        default=8.0, ge=5, description="Multipart part size (S3's minimum is 5 MiB)."
    )
    shard_lines: int = Field(
        default=1000,
        ge=0,
        description="A job with more lines is split into shards of about this many lines, scored "
        "by any worker and merged in order (~4 min each at 4 decisions/s); 0: never split. An "
        "object's x-amz-meta-arbiter-shard-lines sets its own.",
    )


class PoolSettings(_Env):
    """How ``arbiter work`` runs its worker processes and serves their metrics."""

    worker_processes: int = Field(
        default=1, ge=1, le=64, description="Worker processes, each with its own engine."
    )
    worker_threads: int | None = Field(
        default=None, ge=1, description="llama.cpp threads per process; unset: cores / processes."
    )
    worker_engine_factory: str = Field(
        default="arbiter.engine:open_engine",
        description="`module:callable` building the engine from EngineSettings (tests use a fake).",
    )
    restart_delay_s: float = Field(
        default=1.0, ge=0, description="Wait before restarting a worker process that died; doubles."
    )
    restart_max_delay_s: float = Field(
        default=60.0, ge=0, description="Longest wait before a restart (the doubling's cap)."
    )
    restart_reset_s: float = Field(
        default=60.0,
        ge=0,
        description="A worker that ran this long before dying starts a new count of restarts.",
    )
    max_restarts: int = Field(
        default=5,
        ge=0,
        description="Restarts in a row of a worker that keeps dying young; one more death and "
        "the pool drains and exits 1 (a crash loop is for the orchestrator to see).",
    )
    metrics_port: int = Field(
        default=9108, ge=0, le=65535, description="Prometheus /metrics of the pool (0: off)."
    )
    metrics_host: str = Field(default="127.0.0.1", description="Address /metrics binds to.")
    ecs_agent_uri: str | None = Field(
        default=None,
        validation_alias="ECS_AGENT_URI",
        description="Set by ECS in every task's containers: the agent's endpoint, where the pool "
        "sets the task's scale-in protection (worker/protection.py). Unset: no protection.",
    )
    task_protection: bool = Field(
        default=True,
        description="On ECS, protect the task from scale-in while a worker holds a message.",
    )
    task_protection_minutes: int = Field(
        default=60,
        ge=1,
        le=2880,
        description="How long each protection is asked for; renewed at half of it while held.",
    )
    task_protection_idle_s: float = Field(
        default=30.0,
        ge=0,
        description="Idle time of every worker process before the protection is cleared.",
    )
    task_protection_window_minutes: float = Field(
        default=15.0,
        gt=0,
        description="The longest a busy task stays protected at a stretch: then the protection "
        "is cleared for ARBITER_TASK_PROTECTION_REST_S, so a deployment can replace the task "
        "(its SIGTERM drains the messages in hand) instead of waiting for the backlog to drain.",
    )
    task_protection_rest_s: float = Field(
        default=120.0,
        ge=0,
        description="How long the protection stays cleared after a window, however busy the task.",
    )

    def threads_per_process(self) -> int:
        return self.worker_threads or max(1, cpu_count() // self.worker_processes)


class WorkerSettings(StoreSettings, QueueSettings, JobSettings, PoolSettings):
    """Every ``ARBITER_*`` variable of the worker pool, in one object (env prefix ``ARBITER_``).

    The engine itself is configured by :class:`arbiter.settings.EngineSettings` (``ARBITER_MODEL``,
    ``ARBITER_N_CTX``, ...); the pool overrides only ``n_threads`` (cores / processes).
    """
