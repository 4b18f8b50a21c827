"""Where the engine's and the server's configuration is named and read from the environment.

Every variable of the engine (``EngineSettings``), the HTTP server (``ServerSettings``) and the
container entrypoint (``EntrypointSettings``) is a field here, SageMaker's own names and the stock
llama.cpp image's ``SM_LLAMA_CPP_*`` flags included; the worker pool's are in ``worker/settings.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import date
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from arbiter.errors import UnsupportedSetting

MB = 1024 * 1024  # settings in MB are read as MiB
# The read check's default threshold, set by measurement on the models here (docs/models.md).
READ_CHECK_MIN_MASS = 0.3
READ_CHECK_MIN_RATIO = 0.75


def cpu_count() -> int:
    """CPUs this process may run on (its affinity, not the machine's count): the default thread
    count of the engine, shared out among the worker pool's processes."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


class EngineSettings(BaseSettings):
    """How the decision engine finds and runs its model (env prefix ``ARBITER_``)."""

    model_config = SettingsConfigDict(env_prefix="ARBITER_", extra="ignore", populate_by_name=True)

    model: Path | None = Field(
        default=None, description="Path to a .gguf file; wins over the model dir and the default."
    )
    model_dir: Path = Field(
        default=Path("/opt/ml/model"),
        validation_alias=AliasChoices("ARBITER_MODEL_DIR", "SM_MODEL_DIR"),
        description="Where SageMaker unpacks ModelDataUrl; searched two levels deep for *.gguf.",
    )
    n_ctx: int = Field(
        default=8192, ge=256, description="Context size in tokens (shared by all branches)."
    )
    n_threads: int = Field(default_factory=cpu_count, ge=1, description="CPU threads.")
    n_gpu_layers: int = Field(default=0, ge=-1, description="Layers offloaded to a GPU (-1: all).")
    n_batch: int = Field(default=512, ge=32, description="Tokens per llama_decode call.")
    max_branches: int = Field(
        default=16, ge=1, le=255, description="Questions decoded as parallel branches of one state."
    )
    parallel_branches: bool = Field(
        default=False,
        description=(
            "Decode the questions of one state together in one llama_decode (faster on a GPU), "
            "and a question alone with its state not cached in one llama_decode with its state "
            "(~6% faster on a CPU). Off by default: llama.cpp's CPU kernels give slightly "
            "different logits (up to ~0.3) for different batch shapes, and the prefix, then each "
            "suffix on its own keep every decision's result independent of what else is in the "
            "request and of the cache."
        ),
    )
    prefix_cache_mb: float = Field(
        default=256.0, ge=0, description="Memory for saved state prefixes reused across requests."
    )
    temperature: float = Field(
        default=1.0, ge=0.01, le=100, description="Default softmax temperature (0.01 to 100)."
    )
    calibration: Path | None = Field(
        default=None,
        description=(
            "A calibration file from `arbiter calibrate` (temperatures, the position prior, "
            "abstention scores), used when a request sets no temperature (results then say "
            "probability_status: calibrated). Unset: the one a catalog model ships, if any."
        ),
    )
    shipped_calibration: bool = Field(
        default=True,
        description=(
            "Use the calibration a catalog model ships for its GGUF and prompt profile when "
            "ARBITER_CALIBRATION is unset (false: raw probabilities, no position prior)."
        ),
    )
    order_policy: Literal["adaptive", "single"] = Field(
        default="adaptive",
        description=(
            "How a decision that sets no order_samples is read: adaptive (more option orders on "
            "the same prefill while the leader is unclear: order-robust at a small cost) or "
            "single (the given order only)."
        ),
    )
    order_margin: float | None = Field(
        default=None,
        ge=0,
        description=(
            "Adaptive rotation reads another order while the two leading options are closer "
            "than this (in logits). Unset: the calibration's, else 2.0."
        ),
    )
    max_error: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description=(
            "Default error budget of a decision that names none: it abstains unless its top "
            "probability clears the calibration's threshold for this budget (needs a calibration "
            "with abstention scores)."
        ),
    )
    min_confidence: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Default minimum top probability of a decision that names none.",
    )

    lora: str | None = Field(
        default=None,
        description=(
            "LoRA adapters applied on the model, path[:scale] separated by commas (llama-server's "
            "--lora-scaled form; scale 1 when omitted; a relative path is in the model dir). Unset: "
            "the adapters the model's manifest packs."
        ),
    )
    prompt_profile: str | None = Field(
        default=None,
        description=(
            "The prompt profile: a built-in name (arbiter-letters-v1, the default) or the path "
            "of a profile file (TOML: instruction, layout, labels, answer cue; docs/models.md). "
            "Unset: the one the model's manifest packs, else the default."
        ),
    )
    read_check: Literal["refuse", "warn", "off"] = Field(
        default="refuse",
        description=(
            "The read check at load: a few built-in decisions are scored and their label mass "
            "(allowed_mass) reported; under ARBITER_READ_CHECK_MIN_MASS, or under "
            "ARBITER_READ_CHECK_MIN_RATIO of the plain built-in prompt's, the engine refuses to "
            "start (refuse), serves with a warning (warn), or the check is skipped (off)."
        ),
    )
    read_check_min_mass: float = Field(
        default=READ_CHECK_MIN_MASS,
        ge=0,
        le=1,
        description="The least median label mass the read check accepts (measured: docs/models.md).",
    )
    read_check_min_ratio: float = Field(
        default=READ_CHECK_MIN_RATIO,
        ge=0,
        le=1,
        description=(
            "The least fraction of the plain built-in prompt's label mass on the same weights "
            "that the served prompt's must reach (measured: docs/models.md)."
        ),
    )
    prompt_date: date | None = Field(
        default=None,
        description=(
            "The date a chat template's decision prompt reads (Llama 3.x, Mistral Small, gpt-oss "
            "print today's date), YYYY-MM-DD; unset: the day the model is loaded."
        ),
    )


