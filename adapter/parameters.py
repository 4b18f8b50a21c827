"""The generation parameters of chat and text completions: the OpenAI and llama.cpp server fields
Arbiter honours, the ones it refuses by name, and the engine's arguments built from them.

Every top-level field a client sends is either declared by the request model (and honoured),
listed in ``NO_EFFECT`` (bookkeeping that cannot change the output), or refused with a 422
``unsupported_parameter`` that names it. Nothing is silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from arbiter.engine import Budget, Engine, SamplingParams
from arbiter.engine.grammar import json_object_grammar, schema_grammar
from arbiter.engine.sampling import MAX_TOP_LOGPROBS
from arbiter.errors import InvalidDecision, UnsupportedParameter
from arbiter.schema import Text

MAX_CHOICES = 16  # each choice is one KV sequence of the context (ARBITER_MAX_BRANCHES + 1 >= 2)
MAX_STOPS = 4  # OpenAI's limit

# Accepted and without effect on what is generated (the value is not used; nothing is stored).
NO_EFFECT: dict[str, Callable[[Any], bool]] = {
    "user": lambda v: True,
    "metadata": lambda v: True,
    "service_tier": lambda v: True,
    "safety_identifier": lambda v: True,
    "prompt_cache_key": lambda v: True,
    "prompt_cache_retention": lambda v: True,
    "prompt_cache_options": lambda v: True,
    "cache_prompt": lambda v: True,  # llama.cpp server: reuse of its KV cache, a speed hint
    "store": lambda v: v is None or v is False,  # true asks OpenAI to keep it: nothing is kept
    "modalities": lambda v: v is None or v == ["text"],
    "tool_choice": lambda v: v is None or v == "none",  # no tools, so no tool is ever chosen
    "parallel_tool_calls": lambda v: True,  # meaningless without tools (which are refused)
}
REASONS = {
    "tools": "tool calls are not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "tool_choice": "tool calls are not supported (only tool_choice: none)",
    "modalities": "only text is generated (modalities: [text])",
    "store": "completions are not stored (store: false)",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning effort is not supported (the chat template decides)",
    "verbosity": "verbosity is not supported (use max_tokens)",
    "moderation": "moderation is not supported",
    "suffix": "insertion (suffix) is not supported",
}


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``; ``strict`` or not, the output is constrained."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Text | None = None
    description: Text | None = None
    schema_: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object`` (any object, or llama.cpp's ``schema`` beside it), or
    ``json_schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: Any = Field(default=None, alias="schema")


class GenerationFields(BaseModel):
    """The sampling and output fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2, description="0: greedy.")
    top_p: float = Field(default=1.0, ge=0, le=1)
    top_k: int = Field(default=0, ge=0, lt=2**31, description="llama.cpp: 0 switches it off.")
    min_p: float = Field(default=0.0, ge=0, le=1, description="llama.cpp: 0 switches it off.")
    seed: int | None = Field(
        default=None,
        ge=-(2**63),
        lt=2**64,
        description="Same seed, same output (per build); -1 (llama.cpp's server): a random one.",
    )
    stop: Text | list[Text] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="Choices, sharing one prefill.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id (as a string) to a bias from -100 to 100."
    )
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repeat_penalty: float = Field(default=1.0, gt=0, le=10, description="llama.cpp: 1 is off.")
    repeat_last_n: int | None = Field(
        default=None, ge=-1, le=2**20, description="llama.cpp: tokens penalized; -1 all."
    )
    response_format: ResponseFormat | None = None
    json_schema: Any = Field(default=None, description="llama.cpp: a JSON schema to follow.")
    grammar: str | None = Field(default=None, description="llama.cpp: a GBNF grammar to follow.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.strip().isascii() and key.strip().isdigit()):
                raise ValueError(f"{key!r} is not a token id")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} is outside -100..100")
        return value

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


def refuse_unsupported(raw: Mapping[str, Any], model: type[BaseModel]) -> None:
    """``UnsupportedParameter`` for the first top-level field that is neither the model's nor
    without effect."""
    fields = set(model.model_fields) | {
        f.alias for f in model.model_fields.values() if f.alias is not None
    }
    for key, value in raw.items():
        if key in fields:
            continue
        accepts = NO_EFFECT.get(key)
        if accepts is not None and accepts(value):
            continue
        reason = REASONS.get(key, "not a parameter Arbiter honours")
        raise UnsupportedParameter(f"{key}: {reason}", param=key)


