"""The one place where Arbiter's configuration is named and read from the environment."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_threads() -> int:
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
    n_threads: int = Field(default_factory=_default_threads, ge=1, description="CPU threads.")
    n_gpu_layers: int = Field(default=0, ge=-1, description="Layers offloaded to a GPU (-1: all).")
    n_batch: int = Field(default=512, ge=32, description="Tokens per llama_decode call.")
    max_branches: int = Field(
        default=16, ge=1, le=255, description="Questions decoded as parallel branches of one state."
    )
    parallel_branches: bool = Field(
        default=False,
        description=(
            "Decode the questions of one state together in one llama_decode (faster on a GPU). "
            "Off by default: llama.cpp's CPU kernels give slightly different logits (up to ~0.3) "
            "for different batch shapes, and sequential branches keep every decision's result "
            "independent of what else is in the request."
        ),
    )
    prefix_cache_mb: float = Field(
        default=256.0, ge=0, description="Memory for saved state prefixes reused across requests."
    )
    temperature: float = Field(default=1.0, gt=0, description="Default softmax temperature.")
    calibration: Path | None = Field(
        default=None,
        description=(
            "A calibration file from `arbiter calibrate`: temperatures per question type, used "
            "when a request sets none (results then say probability_status: calibrated)."
        ),
    )