class ServerSettings(BaseSettings):
    """How `arbiter serve` listens and how much work it admits (env prefix ``ARBITER_``)."""

    model_config = SettingsConfigDict(env_prefix="ARBITER_", extra="ignore", populate_by_name=True)

    host: str = Field(
        default="127.0.0.1",
        description=(
            "Interface to listen on: loopback unless told otherwise. The container entrypoint "
            "and SAGEMAKER_BIND_TO_PORT set 0.0.0.0 (SageMaker reaches the container from "
            "outside it)."
        ),
    )
    port: int = Field(
        default=8080,
        ge=1,
        le=65535,
        validation_alias=AliasChoices("ARBITER_PORT", "SAGEMAKER_BIND_TO_PORT"),
        description="Listening port; SageMaker sets SAGEMAKER_BIND_TO_PORT in inference pipelines.",
    )
    max_in_flight: int = Field(
        default=1, ge=1, description="Requests computing at once (the model itself is serialized)."
    )
    max_queue: int = Field(
        default=8, ge=0, description="Requests waiting for a slot; beyond this the answer is 503."
    )
    queue_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest wait for a slot before a 503."
    )
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After on a 503, in seconds.")
    max_body_mb: float = Field(
        default=6.0, gt=0, description="Largest JSON body (SageMaker real-time sends up to 6 MB)."
    )
    max_jsonl_mb: float = Field(
        default=1024.0,
        gt=0,
        description="Largest application/jsonlines body; it is streamed, never held in memory.",
    )
    max_decisions: int = Field(
        default=256, ge=1, description='Decisions in one {"decisions": [...]} request.'
    )
    max_request_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Prompt tokens one request may make the engine decode (each state's shared prefix "
            "once, every decision's question and options); over it: 413 before the engine runs. "
            "Unset: 16 contexts shared by the requests in flight (16 x ARBITER_N_CTX / "
            "ARBITER_MAX_IN_FLIGHT, at least one context). JSON Lines are bounded per line."
        ),
    )
    max_request_seconds: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Longest a request may compute (unset: no limit): 422 before the engine runs when its "
            "tokens would take longer at the measured speed, and the decisions not scored when "
            "it runs out say so."
        ),
    )
    jsonl_chunk: int = Field(
        default=16, ge=1, description="JSON Lines records scored per engine call."
    )
    chat_max_tokens: int = Field(
        default=256, ge=1, description="Chat completion tokens when the request sets no max_tokens."
    )
    chat_prefill_assistant: bool = Field(
        default=True,
        description=(
            "A chat whose last message is the assistant's continues that message (llama.cpp's "
            "server default; its --no-prefill-assistant is false here): the reply starts inside "
            "it, not in a new turn."
        ),
    )
    body_read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest pause while a client sends its body; then 408 (the client stalled).",
    )
    batch_max_payload_mb: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description=(
            "MaxPayloadInMB offered to Batch Transform; unset: sized from this machine's measured "
            "speed so one mini-batch takes at most half of ARBITER_BATCH_INVOCATION_TIMEOUT_S."
        ),
    )
    batch_invocation_timeout_s: float = Field(
        default=600.0,
        ge=1,
        le=3600,
        description=(
            "The transform job's ModelClientConfig.InvocationsTimeoutInSeconds (SageMaker's "
            "default 600), used to size MaxPayloadInMB."
        ),
    )
    sagemaker_batch: bool = Field(
        default=False,
        validation_alias=AliasChoices("ARBITER_SAGEMAKER_BATCH", "SAGEMAKER_BATCH"),
        description="Set by Batch Transform: measure the payload size at start-up, before /ping.",
    )
    log_json: bool | None = Field(
        default=None, description="JSON log lines (default: JSON unless stderr is a terminal)."
    )
    log_level: str = Field(default="info", description="debug, info, warning or error.")
    api_key: str | None = Field(
        default=None,
        description=(
            "When set, every compute route (/invocations and /v1/*) needs "
            "'Authorization: Bearer <key>' (401 otherwise); /ping, /metrics and the API "
            "document stay open."
        ),
    )
    api_key_exempt_invocations: bool = Field(
        default=False,
        description=(
            "Leave /invocations open while ARBITER_API_KEY guards /v1/*: only where something "
            "else guards it (SageMaker's IAM, which also strips the Authorization header)."
        ),
    )


