"""A request's cost, bounded before it is admitted, and the budget its engine call carries.

Before a request takes a slot, its floor from bytes (``arbiter.engine.cost``) is checked: a
decision that cannot fit the context, or a request whose tokens cannot fit its budget
(``ARBITER_MAX_REQUEST_TOKENS``, ``ARBITER_MAX_REQUEST_SECONDS``), is refused in microseconds
instead of waiting in the queue to be refused. Once admitted, its engine call carries a ``Budget``
with the same limits, checked on the exact tokens before anything is decoded, and the slot's
cancellation flag, so work whose client went away stops (``adapter.admission``).
"""

from __future__ import annotations

from collections.abc import Sequence

from adapter.admission import Slot
from arbiter.engine import Budget, Engine
from arbiter.errors import ArbiterError
from arbiter.schema import DecisionRequest, ModelInfo
from arbiter.scorer import Outcome
from arbiter.settings import ServerSettings, request_token_limit


def limits(settings: ServerSettings, engine: Engine, slot: Slot | None = None) -> Budget:
    """The budget of one request (with ``slot``: cancelled when its holder leaves)."""
    budget = Budget(
        max_tokens=request_token_limit(settings, engine.n_ctx),
        max_seconds=settings.max_request_seconds,
    )
    if slot is not None:
        budget.cancel = slot.cancel
    return budget


def screen(
    settings: ServerSettings, engine: Engine, decisions: Sequence[DecisionRequest]
) -> list[ArbiterError | None]:
    """Before admission: each decision's error when it cannot fit the context (None when it
    may); then the floor of those that may fit is checked against the request's budget (that
    raises: the whole request is refused)."""
    cost = engine.cost
    errors: list[ArbiterError | None] = []
    for request in decisions:
        try:
            cost.check_decision(request)
            errors.append(None)
        except ArbiterError as exc:
            errors.append(exc)
    fitting = [d for d, error in zip(decisions, errors, strict=True) if error is None]
    if fitting:
        floor = cost.request_floor(fitting)
        limits(settings, engine).check_tokens(floor, engine.seconds_per_token, floor=True)
    return errors


class Cancellable:
    """An engine whose every call carries one budget (a JSON Lines stream's chunks), for code
    that knows only ``Scorer.score(decisions)``."""

    def __init__(self, engine: Engine, budget: Budget) -> None:
        self.engine = engine
        self.budget = budget
        self.model_info: ModelInfo = engine.model_info

    def score(self, decisions: Sequence[DecisionRequest]) -> list[Outcome]:
        return self.engine.score(decisions, self.budget)
