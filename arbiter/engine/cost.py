"""A prompt's cost from its bytes, before anything is tokenized, and the field a too-long one names.

No token covers more bytes than the vocabulary's longest piece (``max_piece``, measured at load), so
``n`` bytes of text are at least ``ceil(n / max_piece)`` tokens. A decision or chat prompt whose floor
is over the context cannot fit and is refused in microseconds (tokenizing a 5 MB state whole, then
field by field, to say so would cost 10 s of engine time), and a request's floor, summed, is
checked against its token budget before it is admitted.

The floor holds for tokenizers that never drop input bytes: SentencePiece and byte-level BPE (every
model family served here). Others normalize text (WordPiece, Unigram can delete characters), so
their floor is 0 and only the exact count, after tokenizing, refuses.

When a prompt is too long, the part to shorten is the one with the most bytes: the state, the
question, or the options together (one description when it holds most of their bytes); its share
of the tokens is the prompt's count in proportion to its bytes. No field is tokenized again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from arbiter import prompt as prompts
from arbiter.errors import ContextLengthExceeded
from arbiter.schema import DecisionRequest


@dataclass(frozen=True)
class Parts:
    """A decision's caller-written text, in UTF-8 bytes per part."""

    state: int
    question: int
    options: tuple[int, ...]  # each description

    @classmethod
    def of(cls, request: DecisionRequest, state_bytes: int | None = None) -> Parts:
        if state_bytes is None:
            state_bytes = _utf8_len(prompts.state_text(request.state))
        return cls(
            state=state_bytes,
            question=_utf8_len(request.question),
            options=tuple(_utf8_len(o.description) for o in request.options),
        )

    @property
    def suffix(self) -> int:
        """What follows the state: the question and the options."""
        return self.question + sum(self.options)

    @property
    def total(self) -> int:
        return self.state + self.suffix

    def largest(self) -> tuple[str, int]:
        """The part to shorten, and its bytes: with many short options, the options together
        outweigh a state that is longer than any one of them."""
        options = sum(self.options)
        sizes = {"state": self.state, "question": self.question, "options": options}
        name = max(sizes, key=lambda k: sizes[k])
        if name == "options":
            longest = max(range(len(self.options)), key=lambda i: self.options[i])
            if self.options[longest] * 2 > options:
                return f"options.{longest}.description", self.options[longest]
        return name, sizes[name]


def _utf8_len(text: str) -> int:
    # surrogatepass: a lone surrogate (refused elsewhere, with its own error) still has a length.
    return len(text.encode("utf-8", "surrogatepass"))


def _advice(name: str, n_options: int) -> str:
    if name == "options":
        return f"shorten the {n_options} options' descriptions or send fewer options"
    return f"shorten {name}"


@dataclass(frozen=True)
class CostFloor:
    """Token floors for this model's prompts: ``head_tokens`` and ``tail_tokens`` are the template
    tokens around every decision's content (exact); ``max_piece`` 0 means no floor from bytes."""

    n_ctx: int
    max_piece: int
    head_tokens: int = 0
    tail_tokens: int = 0

    def tokens_at_least(self, n_bytes: int) -> int:
        return math.ceil(n_bytes / self.max_piece) if self.max_piece > 0 else 0

    def decision_floor(self, parts: Parts) -> int:
        return self.head_tokens + self.tail_tokens + self.tokens_at_least(parts.total)

    def check_decision(self, request: DecisionRequest, parts: Parts | None = None) -> Parts:
        """Refuse a decision whose floor is over the context; its parts, for later use."""
        parts = parts or Parts.of(request)
        floor = self.decision_floor(parts)
        if floor > self.n_ctx:
            raise too_long(parts, self.n_ctx, floor, exact=False, n_options=len(request.options))
        return parts

    def request_floor(self, decisions: Sequence[DecisionRequest]) -> int:
        """The fewest tokens the engine decodes for ``decisions``: each distinct state's prefix
        once (with its first decision), every other decision's question and options."""
        total = 0
        seen: dict[str, int] = {}
        texts: dict[int, str] = {}  # by id(state): System One's questions share one state object
        for request in decisions:
            try:
                state = texts.get(id(request.state)) or prompts.state_text(request.state)
            except ValueError:  # not JSON: refused on its own by the engine
                continue
            texts[id(request.state)] = state
            parts = Parts.of(request, _utf8_len(state))
            total += self.tail_tokens
            if state in seen:
                total += self.tokens_at_least(parts.suffix)
            else:
                seen[state] = 1
                total += self.head_tokens + self.tokens_at_least(parts.total)
        return total

    def chat_floor(self, texts: Sequence[str]) -> int:
        return self.tokens_at_least(sum(_utf8_len(t) for t in texts))

    def check_chat(self, texts: Sequence[str], param: str = "messages") -> None:
        """A chat (or text completion) prompt must leave room for one generated token (the
        engine's own rule); ``param`` names the field: ``messages`` or ``prompt``."""
        floor = self.chat_floor(texts)
        if floor >= self.n_ctx:
            subject = "the messages are" if param == "messages" else f"the {param} is"
            raise ContextLengthExceeded(
                f"{subject} at least {floor:,} tokens "
                f"({sum(_utf8_len(t) for t in texts):,} bytes); the context holds {self.n_ctx} "
                f"tokens. Nothing is truncated: shorten the {param} or raise ARBITER_N_CTX",
                param=param,
            )


def too_long(
    parts: Parts,
    n_ctx: int,
    tokens: int,
    *,
    exact: bool,
    n_options: int,
    content_tokens: int | None = None,
    label_cells: int = 0,
) -> ContextLengthExceeded:
    """The error of a decision that does not fit, naming the part to shorten (``Parts.largest``).

    ``exact``: ``tokens`` is the tokenized count (and ``content_tokens`` the caller text's share);
    else it is the floor from bytes."""
    name, size = parts.largest()
    if exact:
        share = round((content_tokens or tokens) * size / max(parts.total, 1))
        counts = f"{tokens} tokens ({name} about {share})"
    else:
        counts = f"at least {tokens:,} tokens ({name} {size:,} bytes)"
    labels = (
        f" and reading its {n_options} option codes takes {label_cells} more" if label_cells else ""
    )
    return ContextLengthExceeded(
        f"the prompt is {counts}{labels}; the context holds {n_ctx} tokens. Nothing is "
        f"truncated: {_advice(name, n_options)} or raise ARBITER_N_CTX",
        param=name,
    )
