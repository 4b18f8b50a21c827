"""What a text generation is asked for and what it gives back: sampling parameters, choices, and
per-token log-probabilities. Plain data and numpy; llama.cpp's sampler chain is ``sampler``.

Log-probabilities are the model's own (a log-softmax of the raw logits of the row that generation
decodes anyway), before any sampling control: temperature, penalties, ``logit_bias`` and grammars
change which token is picked, not the probabilities reported, as in llama.cpp's server. The top
alternatives come from a partial sort (``argpartition``) of that one row, never a full sort of the
vocabulary.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from arbiter.engine.probabilities import logsumexp

MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and llama.cpp server's useful range
_RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp would pick a random seed itself
# Under this, logits / temperature can overflow float32 (llama.cpp's draw then picks a token at
# random from NaNs): as good as greedy anyway, so greedy it is.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's sampler chain, in the order it is applied: ``logit_bias``, the penalties, the
    grammar, ``top_k``, ``top_p``, ``min_p``, the temperature, then a seeded draw (greedy at
    temperature 0). Defaults switch a stage off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    penalty_last_n: int = -1  # tokens the penalties look back over; -1: the whole completion
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None  # GBNF (``arbiter.engine.grammar`` writes it for JSON schemas)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def choice_seed(self, index: int) -> int:
        """The 32-bit seed of choice ``index``: fixed by ``seed`` (each choice its own), else
        random per request."""
        if self.seed is None:
            return secrets.randbelow(_RANDOM_SEED)
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % _RANDOM_SEED


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: bytes


@dataclass
class TokenLogprob:
    """One generated token. ``token`` is the text it adds to the content (a character split over
    two tokens appears on the one that completes it; a token cut by a stop string keeps what is
    before the cut), so the tokens of a choice join to its content exactly; ``bytes`` are the
    token's own, cut with it by a stop string, so they too join to the content's bytes."""

    token: str
    logprob: float
    bytes: bytes
    top: list[TopLogprob] = field(default_factory=list)
    start: int = 0  # where ``token`` starts in the choice's text


@dataclass(frozen=True)
class Choice:
    """One generated continuation."""

    index: int
    text: str
    finish_reason: str  # "stop" (end of generation or a stop string), "length", "cancelled"
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Generation:
    """The outcome of ``Engine.generate``: the choices, and the prompt's cost (prefilled once for
    all of them)."""

    prompt_tokens: int
    choices: tuple[Choice, ...]
    prefill_s: float
    decode_s: float

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)


# Streaming: (choice index, text that became final, its tokens' log-probabilities or None);
# returning False stops the generation (finish reason ``cancelled``).
OnDelta = Callable[[int, str, list[TokenLogprob] | None], bool]


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, np.ndarray, np.ndarray]:
    """The log-probability of ``token`` and the ``k`` most likely tokens with theirs, most likely
    first, from one row of logits (a partial sort: O(vocabulary), not O(vocabulary log it))."""
    row = np.asarray(logits, dtype=np.float64)
    total = float(logsumexp(row))
    if k <= 0:
        return float(row[token]) - total, np.zeros(0, dtype=np.int64), np.zeros(0)
    k = min(k, len(row))
    top = np.argpartition(row, len(row) - k)[len(row) - k :]
    top = top[np.argsort(-row[top], kind="stable")]
    return float(row[token]) - total, top, row[top] - total
