"""Decisions turned into tokens before anything is decoded: checked, tokenized, grouped by state.

A decision is checked against the context from its bytes first (``cost``: a prompt that cannot fit
is refused without tokenizing it), then tokenized once; a prompt that is still too long names the
part to shorten from the counts already made. The decisions of one state become a ``Group`` with
the token prefix they share, and a group knows how many tokens it will decode, so a request's budget
is checked before the engine runs (``scoring``).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from arbiter import prompt as prompts
from arbiter.engine.cost import CostFloor, Parts, too_long
from arbiter.engine.labels import CodeReadout, Labels, Paths
from arbiter.errors import (
    ArbiterError,
    EngineFailure,
    InvalidDecision,
    RequestCancelled,
    TooManyOptions,
)
from arbiter.logging import get_logger
from arbiter.schema import MAX_OPTIONS, DecisionRequest

log = get_logger("arbiter.engine")


class PromptTokens(Protocol):
    """What preparing needs of ``scoring.Prompts``: a decision's text and tokens."""

    layout: prompts.PromptLayout
    head: np.ndarray
    tail: np.ndarray

    def render(self, request: DecisionRequest) -> prompts.RenderedContent: ...

    def tokens(self, rendered: prompts.RenderedContent) -> np.ndarray: ...

    def version(self, request: DecisionRequest) -> str: ...

    def state_prefix(self, state: str) -> np.ndarray: ...


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


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


Errors = list[tuple[int, ArbiterError]]


class Preparer:
    """Checks and tokenizes decisions for a context of ``cost.n_ctx`` tokens."""

    def __init__(self, prompts_: PromptTokens, labels: Labels, cost: CostFloor) -> None:
        self.prompts = prompts_
        self.labels = labels
        self.cost = cost

    def group(
        self, state: str, members: list[tuple[int, DecisionRequest]]
    ) -> tuple[Group | None, Errors]:
        """One state's decisions tokenized, and the prefix they share; the errors of those that
        cannot be scored."""
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
            state_prefix = self.prompts.state_prefix(state)
        except Exception as exc:
            error = decision_error(exc)
            return None, errors + [(p.index, error) for p in prepared]
        # The prefix is a true token prefix of every prompt by construction: the longest run the
        # state's own tokenization shares with each full prompt (BPE merges at the boundary fall
        # outside it), and always at least one token short of the shortest.
        shared = min(_common_prefix(state_prefix, p.tokens) for p in prepared)
        shared = min(shared, min(len(p.tokens) for p in prepared) - 1)
        return Group(prepared, shared, time.perf_counter() - started), errors

    def prepare(self, index: int, request: DecisionRequest, state_bytes: int) -> Prepared:
        started = time.perf_counter()
        n_options = len(request.options)
        if n_options > MAX_OPTIONS:
            raise TooManyOptions(
                f"{n_options} options given; at most {MAX_OPTIONS} options are supported "
                f"(up to {self.labels.max_letters} are labelled with letters, more with "
                f"{self.labels.codes.name} codes)",
                param="options",
            )
        # Refused from its bytes alone when it cannot fit: nothing is tokenized.
        parts = self.cost.check_decision(request, Parts.of(request, state_bytes))
        paths = self.labels.paths(n_options)
        content = self.prompts.render(request)
        tokens = self.prompts.tokens(content)
        # Reading codes takes KV cells of its own after the prompt: counted here, before any
        # llama.cpp call, with the prompt.
        label_cells = paths.cells if paths is not None else 0
        if len(tokens) + label_cells > self.cost.n_ctx:
            fixed = len(self.prompts.head) + len(self.prompts.tail)
            raise too_long(
                parts,
                self.cost.n_ctx,
                len(tokens),
                exact=True,
                n_options=n_options,
                content_tokens=len(tokens) - fixed,
                label_cells=label_cells,
            )
        text = prompts.full_text(self.prompts.layout, content)
        return Prepared(
            index=index,
            request=request,
            tokens=tokens,
            prompt_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
            prompt_version=self.prompts.version(request),
            tokenize_s=time.perf_counter() - started,
            paths=paths,
        )
