"""Decisions turned into tokens before anything is decoded: checked, tokenized, grouped by state.

A decision is checked against the context from its bytes first (``cost``: a prompt that cannot fit
is refused without tokenizing it), then tokenized once; a prompt that is still too long names the
part to shorten from the counts already made. The decisions of one state become a ``Group`` with
the token prefix they share, and a group knows how many tokens it will decode, so a request's budget
is checked before the engine runs (``scoring``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from arbiter import prompt as prompts
from arbiter.engine.cost import CostFloor, Parts, too_long
from arbiter.engine.labels import CodeReadout, Labels, Paths
from arbiter.engine.prompting import prompt_sha256
from arbiter.engine.rotation import Order, Read
from arbiter.errors import (
    ArbiterError,
    EngineFailure,
    InvalidDecision,
    RequestCancelled,
    TooManyOptions,
)
from arbiter.logging import get_logger
from arbiter.schema import DecisionRequest

log = get_logger("arbiter.engine")


class PromptTokens(Protocol):
    """What preparing needs of ``prompting.Prompts``: a decision's text and tokens."""

    def layout_for(self, n_options: int) -> prompts.PromptLayout: ...

    def render(self, request: DecisionRequest) -> prompts.RenderedContent: ...

    def tokens(self, rendered: prompts.RenderedContent) -> np.ndarray: ...

    def fixed_tokens(self, layout: prompts.PromptLayout) -> int: ...

    def version(self, request: DecisionRequest) -> str: ...

    def shared_prefix(
        self, state: str, layout: prompts.PromptLayout, prompt_tokens: Sequence[np.ndarray]
    ) -> int: ...


@dataclass
class Prepared:
    """A validated decision turned into tokens, waiting for its group's forward pass."""

    index: int
    request: DecisionRequest
    tokens: np.ndarray
    prompt_sha256: str
    prompt_version: str
    tokenize_s: float
    paths: Paths | None = None  # codes: the label decode to run after the suffix
    readout: CodeReadout | None = None
    readout_s: float = 0.0
    logits: np.ndarray = field(default_factory=lambda: np.zeros(0))
    full_lse: float = 0.0
    # Adaptive rotation (``rotation``): the orders read so far; a variant (another order of a
    # decision, read on the same prefix) names its decision and its order.
    reads: list[Read] = field(default_factory=list)
    order: Order = ()
    parent: Prepared | None = None
    extra_s: float = 0.0  # time spent reading further orders
    extra_tokens: int = 0  # the suffix tokens of the further orders read

    def keep_read(self) -> None:
        """The read just made (``logits``, ``full_lse``) into its decision's reads."""
        owner = self.parent or self
        order = self.order or tuple(range(len(self.request.options)))
        owner.reads.append(Read(order, self.logits, self.full_lse))

    @property
    def label_cells(self) -> int:
        """KV cells the label decode takes after the prompt (0 for letters)."""
        return self.paths.cells if self.paths is not None else 0

    @property
    def label_branches(self) -> int:
        return len(self.paths.branches) if self.paths is not None else 0


@dataclass
class Group:
    """One state's decisions, tokenized, and the token prefix they share."""

    prepared: list[Prepared]
    shared: int
    tokenize_s: float
    state_bytes: int = 0

    @property
    def tokens(self) -> int:
        """Tokens the engine decodes for the group: the prefix once, each member's own suffix
        and label branches (what a request's token budget counts)."""
        return self.shared + sum(len(p.tokens) - self.shared + p.label_cells for p in self.prepared)


def decision_error(exc: Exception) -> ArbiterError:
    """Any failure while scoring one decision, as that decision's typed error. A cancellation is
    not one decision's: it is raised again, and ends the whole call."""
    if isinstance(exc, RequestCancelled):
        raise exc
    if isinstance(exc, ArbiterError):
        return exc
    if isinstance(exc, UnicodeError):
        return InvalidDecision(f"the text is not valid Unicode: {exc}", code="invalid_text")
    log.error("decision_failed", error=repr(exc), exc_info=exc)
    return EngineFailure(f"this decision could not be scored ({type(exc).__name__}); see the log")


Errors = list[tuple[int, ArbiterError]]


class Preparer:
    """Checks and tokenizes decisions for a context of ``cost.n_ctx`` tokens."""

    def __init__(self, prompts_: PromptTokens, labels: Labels, cost: CostFloor) -> None:
        self.prompts = prompts_
        self.labels = labels
        self.cost = cost

    def group(
        self, state: str, layout: prompts.PromptLayout, members: list[tuple[int, DecisionRequest]]
    ) -> tuple[Group | None, Errors]:
        """One state's decisions in one layout tokenized, and the prefix they share; the errors
        of those that cannot be scored."""
        errors: Errors = []
        prepared: list[Prepared] = []
        state_bytes = len(state.encode("utf-8", "surrogatepass"))
        for index, request in members:
            try:
                prepared.append(self.prepare(index, request, state_bytes))
            except Exception as exc:
                errors.append((index, decision_error(exc)))
        if not prepared:
            return None, errors
        started = time.perf_counter()
        try:
            # A true token prefix of every prompt by construction (``Prompts.shared_prefix``).
            shared = self.prompts.shared_prefix(state, layout, [p.tokens for p in prepared])
        except Exception as exc:
            error = decision_error(exc)
            return None, errors + [(p.index, error) for p in prepared]
        return Group(prepared, shared, time.perf_counter() - started, state_bytes), errors

    def variant(self, p: Prepared, order: Order, group: Group) -> Prepared | None:
        """Decision ``p`` with its options in ``order``, tokenized, to be read on the group's
        prefix; None when its prompt does not start with that prefix (a tokenizer that merges
        across the state's end differently: the decision keeps the reads it has)."""
        request = p.request.model_copy(update={"options": [p.request.options[i] for i in order]})
        variant = self.prepare(p.index, request, group.state_bytes)
        head = group.prepared[0].tokens[: group.shared]
        if len(variant.tokens) <= group.shared or not np.array_equal(
            variant.tokens[: group.shared], head
        ):
            return None
        variant.order, variant.parent = order, p
        return variant

    def prepare(self, index: int, request: DecisionRequest, state_bytes: int) -> Prepared:
        started = time.perf_counter()
        n_options = len(request.options)
        if n_options > self.labels.max_options:
            raise TooManyOptions(self.labels.too_many(n_options), param="options")
        # Refused from its bytes alone when it cannot fit: nothing is tokenized.
        parts = self.cost.check_decision(request, Parts.of(request, state_bytes))
        paths = self.labels.paths(n_options)
        content = self.prompts.render(request)
        tokens = self.prompts.tokens(content)
        # Reading codes takes KV cells of its own after the prompt: counted here, before any
        # llama.cpp call, with the prompt.
        label_cells = paths.cells if paths is not None else 0
        if len(tokens) + label_cells > self.cost.n_ctx:
            fixed = self.prompts.fixed_tokens(content.layout)
            raise too_long(
                parts,
                self.cost.n_ctx,
                len(tokens),
                exact=True,
                n_options=n_options,
                content_tokens=len(tokens) - fixed,
                label_cells=label_cells,
            )
        return Prepared(
            index=index,
            request=request,
            tokens=tokens,
            prompt_sha256=prompt_sha256(prompts.full_text(content)),
            prompt_version=self.prompts.version(request),
            tokenize_s=time.perf_counter() - started,
            paths=paths,
        )
