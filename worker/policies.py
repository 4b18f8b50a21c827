"""Small, swappable decisions of the queue loop, each with its own unit tests (as in sqs-workers)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ExponentialBackoff:
    """Visibility delay before a failed job is seen again, from SQS's ``ApproximateReceiveCount``.

    Receive 1 failed: ``base``; receive 2: ``2 * base``; ... capped at ``maximum`` (and at SQS's
    12-hour visibility limit). The count comes from SQS, so the backoff survives worker restarts.
    """

    base_s: float = 2.0
    maximum_s: float = 300.0

    def delay(self, receive_count: int) -> int:
        attempt = max(1, receive_count)
        seconds = self.base_s * (2 ** min(attempt - 1, 30))
        return int(min(seconds, self.maximum_s, 43_200))


@dataclass
class DrainDeadline:
    """After SIGTERM: the job in hand may finish until the deadline, then its message is released."""

    deadline_s: float
    started_at: float | None = None

    def start(self, now: float | None = None) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic() if now is None else now

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def remaining(self, now: float | None = None) -> float:
        if self.started_at is None:
            return float("inf")
        now = time.monotonic() if now is None else now
        return max(0.0, self.started_at + self.deadline_s - now)


def goes_to_dlq(receive_count: int, max_receive_count: int | None) -> bool:
    """True if this failed receive was the last one SQS allows before the redrive moves it."""
    return max_receive_count is not None and receive_count >= max_receive_count
