"""Text generation for chat and text completions: n choices from one prefill, llama.cpp's sampler
chain, stop strings, log-probabilities, streaming.

The prompt is prefilled once into sequence 0 with logits at its last position only; each further
choice is a copy of that sequence (``llama_memory_seq_cp``: the cells are shared, not recomputed).
Then every step decodes one token per unfinished choice in one batch, with logits at those rows
only, and each choice's sampler (``sampler``) picks its next token from its row. Text is handed
to ``on_delta`` as it becomes final, never part of a stop string.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from arbiter.engine.llama import Llama
from arbiter.engine.sampler import Candidates, Grammar, Sampler
from arbiter.engine.sampling import (
    Choice,
    Generation,
    OnDelta,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    token_logprobs,
)
from arbiter.errors import ContextLengthExceeded, InvalidDecision


@dataclass(frozen=True)
class GenerationRequest:
    """What ``generate`` is asked for; ``top_logprobs`` None: no log-probabilities."""

    budget: int  # tokens per choice
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    n: int = 1
    top_logprobs: int | None = None


@dataclass
class _Choice:
    index: int
    sampler: Sampler
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )
    text: str = ""
    produced: int = 0
    sent: int = 0  # characters of text handed to on_delta
    sent_logprobs: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    last: int = -1
    cut: bool = False


def request_for(
    prompt_tokens: int,
    llama: Llama,
    max_tokens: int,
    sampling: SamplingParams,
    stop: Sequence[str],
    n: int,
    top_logprobs: int | None,
) -> GenerationRequest:
    """What a generation of ``n`` choices after a prompt of ``prompt_tokens`` may spend in
    ``llama``'s context, or the typed error naming the parameter that does not fit (checked
    before anything is decoded)."""
    if not 1 <= n <= llama.n_seq_max:
        raise InvalidDecision(
            f"n is {n}; this context generates 1 to {llama.n_seq_max} choices",
            param="n",
            code="invalid_field",
        )
    n_ctx = llama.n_ctx
    if prompt_tokens >= n_ctx:
        raise ContextLengthExceeded(
            f"the prompt is {prompt_tokens} tokens; the context holds {n_ctx} tokens",
            param="messages",
        )
    # The choices share the prompt's cells; each needs its own for what it generates.
    limit = min(max_tokens, (n_ctx - prompt_tokens) // n)
    if limit < 1:
        raise ContextLengthExceeded(
            f"the prompt is {prompt_tokens} tokens; {n} choices need at least {n} more and the "
            f"context holds {n_ctx} tokens",
            param="n",
        )
    return GenerationRequest(limit, sampling, tuple(stop), n, top_logprobs)


def generate(
    llama: Llama, tokens: np.ndarray, request: GenerationRequest, on_delta: OnDelta | None
) -> Generation:
    """Up to ``request.budget`` tokens per choice after ``tokens`` (sequence 0 of an empty KV
    cache, held by the caller; choice i decodes into sequence i), under the request's grammar if
    it has one. ``on_delta`` returning False stops every choice (finish reason ``cancelled``)."""
    if request.sampling.grammar is None:
        return _generate(llama, tokens, request, None, on_delta)
    with llama.vocab.vocabulary() as vocab:
        grammar = Grammar(vocab, request.sampling.grammar)
    try:
        return _generate(llama, tokens, request, grammar, on_delta)
    finally:
        grammar.close()


def _generate(
    llama: Llama,
    tokens: np.ndarray,
    request: GenerationRequest,
    grammar: Grammar | None,
    on_delta: OnDelta | None,
) -> Generation:
    started = time.perf_counter()
    row = llama.last_logits(tokens, 0)
    prefill_s = time.perf_counter() - started
    for seq in range(1, request.n):
        llama.copy_sequence(0, seq)
    candidates = Candidates(llama.n_vocab)
    sampling = request.sampling
    choices: list[_Choice] = []
    pieces: dict[int, bytes] = {}
    try:
        for i in range(request.n):
            sampler = Sampler(
                llama.n_vocab,
                sampling,
                sampling.choice_seed(i),
                request.budget,
                grammar,
                candidates,
            )
            choices.append(_Choice(i, sampler))
        rows = [row] * request.n
        active = choices
        while active:
            for choice, logits in zip(active, rows, strict=True):
                _step(llama, choice, logits, request, pieces)
                if on_delta is not None and not _emit(choice, request, on_delta):
                    for c in choices:
                        c.finish = c.finish or "cancelled"
                    break
            active = [c for c in choices if c.finish is None]
            if active:
                rows = _decode_next(llama, active, len(tokens))
    finally:
        for choice in choices:
            choice.sampler.close()
    for choice in choices:
        _finish(choice, request, on_delta)
    total = time.perf_counter() - started
    results = tuple(
        Choice(
            c.index,
            c.text,
            c.finish or "length",
            c.produced,
            c.logprobs if request.top_logprobs is not None else None,
        )
        for c in choices
    )
    return Generation(len(tokens), results, prefill_s, total - prefill_s)


def _step(
    llama: Llama,
    choice: _Choice,
    logits: np.ndarray,
    request: GenerationRequest,
    pieces: dict[int, bytes],
) -> None:
    """Sample the choice's next token from its row, and append its text (or finish it)."""
    token = choice.sampler.sample(logits)
    if llama.vocab.is_end_of_generation(token):
        choice.finish = "stop"
        return
    choice.produced += 1
    choice.last = token
    piece = llama.vocab.piece_bytes(token)
    start = len(choice.text)
    choice.text += choice.decoder.decode(piece)
    if request.top_logprobs is not None:
        logprob, top, top_values = token_logprobs(logits, token, request.top_logprobs)
        alternatives = [
            TopLogprob(p.decode("utf-8", "replace"), v, p)
            for t, v in zip(top.tolist(), top_values.tolist(), strict=True)
            if (p := _piece(llama, pieces, t)) is not None
        ]
        choice.logprobs.append(
            TokenLogprob(choice.text[start:], logprob, piece, alternatives, start)
        )
    cut = _stop_index(choice.text, request.stop, start)
    if cut is not None:
        _cut(choice, cut)
        choice.finish = "stop"
    elif choice.produced >= request.budget:
        choice.finish = "length"


