"""Every Prometheus metric the adapter exports, on a registry of its own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from arbiter.schema import DecisionResult, ModelInfo

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    """Request, decision, token, backpressure and model metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "arbiter_requests",
            "HTTP requests by route, request kind and status.",
            ["route", "kind", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "arbiter_request_seconds",
            "Wall time of a request, from arrival to the last byte written.",
            ["route", "kind"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "arbiter_decisions",
            "Decisions by outcome (ok, or the error code).",
            ["outcome"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "arbiter_decision_seconds",
            "Engine time of a decision (tokenize + prefill + readout).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "arbiter_prefill_seconds",
            "Prefill time of a decision's group (or of a chat prompt).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "arbiter_prompt_tokens",
            "Prompt tokens per decision or chat completion.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.prefix_tokens = Counter(
            "arbiter_prefix_tokens",
            "Prompt tokens that were the shared state prefix of their decision.",
            registry=r,
        )
        self.prefix_cache = Counter(
            "arbiter_prefix_cache",
            "Prefix cache lookups of scored decisions.",
            ["result"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "arbiter_completion_tokens", "Tokens generated for chat completions.", registry=r
        )
        self.in_flight = Gauge("arbiter_in_flight", "Requests holding a compute slot.", registry=r)
        self.queued = Gauge("arbiter_queued", "Requests waiting for a compute slot.", registry=r)
        self.rejected = Counter(
            "arbiter_rejected",
            "Requests refused with 503 by backpressure, by reason.",
            ["reason"],
            registry=r,
        )
        self.cancelled = Counter(
            "arbiter_cancelled",
            "Requests whose client went away, by stage: queued (left the queue) or computing "
            "(its work stopped at the next decision or decode boundary).",
            ["stage"],
            registry=r,
        )
        self.prefix_cache_bytes = Gauge(
            "arbiter_prefix_cache_bytes",
            "Bytes of saved state prefixes held (at most ARBITER_PREFIX_CACHE_MB).",
            registry=r,
        )
        self.model_ready = Gauge("arbiter_model_ready", "1 once the model is loaded.", registry=r)
        self.model = Info("arbiter_model", "The served model.", registry=r)
        self.read_check_mass = Gauge(
            "arbiter_read_check_allowed_mass",
            "The median label mass of the read check's probe decisions at load.",
            registry=r,
        )

    def observe_decision(self, outcome: DecisionResult | Exception) -> None:
        if isinstance(outcome, DecisionResult):
            self.decisions.labels("ok").inc()
            self.decision_seconds.observe(outcome.timing.total_s)
            self.prefill_seconds.observe(outcome.timing.prefill_s)
            self.prompt_tokens.observe(outcome.prompt.input_tokens)
            self.prefix_tokens.inc(outcome.prompt.prefix_tokens)
            self.prefix_cache.labels(outcome.prefix_cache).inc()
        else:
            self.decisions.labels(getattr(outcome, "code", "internal_error")).inc()

    def set_model(self, info: ModelInfo) -> None:
        labels = {k: str(v) for k, v in info.model_dump(exclude={"adapters"}).items()}
        # LoRA adapters as one label: file:sha256:scale, comma-separated ("" for none).
        labels["lora"] = ",".join(f"{a.file}:{a.sha256}:{a.scale:g}" for a in info.adapters)
        self.model.info(labels)
        self.model_ready.set(1)