REQUEST_CONTEXTS = 16  # the default token budget: contexts' worth shared by the requests in flight


def request_token_limit(settings: ServerSettings, n_ctx: int) -> int:
    """``ARBITER_MAX_REQUEST_TOKENS``, or its default for a context of ``n_ctx`` tokens."""
    if settings.max_request_tokens is not None:
        return settings.max_request_tokens
    return max(n_ctx, REQUEST_CONTEXTS * n_ctx // settings.max_in_flight)


class EntrypointSettings(BaseSettings):
    """What only the container entrypoint reads (env prefix ``ARBITER_``)."""

    model_config = SettingsConfigDict(env_prefix="ARBITER_", extra="ignore")

    image_n_gpu_layers: int | None = Field(
        default=None,
        ge=-1,
        description="Set by the image: GPU layers when the deployment sets none (CUDA: -1, CPU: 0).",
    )
    model_data_url: str | None = Field(
        default=None,
        description="s3://bucket/key of a model.tar.gz unpacked into the model dir when it has no "
        "GGUF (the ECS worker; SageMaker unpacks ModelDataUrl itself).",
    )
    aws_endpoint_url: str | None = Field(
        default=None,
        description="S3 endpoint for model_data_url (a moto server, LocalStack); unset: AWS's.",
    )
    preflight_sha256: bool = Field(
        default=True,
        description="Hash the model before exec (the engine hashes it again at load: ~1 s per GB).",
    )
    entrypoint_exec: str | None = Field(
        default=None,
        description="Program exec'd with the command (shell-split); default: this Python running "
        "`-m arbiter`. Tests point it at a stub.",
    )


# The stock llama.cpp SageMaker image turns SM_LLAMA_CPP_<X>=v into the llama-server flag
# --<x lowercased, _ -> -> v ("true": a bare flag). These are the flags that mean something here.
SM_PREFIX = "SM_LLAMA_CPP_"
SM_GPU_FLAGS = ("N_GPU_LAYERS", "GPU_LAYERS", "NGL")
_SM_ENGINE_FLAGS = {
    "MODEL": "model",
    "M": "model",
    "CTX_SIZE": "n_ctx",
    "C": "n_ctx",
    "THREADS": "n_threads",
    "T": "n_threads",
    **dict.fromkeys(SM_GPU_FLAGS, "n_gpu_layers"),
    "BATCH_SIZE": "n_batch",
    "B": "n_batch",
    # llama-server's --lora FNAME[,FNAME] and --lora-scaled FNAME:SCALE[,...]: both are adapters.
    "LORA": "lora",
    "LORA_SCALED": "lora",
}
_SM_SERVER_FLAGS = {"PARALLEL": "max_in_flight", "NP": "max_in_flight"}
_SM_HUB_FLAGS = {"HF_REPO", "HF_FILE", "HF_TOKEN", "HFR", "HFF", "MODEL_URL", "MU"}


def _sm_value(flag: str, value: str) -> str | None:
    if flag in SM_GPU_FLAGS:
        if value.lower() == "all":
            return "-1"
        if value.lower() == "auto":
            return None  # llama.cpp's own fitting; Arbiter's default (0 or ARBITER_N_GPU_LAYERS)
    return value


def from_environment() -> tuple[EngineSettings, ServerSettings, list[str]]:
    """Both settings objects, with ``SM_LLAMA_CPP_*`` mapped in below ``ARBITER_*``.

    Returns the unknown ``SM_LLAMA_CPP_*`` names too, for a single warning at start-up. A model hub
    flag is refused: nothing is ever downloaded.
    """
    engine_kw, server_kw, unknown = _sagemaker_flags(os.environ)
    if "SAGEMAKER_BIND_TO_PORT" in os.environ and "ARBITER_HOST" not in os.environ:
        server_kw["host"] = "0.0.0.0"  # an inference pipeline's container, reached from outside
    server = ServerSettings(**server_kw)  # type: ignore[arg-type]  # strings, validated
    return _engine_settings(engine_kw), server, unknown


def engine_from_environment() -> EngineSettings:
    """The engine's settings as ``arbiter serve`` reads them (``SM_LLAMA_CPP_*`` below
    ``ARBITER_*``), for the commands that load an engine without a server: ``decide``, ``prompt``,
    ``eval``, ``calibrate`` and the worker pool."""
    return _engine_settings(_sagemaker_flags(os.environ)[0])


def _sagemaker_flags(
    env: Mapping[str, str],
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """The engine's and the server's settings that ``SM_LLAMA_CPP_*`` give (where no
    ``ARBITER_*`` does), and the flags that mean nothing here."""
    engine_kw: dict[str, str] = {}
    server_kw: dict[str, str] = {}
    unknown: list[str] = []
    for name, value in sorted(env.items()):
        if not name.startswith(SM_PREFIX):
            continue
        flag = name[len(SM_PREFIX) :].upper()
        if flag in _SM_HUB_FLAGS:
            raise UnsupportedSetting(
                f"{name} asks for a model hub download (--{flag.lower().replace('_', '-')}); "
                "Arbiter never downloads models. Ship the .gguf instead: put it in the model "
                "archive (ModelDataUrl, unpacked to /opt/ml/model), or bake it into the image and "
                "set ARBITER_MODEL (or SM_LLAMA_CPP_MODEL) to its path",
                param=name,
            )
        if flag in _SM_ENGINE_FLAGS:
            target, field = engine_kw, _SM_ENGINE_FLAGS[flag]
        elif flag in _SM_SERVER_FLAGS:
            target, field = server_kw, _SM_SERVER_FLAGS[flag]
        else:
            unknown.append(name)
            continue
        mapped = _sm_value(flag, value)
        if mapped is not None and f"ARBITER_{field.upper()}" not in env:
            if field == "lora" and field in target:  # --lora and --lora-scaled together
                mapped = f"{target[field]},{mapped}"
            target[field] = mapped
    return engine_kw, server_kw, unknown


def _engine_settings(engine_kw: dict[str, str]) -> EngineSettings:
    engine = EngineSettings(**engine_kw)  # type: ignore[arg-type]  # strings, validated
    if "model" in engine_kw and engine.model is not None and not engine.model.is_absolute():
        engine = engine.model_copy(update={"model": engine.model_dir / engine.model})
    return engine
