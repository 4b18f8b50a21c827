"""What an entry point needs from the engine to score: ``Scorer`` (``arbiter.engine.Engine``, or a
fake in tests), and the outcome of one decision."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from arbiter.errors import ArbiterError
from arbiter.schema import DecisionRequest, DecisionResult, ModelInfo

Outcome = DecisionResult | ArbiterError


class Scorer(Protocol):
    model_info: ModelInfo

    def score(self, decisions: Sequence[DecisionRequest]) -> list[Outcome]:
        """One outcome per decision, in order; a decision that cannot be scored gets its error."""
        ...
