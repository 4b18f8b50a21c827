"""What one request may spend, and whether anyone still waits for its answer.

A ``Budget`` travels with one engine call. Before anything is decoded, the request's prompt tokens
are checked against ``max_tokens`` and their estimated time (at the speed measured on this machine)
against ``max_seconds``: a request over either is refused whole, the engine untouched. While it
runs, ``interrupt`` is called at every boundary: before each ``llama_decode`` (never inside one,
llama.cpp cannot be stopped mid-call) and before each state's group of decisions. There a request
whose client went away (``cancel``, set by the adapter) stops with ``RequestCancelled``, and one
past its deadline gives ``TimeBudgetExceeded`` to the decisions it has not scored.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from arbiter.errors import RequestCancelled, TimeBudgetExceeded, TokenBudgetExceeded

TOKENS_SETTING = "ARBITER_MAX_REQUEST_TOKENS"
SECONDS_SETTING = "ARBITER_MAX_REQUEST_SECONDS"


@dataclass
class Budget:
    """One request's limits (None: unlimited) and its cancellation flag."""

    max_tokens: int | None = None
    max_seconds: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic(); set when the engine starts the work

    def start(self) -> None:
        """The clock of ``max_seconds`` starts when the engine takes the work (not in a queue)."""
        if self.max_seconds is not None and self.deadline is None:
            self.deadline = time.monotonic() + self.max_seconds

    def remaining_s(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def interrupt(self) -> None:
        """Raise when the work must stop here: the client left, or the time is spent."""
        if self.cancel.is_set():
            raise RequestCancelled("the client closed the connection; the work was stopped")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeBudgetExceeded(
                f"not scored: the request ran out of its {self.max_seconds:g} s "
                f"({SECONDS_SETTING}); send fewer or shorter decisions, or raise the limit"
            )

    def check_tokens(self, tokens: int, seconds_per_token: float | None, *, floor: bool) -> None:
        """Refuse the whole request when ``tokens`` (``floor``: a lower bound from bytes, before
        tokenizing) are over the token budget, or would take longer than the time left."""
        least = "at least " if floor else ""
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise TokenBudgetExceeded(
                f"the request needs {least}{tokens:,} prompt tokens; one request may use "
                f"{self.max_tokens:,} ({TOKENS_SETTING}). Split it into smaller requests, or "
                "raise the limit"
            )
        if self.max_seconds is None or not seconds_per_token:
            return
        estimate = tokens * seconds_per_token
        remaining = min(self.max_seconds, self.remaining_s())
        if estimate > remaining:
            raise TimeBudgetExceeded(
                f"the request's {least}{tokens:,} prompt tokens would take about {estimate:.1f} s "
                f"at this server's measured speed; one request may take {self.max_seconds:g} s "
                f"({SECONDS_SETTING}). Split it into smaller requests, or raise the limit"
            )


class Speed:
    """Seconds per decoded prompt token, a moving average of what this engine measured."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.seconds_per_token: float | None = None
        self._lock = threading.Lock()

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        sample = seconds / tokens
        with self._lock:
            old = self.seconds_per_token
            self.seconds_per_token = sample if old is None else old + self.weight * (sample - old)