def _piece(llama: Llama, pieces: dict[int, bytes], token: int) -> bytes:
    found = pieces.get(token)
    if found is None:
        found = pieces[token] = llama.vocab.piece_bytes(token, special=True)
    return found


def _cut(choice: _Choice, cut: int) -> None:
    """End the text at a stop string; tokens after the cut go, one across it keeps its part, and
    its ``bytes`` are cut with it, so the kept tokens' bytes join to the content's bytes."""
    choice.text = choice.text[:cut]
    choice.cut = True
    kept = [lp for lp in choice.logprobs if lp.start < cut]
    for lp in kept:
        lp.token = lp.token[: max(0, cut - lp.start)]
    if kept and kept[-1].start + len(kept[-1].token) == cut:
        before = sum(len(lp.bytes) for lp in kept[:-1])
        kept[-1].bytes = choice.text.encode("utf-8", "surrogatepass")[before:]
    choice.logprobs = kept


def _emit(choice: _Choice, request: GenerationRequest, on_delta: OnDelta) -> bool:
    """Hand on what became final (all of it once finished; else up to a possible stop string)."""
    if choice.finish is not None:
        return True  # _finish hands on the rest
    final = len(choice.text) - _held_back(choice.text, request.stop)
    if final <= choice.sent:
        return True
    ready = [
        lp for lp in choice.logprobs[choice.sent_logprobs :] if lp.start + len(lp.token) <= final
    ]
    logprobs = ready if request.top_logprobs is not None else None
    ok = on_delta(choice.index, choice.text[choice.sent : final], logprobs)
    choice.sent = final
    choice.sent_logprobs += len(ready)
    return ok


def _finish(choice: _Choice, request: GenerationRequest, on_delta: OnDelta | None) -> None:
    """Flush an incomplete character at the end (as U+FFFD), hand on the rest."""
    if choice.finish == "cancelled":
        _cut(choice, choice.sent)
        return
    if not choice.cut:
        tail = choice.decoder.decode(b"", final=True)
        if tail:
            choice.text += tail
            if choice.logprobs:
                choice.logprobs[-1].token += tail
    rest = choice.logprobs[choice.sent_logprobs :]
    if on_delta is not None and (len(choice.text) > choice.sent or rest):
        # A token whose text was sent before a stop string cut it may be all that is left.
        on_delta(
            choice.index,
            choice.text[choice.sent :],
            rest if request.top_logprobs is not None else None,
        )
        choice.sent = len(choice.text)


def _decode_next(llama: Llama, active: list[_Choice], prompt_len: int) -> list[np.ndarray]:
    """Decode each active choice's last token into its own sequence, in one batch; the rows of
    logits (views, valid until the next decode) in the same order."""
    n = len(active)
    llama.decode(
        np.array([c.last for c in active], dtype=np.int32),
        np.array([prompt_len + c.produced - 1 for c in active], dtype=np.int32),
        np.array([c.index for c in active], dtype=np.int32),
        np.ones(n, dtype=np.int8),
    )
    return [llama.logits(i) for i in range(n)]


def _stop_index(text: str, stops: tuple[str, ...], since: int) -> int | None:
    """Where the earliest stop string starts in ``text`` (searching only what is new), if any."""
    found = [i for s in stops if s and (i := text.find(s, max(0, since - len(s) + 1))) != -1]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could still become a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held
