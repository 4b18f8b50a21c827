"""Text generation for chat completions: greedy or sampled with numpy, stop strings, streaming.

Logits are computed at the last position only: the prompt is prefilled once, then each new token
is decoded alone. Text is handed to ``on_text`` as it becomes final, never part of a stop string.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from arbiter.engine.llama import Llama


@dataclass(frozen=True)
class Generation:
    """The outcome of ``Engine.generate``."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (end of generation or a stop string), "length", "cancelled"
    prefill_s: float
    decode_s: float


def generate(
    llama: Llama,
    tokens: np.ndarray,
    budget: int,
    temperature: float,
    top_p: float,
    stop: list[str],
    rng: np.random.Generator,
    on_text: Callable[[str], bool] | None,
) -> Generation:
    """Up to ``budget`` tokens after ``tokens`` (sequence 0 of an empty KV cache, held by the
    caller). ``on_text`` returning False stops the generation (finish reason ``cancelled``)."""
    started = time.perf_counter()
    logits = llama.last_logits(tokens, 0)
    prefill_s = time.perf_counter() - started

    def outcome(text: str, produced: int, finish: str) -> Generation:
        total = time.perf_counter() - started
        return Generation(text, len(tokens), produced, finish, prefill_s, total - prefill_s)

    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text, sent, produced, finish = "", 0, 0, "length"
    while produced < budget:
        token = sample(logits, temperature, top_p, rng)
        if llama.is_end_of_generation(token):
            finish = "stop"
            break
        produced += 1
        text += decoder.decode(llama.piece_bytes(token))
        cut = _stop_index(text, stop, sent)
        if cut is not None:
            text, finish = text[:cut], "stop"
            break
        final = len(text) - _held_back(text, stop)
        if final > sent and on_text is not None:
            if on_text(text[sent:final]) is False:
                return outcome(text[:final], produced, "cancelled")
            sent = final
        if produced < budget:
            logits = llama.last_logits(
                np.array([token], dtype=np.int32), len(tokens) + produced - 1
            )
    if finish == "length":
        text += decoder.decode(b"", final=True)
    if on_text is not None and len(text) > sent:
        on_text(text[sent:])
    return outcome(text, produced, finish)


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """A token id: the argmax at temperature 0, else drawn from softmax(logits / T), top-p cut."""
    if temperature <= 0:
        return int(np.argmax(logits))
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = logits / temperature
        probs = np.exp(scaled - scaled.max())
    if not np.all(np.isfinite(probs)):  # a temperature so small that it overflows: greedy
        return int(np.argmax(logits))
    if top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, top_p * cumulative[-1])) + 1]
        weights = np.cumsum(probs[keep])
        return int(keep[np.searchsorted(weights, rng.random() * weights[-1], side="right")])
    cumulative = np.cumsum(probs)
    pick = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(pick, len(probs) - 1)


def _stop_index(text: str, stops: list[str], since: int) -> int | None:
    """Where the earliest stop string starts in ``text`` (searching only what is new), if any."""
    found = [i for s in stops if s and (i := text.find(s, max(0, since - len(s) + 1))) != -1]
    return min(found) if found else None


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could still become a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held
