"""The one fake engine, and the decisions the tests are made of.

``FakeEngine`` has the interface the HTTP adapter and the worker use (``score``, ``generate``,
``encode_segments``, ``close``, the model's metadata) with controllable timing and failures, for the
tests of their shapes; the real bundled model covers the engine and the end-to-end paths.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from arbiter.engine import Budget, Choice, Generation
from arbiter.engine.cost import CostFloor
from arbiter.engine.sampling import OnDelta
from arbiter.errors import TooManyOptions
from arbiter.models import ResolvedModel
from arbiter.schema import DecisionRequest, DecisionResult, ModelInfo, PromptInfo, Timing
from arbiter.scorer import Outcome

MODEL_INFO = ModelInfo(
    file="fake.gguf",
    bytes=1,
    sha256="0" * 64,
    architecture="fake",
    quantization="F32",
    description="fake",
    context_tokens=512,
    threads=1,
    n_gpu_layers=0,
    chat_template=False,
    llama_cpp_python_version="0",
    llama_cpp_build="none",
    prompt_profile="arbiter-letters-v1",
    prompt_profile_sha256="0" * 64,
)

# -- decisions -------------------------------------------------------------------------------------

STATE = "The customer cannot log in after a password reset."
QUESTION = "Which queue should handle this ticket?"
OPTIONS = [("access", "Account access"), ("billing", "Billing and invoices")]


def decision_body(
    id: str = "d1",
    state: Any = STATE,
    question: str = QUESTION,
    options: int | Sequence[tuple[str, str]] = OPTIONS,
) -> dict[str, Any]:
    """A decision as JSON sends it. ``options`` as a number: that many (``o0``, ``o1``, ...)."""
    pairs = (
        [(f"o{i}", f"option {i}") for i in range(options)] if isinstance(options, int) else options
    )
    return {
        "id": id,
        "state": state,
        "question": question,
        "options": [{"id": i, "description": d} for i, d in pairs],
    }


def decision(
    id: str = "d1",
    state: Any = STATE,
    question: str = QUESTION,
    options: int | Sequence[tuple[str, str]] | None = None,
    order_samples: int | None = None,
) -> DecisionRequest:
    """The same decision, validated. ``order_samples=1``: read once, in the given order (what a
    test of the readout compares with a plain prefill), not adaptively from the canonical one."""
    body = decision_body(id, state, question, options or OPTIONS)
    if order_samples is not None:
        body["order_samples"] = order_samples
    return DecisionRequest.model_validate(body)


def decision_line(i: int, state: Any = STATE, question: str = QUESTION) -> str:
    """Decision ``d<i>`` as one JSON Lines record (a job file's line)."""
    return json.dumps(decision_body(f"d{i}", state, question))


# -- the engine ------------------------------------------------------------------------------------


def uniform_result(
    d: DecisionRequest, *, prefix_tokens: int = 4, prefill_s: float = 0.001, version: str = "fake"
) -> DecisionResult:
    """A well-formed result with equal probabilities and 10 input tokens (first option chosen)."""
    n = len(d.options)
    return DecisionResult(
        id=d.id,
        option_ids=[o.id for o in d.options],
        probabilities=[1 / n] * n,
        option_logits=[0.0] * n,
        choice=d.options[0].id,
        allowed_mass=1.0,
        temperature=1.0,
        probability_status="raw",
        prefix_cache="off",
        prompt=PromptInfo(
            sha256="0" * 64,
            version=version,
            input_tokens=10,
            prefix_tokens=prefix_tokens,
            profile="arbiter-letters-v1",
            profile_sha256="0" * 64,
        ),
        timing=Timing(tokenize_s=0, prefill_s=prefill_s, readout_s=0, total_s=prefill_s),
        model=MODEL_INFO,
    )


class FakeEngine:
    """Scores after ``delay_s`` per call; a decision with more than ``max_options`` options gets
    ``TooManyOptions``; ``fail`` makes every call raise (a broken engine). Generates "Hello there!"
    one piece per ``delay_s``."""

    chat_template: str | None = None
    bos_text = "<bos>"
    eos_text = "<eos>"
    n_ctx = 512
    n_vocab = 1000
    cost = CostFloor(n_ctx=512, max_piece=16)
    seconds_per_token: float | None = None
    model_info = MODEL_INFO
    resolved = ResolvedModel(path=Path(__file__), source="env", expected_sha256=None)

    def __init__(self, delay_s: float = 0.0, fail: bool = False, max_options: int = 3) -> None:
        self.delay_s = delay_s
        self.fail = fail
        self.max_options = max_options
        self.started = threading.Event()
        self.calls = 0
        self.scored = 0
        self.closed = False

    def score(
        self, decisions: Sequence[DecisionRequest], budget: Budget | None = None
    ) -> list[Outcome]:
        self.calls += 1
        self.started.set()
        if self.fail:
            raise RuntimeError("fake engine failure")
        _sleep(self.delay_s, budget)
        self.scored += len(decisions)
        return [
            TooManyOptions("too many", param="options")
            if len(d.options) > self.max_options
            else uniform_result(d)
            for d in decisions
        ]

    def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> np.ndarray:
        return np.arange(sum(len(t.split()) for t, _ in segments) + 1, dtype=np.int32)

    def generate(
        self,
        tokens: np.ndarray,
        *,
        max_tokens: int,
        n: int = 1,
        on_delta: OnDelta | None = None,
        budget: Budget | None = None,
        **_: Any,
    ) -> Generation:
        self.started.set()
        pieces = ["Hello", " there", "!"][:max_tokens]
        for piece in pieces:
            _sleep(self.delay_s, budget)
            for index in range(n):
                if on_delta is not None and on_delta(index, piece, None) is False:
                    cancelled = tuple(Choice(i, "", "cancelled", 0) for i in range(n))
                    return Generation(len(tokens), cancelled, 0.0, 0.0)
        finish = "length" if max_tokens < 3 else "stop"
        choices = tuple(Choice(i, "".join(pieces), finish, len(pieces)) for i in range(n))
        return Generation(len(tokens), choices, 0.001, 0.002)

    def check_grammar(self, text: str, param: str = "grammar") -> None:
        """Every grammar compiles here (the real engine's check is tested on the real model)."""

    def close(self) -> None:
        self.closed = True


def _sleep(seconds: float, budget: Budget | None) -> None:
    """The fake's compute: ``seconds``, stopped like the engine's at 10 ms "decode" boundaries."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if budget is not None:
            budget.interrupt()
        time.sleep(min(left, 0.01))


def make_fake_engine(settings: Any = None) -> FakeEngine:
    """Engine factory for worker subprocesses (ARBITER_WORKER_ENGINE_FACTORY): delay from
    ARBITER_FAKE_DELAY_S, failure from ARBITER_FAKE_FAIL; ARBITER_FAKE_CRASH=1 fails to load (the
    worker process dies at start, as with a missing model)."""
    if os.environ.get("ARBITER_FAKE_CRASH") == "1":
        raise RuntimeError("fake engine cannot load")
    return FakeEngine(
        delay_s=float(os.environ.get("ARBITER_FAKE_DELAY_S", "0")),
        fail=os.environ.get("ARBITER_FAKE_FAIL") == "1",
    )
