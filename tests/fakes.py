"""A fake engine for HTTP-shape tests: same interface as ``Engine``, controllable timing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from arbiter.engine import Generation
from arbiter.errors import ArbiterError, TooManyOptions
from arbiter.models import ResolvedModel
from arbiter.schema import DecisionRequest, DecisionResult, ModelInfo, PromptInfo, Timing

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
)


def uniform_result(
    d: DecisionRequest, *, prefix_tokens: int = 0, prefill_s: float = 0.0, version: str = "v"
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
            sha256="0" * 64, version=version, input_tokens=10, prefix_tokens=prefix_tokens
        ),
        timing=Timing(tokenize_s=0, prefill_s=prefill_s, readout_s=0, total_s=prefill_s),
        model=MODEL_INFO,
    )


class FakeEngine:
    chat_template = None
    bos_text = "<bos>"
    eos_text = "<eos>"
    n_ctx = 512
    model_info = MODEL_INFO
    resolved = ResolvedModel(path=Path(__file__), source="env", expected_sha256=None)

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.started = threading.Event()
        self.calls = 0
        self.closed = False

    def score(self, decisions: Sequence[DecisionRequest]) -> list[DecisionResult | ArbiterError]:
        self.calls += 1
        self.started.set()
        time.sleep(self.delay_s)
        out: list[DecisionResult | ArbiterError] = []
        for d in decisions:
            if len(d.options) > 3:
                out.append(TooManyOptions("too many", param="options"))
                continue
            out.append(uniform_result(d, prefix_tokens=4, prefill_s=0.001))
        return out

    def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> np.ndarray:
        return np.arange(sum(len(t.split()) for t, _ in segments) + 1, dtype=np.int32)

    def generate(
        self,
        tokens: np.ndarray,
        *,
        max_tokens: int,
        on_text: Callable[[str], bool] | None = None,
        **_: Any,
    ) -> Generation:
        self.started.set()
        pieces = ["Hello", " there", "!"][:max_tokens]
        for piece in pieces:
            time.sleep(self.delay_s)
            if on_text is not None and on_text(piece) is False:
                return Generation("", len(tokens), 0, "cancelled", 0.0, 0.0)
        finish = "length" if max_tokens < 3 else "stop"
        return Generation("".join(pieces), len(tokens), len(pieces), finish, 0.001, 0.002)

    def close(self) -> None:
        self.closed = True


def decision(id: str = "d1", n_options: int = 2, state: Any = "The printer is on fire.") -> dict:
    return {
        "id": id,
        "state": state,
        "question": "What now?",
        "options": [{"id": f"o{i}", "description": f"option {i}"} for i in range(n_options)],
    }
