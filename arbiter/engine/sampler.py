"""llama.cpp's sampler chain and grammar sampler through the C API (``llama_sampler_*``).

One chain per choice: ``logit_bias``, penalties, ``top_k``, ``top_p``, ``min_p``, temperature and a
seeded draw, or greedy. A grammar is checked the way llama.cpp's own server does it: the chain
picks a token from the unconstrained row, the grammar is asked about that one token, and only when
it refuses is the grammar applied to the whole vocabulary and the token drawn again. Greedy, that
is the grammar's argmax; sampled without a truncating stage (``top_k``, ``top_p``, ``min_p``), it
is a draw from the grammar-masked distribution exactly (a refused first draw is thrown away); with
one, the first draw's truncation sees the unmasked row, as in llama.cpp's server. Most tokens cost
one grammar check instead of one per vocabulary entry (``arbiter bench generation``).

A grammar sampler must never accept a token it would refuse: llama.cpp throws through the C API
(the process aborts). Every accepted token has passed the grammar's own check first.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp
import numpy as np

from arbiter.engine import backends
from arbiter.engine.sampling import SamplingParams
from arbiter.errors import EngineFailure, InvalidGrammar

# llama_token_data: {int32 id; float logit; float p}, 12 bytes, no padding.
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


class Candidates:
    """A ``llama_token_data_array`` over a numpy buffer: filled from a row of logits by numpy,
    rewritten in place by the samplers."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.data = np.zeros(n, dtype=TOKEN_DATA)
        self._ids = np.arange(n, dtype=np.int32)
        array: Any = llama_cpp.llama_token_data_array()
        array.data = self.data.ctypes.data_as(llama_cpp.llama_token_data_p)
        self.array = array
        self.ref = ctypes.byref(self.array)

    def fill(self, logits: np.ndarray | None = None, token: int | None = None) -> None:
        """The whole row (``logits``), or the single candidate ``token``."""
        if token is not None:
            self.data[0] = (token, 0.0, 0.0)
            size = 1
        else:
            self.data["id"] = self._ids
            self.data["logit"] = logits
            self.data["p"] = 0.0
            size = self.n
        self.array.size = size
        self.array.selected = -1
        self.array.sorted = False

    def selected(self) -> int:
        index = int(self.array.selected)
        if not 0 <= index < int(self.array.size):
            raise EngineFailure("llama.cpp's sampler selected no token")
        return int(self.data["id"][index])

    def any_allowed(self) -> bool:
        return bool(np.isfinite(self.data["logit"][: int(self.array.size)]).any())


class Grammar:
    """A GBNF grammar compiled for one vocabulary (``llama_sampler_init_grammar``); each choice
    uses a clone of it. Compiling is the validity check: a grammar llama.cpp cannot parse, or one
    it refuses (left recursion, an undefined rule), is ``InvalidGrammar`` with llama.cpp's reason."""

    def __init__(self, vocab: Any, text: str, *, param: str = "grammar") -> None:
        if not text.strip():
            raise InvalidGrammar(f"{param}: the grammar is empty", param=param)
        with backends.collected_errors() as errors:
            handle = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
        if not handle:
            reason = " ".join(line.strip() for line in errors[:2] if line.strip())[:300]
            raise InvalidGrammar(
                f"{param}: llama.cpp cannot use this grammar ({reason or 'parse error'})",
                param=param,
            )
        self.handle: Any = handle

    def clone(self) -> Any:
        return llama_cpp.llama_sampler_clone(self.handle)

    def mask(self, candidates: Candidates) -> None:
        """Set the logit of every candidate the grammar refuses (at its start) to -inf: what a
        grammar costs per token when applied to the whole vocabulary (``arbiter bench``)."""
        llama_cpp.llama_sampler_apply(self.handle, candidates.ref)

    def close(self) -> None:
        if self.handle:
            llama_cpp.llama_sampler_free(self.handle)
            self.handle = None


class Sampler:
    """One choice's chain (and its grammar's clone), fed one row of logits per token."""

    def __init__(
        self,
        n_vocab: int,
        params: SamplingParams,
        seed: int,
        budget: int,
        grammar: Grammar | None,
        candidates: Candidates,
    ) -> None:
        self.candidates = candidates
        self.single = Candidates(1)
        self.chain: Any = llama_cpp.llama_sampler_chain_init(
            llama_cpp.llama_sampler_chain_default_params()
        )
        self.grammar: Any = grammar.clone() if grammar is not None else None
        for stage in _stages(n_vocab, params, seed, budget):
            llama_cpp.llama_sampler_chain_add(self.chain, stage)  # the chain owns it now

    def sample(self, logits: np.ndarray) -> int:
        """The next token, accepted by the chain (penalties count it) and the grammar."""
        cand = self.candidates
        cand.fill(logits)
        llama_cpp.llama_sampler_apply(self.chain, cand.ref)
        token = cand.selected()
        if self.grammar is not None and not self._grammar_allows(token):
            cand.fill(logits)
            llama_cpp.llama_sampler_apply(self.grammar, cand.ref)
            if not cand.any_allowed():
                raise InvalidGrammar(
                    "the grammar allows no token of this model's vocabulary here", param="grammar"
                )
            llama_cpp.llama_sampler_apply(self.chain, cand.ref)
            token = cand.selected()
            if not self._grammar_allows(token):  # only a masked token can be left: never
                raise EngineFailure("the sampler chain picked a token the grammar refuses")
        llama_cpp.llama_sampler_accept(self.chain, token)
        if self.grammar is not None:
            llama_cpp.llama_sampler_accept(self.grammar, token)
        return token

    def _grammar_allows(self, token: int) -> bool:
        single = self.single
        single.fill(token=token)
        llama_cpp.llama_sampler_apply(self.grammar, single.ref)
        return bool(np.isfinite(single.data["logit"][0]))

    def close(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar:
            llama_cpp.llama_sampler_free(self.grammar)
            self.grammar = None


def _stages(n_vocab: int, p: SamplingParams, seed: int, budget: int) -> list[Any]:
    """The chain's samplers, in llama.cpp server's order; a stage left at its default is left
    out."""
    stages: list[Any] = []
    if p.logit_bias:
        biases: Any = (llama_cpp.llama_logit_bias * len(p.logit_bias))(*p.logit_bias)  # type: ignore[misc]
        stages.append(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(p.logit_bias), biases))
    if p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        last_n = budget if p.penalty_last_n < 0 else p.penalty_last_n
        stages.append(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab, last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
            )
        )
    if p.greedy:
        stages.append(llama_cpp.llama_sampler_init_greedy())
        return stages
    if 0 < p.top_k < n_vocab:
        stages.append(llama_cpp.llama_sampler_init_top_k(p.top_k))
    if p.top_p < 1.0:
        stages.append(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
    if p.min_p > 0.0:
        stages.append(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
    stages.append(llama_cpp.llama_sampler_init_temp(p.temperature))
    stages.append(llama_cpp.llama_sampler_init_dist(seed))
    return stages
