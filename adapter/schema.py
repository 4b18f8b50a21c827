"""Wire models shared by the adapter and the worker: a decision request and its result."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

JsonState = str | dict[str, Any] | list[Any]


class Option(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, max_length=256)
    description: str = Field(min_length=1)

    @field_validator("description")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("description must not be blank")
        return value


class DecisionRequest(BaseModel):
    """One decision: a state, a question about it, and 2 or more options to choose from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, max_length=512)
    state: JsonState
    question: str = Field(min_length=1)
    options: list[Option] = Field(min_length=2)
    temperature: float | None = Field(default=None, gt=0, le=100)
    question_type: Literal["noul", "choice", "score"] | None = Field(
        default=None, description="System One question type; picks the calibrated temperature."
    )
    order_samples: int | None = Field(
        default=None,
        ge=1,
        le=8,
        description=(
            "Score this many option orders (the given one, the reversed one, then seeded "
            "shuffles) and average the logits by option id: the answer no longer depends on order."
        ),
    )

    @field_validator("state")
    @classmethod
    def _state_is_json(cls, value: JsonState) -> JsonState:
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("state must not be empty")
            return value
        if not value:
            raise ValueError("state must not be an empty object or array")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state is not JSON-serializable: {exc}") from exc
        return value

    @field_validator("question")
    @classmethod
    def _question_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("question must not be blank")
        return value

    @field_validator("options")
    @classmethod
    def _unique_option_ids(cls, options: list[Option]) -> list[Option]:
        seen: set[str] = set()
        for option in options:
            if option.id in seen:
                raise ValueError(f"duplicate option id {option.id!r}: option ids must be unique")
            seen.add(option.id)
        return options


class PromptInfo(BaseModel):
    sha256: str
    version: str
    input_tokens: int
    prefix_tokens: int


class Timing(BaseModel):
    tokenize_s: float
    prefill_s: float
    readout_s: float
    total_s: float


class ModelInfo(BaseModel):
    """Pinned metadata of the served GGUF and the runtime that ran it."""

    model_config = ConfigDict(frozen=True)

    file: str
    bytes: int
    sha256: str
    architecture: str
    quantization: str
    description: str
    context_tokens: int
    threads: int
    n_gpu_layers: int
    chat_template: bool
    llama_cpp_python_version: str
    llama_cpp_build: str


class DecisionResult(BaseModel):
    id: str
    option_ids: list[str]
    probabilities: list[float]
    option_logits: list[float]
    choice: str
    allowed_mass: float
    temperature: float
    probability_status: Literal["raw", "calibrated"]
    prefix_cache: Literal["hit", "miss", "off"]
    prompt: PromptInfo
    timing: Timing
    model: ModelInfo

    @field_validator("probabilities", "option_logits")
    @classmethod
    def _finite(cls, value: list[float]) -> list[float]:
        if not all(math.isfinite(v) for v in value):
            raise ValueError("non-finite value")
        return value