@dataclass(frozen=True)
class GenerationArgs:
    """``Engine.generate``'s keyword arguments (but ``on_delta``), built once per request."""

    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    n: int
    top_logprobs: int | None
    budget: Budget | None = None  # the request's limits and its cancellation (adapter.budgets)

    def kwargs(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "sampling": self.sampling,
            "stop": self.stop,
            "n": self.n,
            "top_logprobs": self.top_logprobs,
            "budget": self.budget,
        }


# Seeds llama.cpp's server reads as "draw a random seed": -1, and LLAMA_DEFAULT_SEED (0xFFFFFFFF).
RANDOM_SEEDS = frozenset({-1, 0xFFFFFFFF})


def generation_args(
    fields: GenerationFields,
    engine: Engine,
    default_max_tokens: int,
    extra_stops: list[str],
    budget: Budget | None = None,
) -> GenerationArgs:
    """The engine's arguments: the grammar written and compiled, token ids checked against the
    vocabulary. Blocking (a grammar compiles against the vocabulary): run it in a thread."""
    if fields.top_logprobs is not None and not fields.logprobs:
        raise InvalidDecision(
            "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_field"
        )
    grammar, param = _grammar(fields)
    if grammar is not None:
        engine.check_grammar(grammar, param)
    sampling = SamplingParams(
        temperature=fields.temperature,
        top_p=fields.top_p,
        top_k=fields.top_k,
        min_p=fields.min_p,
        seed=None if fields.seed in RANDOM_SEEDS else fields.seed,
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
        repeat_penalty=fields.repeat_penalty,
        penalty_last_n=-1 if fields.repeat_last_n is None else fields.repeat_last_n,
        logit_bias=_logit_bias(fields.logit_bias, engine.n_vocab),
        grammar=grammar,
    )
    return GenerationArgs(
        max_tokens=fields.token_limit(default_max_tokens),
        sampling=sampling,
        stop=tuple(fields.stops + extra_stops),
        n=fields.n,
        top_logprobs=(fields.top_logprobs or 0) if fields.logprobs else None,
        budget=budget,
    )


def _grammar(fields: GenerationFields) -> tuple[str | None, str]:
    """The GBNF of whichever of ``response_format``, ``json_schema`` and ``grammar`` is set (one
    at most), and the field it came from."""
    fmt = fields.response_format
    wanted = [
        name
        for name, on in (
            ("response_format", fmt is not None and fmt.type != "text"),
            ("json_schema", fields.json_schema is not None),
            ("grammar", fields.grammar is not None),
        )
        if on
    ]
    if len(wanted) > 1:
        raise InvalidDecision(
            f"{' and '.join(wanted)} both constrain the output: send one",
            param=wanted[1],
            code="invalid_field",
        )
    if fields.grammar is not None:
        return fields.grammar, "grammar"
    if fields.json_schema is not None:
        return schema_grammar(fields.json_schema, "json_schema"), "json_schema"
    if fmt is None or fmt.type == "text":
        return None, ""
    if fmt.type == "json_object":
        if fmt.schema_ is None:
            return json_object_grammar(), "response_format"
        return schema_grammar(fmt.schema_, "response_format.schema"), "response_format.schema"
    if fmt.json_schema is None:
        raise InvalidDecision(
            "response_format.json_schema: required when type is json_schema",
            param="response_format.json_schema",
            code="invalid_field",
        )
    param = "response_format.json_schema.schema"
    schema = {} if fmt.json_schema.schema_ is None else fmt.json_schema.schema_
    return schema_grammar(schema, param), param


def _logit_bias(biases: dict[str, float] | None, n_vocab: int) -> tuple[tuple[int, float], ...]:
    pairs = tuple((int(key), float(bias)) for key, bias in (biases or {}).items())
    for token, _ in pairs:
        if not 0 <= token < n_vocab:
            raise InvalidDecision(
                f"logit_bias: token {token} is outside this model's vocabulary (0-{n_vocab - 1})",
                param=f"logit_bias.{token}",
                code="invalid_field",
            )
    return pairs
