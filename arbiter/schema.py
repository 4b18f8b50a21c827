"""Wire models shared by the adapter and the worker: a decision request and its result."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

# The smallest softmax temperature: logits / T stays finite (probabilities are never NaN).
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 100.0
# Deeper JSON than this in a state is refused: it would only reach Python's recursion limit.
MAX_STATE_DEPTH = 64
# Option orders one decision may ask to average (``order_samples``; ``arbiter.engine.ordering``).
MAX_ORDER_SAMPLES = 8
# Options in one decision (System One's limit for a choice question). Checked by the engine, so a
# decision with more is refused on its own (``too_many_options``) and the others in its batch score.
MAX_OPTIONS = 255


def unicode_text(value: str) -> str:
    """Refuse text UTF-8 cannot hold: JSON may escape a lone surrogate (``"\\ud800"``); the
    tokenizer cannot encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text must be valid Unicode: a lone surrogate (U+{ord(value[exc.start]):04X}) at "
            f"character {exc.start}"
        ) from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]
JsonState = str | dict[str, Any] | list[Any]


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, walked without recursion; stops counting past ``limit``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


class Option(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: Text = Field(min_length=1, max_length=256)
    description: Text = Field(min_length=1)

    @field_validator("description")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("description must not be blank")
        return value


class DecisionRequest(BaseModel):
    """One decision: a state, a question about it, and 2 or more options to choose from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: Text = Field(min_length=1, max_length=512)
    state: JsonState
    question: Text = Field(min_length=1)
    options: list[Option] = Field(min_length=2)
    temperature: float | None = Field(
        default=None,
        ge=MIN_TEMPERATURE,
        le=MAX_TEMPERATURE,
        description="Softmax temperature for the probabilities (the logits are unchanged).",
    )
    question_type: Literal["noul", "choice", "score", "multi_label"] | None = Field(
        default=None,
        description=(
            "System One question type (picks the calibrated temperature), or multi_label: "
            "several options may hold, each is read as a yes/no question over the one state."
        ),
    )
    order_samples: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ORDER_SAMPLES,
        description=(
            "Unset: the server's read policy (adaptive rotation: more option orders only while "
            "the leader is unclear). 1: the given order only. K: this many orders (the given "
            "one, the reversed one, then seeded shuffles), averaged by option id."
        ),
    )
    max_error: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description=(
            "Error budget: abstain unless the top probability clears the threshold that keeps "
            "the error of automated decisions under this (fitted on labeled decisions with a "
            "finite-sample bound; needs a calibration)."
        ),
    )
    min_confidence: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Abstain when the top probability is under this.",
    )

    @field_validator("state")
    @classmethod
    def _state_is_json(cls, value: JsonState) -> JsonState:
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("state must not be empty")
            return unicode_text(value)
        if not value:
            raise ValueError("state must not be an empty object or array")
        if json_depth(value, MAX_STATE_DEPTH) > MAX_STATE_DEPTH:
            raise ValueError(f"state is nested more than {MAX_STATE_DEPTH} levels deep")
        try:
            json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                "state is not valid Unicode: it holds a lone surrogate (such as \\ud800)"
            ) from exc
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
    # The engine always sets both; the defaults keep results written before profiles readable.
    profile: str = Field(
        default="arbiter-letters-v1", description="The prompt profile (ARBITER_PROMPT_PROFILE)."
    )
    profile_sha256: str | None = Field(default=None, description="sha256 of the profile file.")


class Timing(BaseModel):
    tokenize_s: float
    prefill_s: float
    readout_s: float
    total_s: float


class AdapterInfo(BaseModel):
    """A LoRA adapter applied on the served model."""

    model_config = ConfigDict(frozen=True)

    file: str
    bytes: int
    sha256: str
    scale: float


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
    prompt_profile: str = "arbiter-letters-v1"
    prompt_profile_sha256: str | None = None  # the engine always sets it
    adapters: list[AdapterInfo] = Field(default_factory=list, description="LoRA adapters applied.")


class AbstentionInfo(BaseModel):
    """Why a decision abstained or not: the rule, the threshold it met or missed."""

    rule: Literal["max_error", "min_confidence", "max_error+min_confidence"]
    max_error: float | None = None
    min_confidence: float | None = None
    threshold: float | None = Field(
        description="The least top probability automated; null: no threshold meets the budget."
    )
    confidence: float = Field(description="The top probability (calibrated) it was held to.")


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
    orders_read: int = Field(
        default=1, description="Option orders read (adaptive rotation or order_samples)."
    )
    abstained: bool = Field(
        default=False, description="The decision is under its error budget or minimum confidence."
    )
    abstention: AbstentionInfo | None = None
    choices: list[str] | None = Field(
        default=None, description="multi_label: the options that hold (probability 0.5 or more)."
    )

    @field_validator("probabilities", "option_logits")
    @classmethod
    def _finite(cls, value: list[float]) -> list[float]:
        if not all(math.isfinite(v) for v in value):
            raise ValueError("non-finite value")
        return value
