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


SQS_MAX_VISIBILITY_S = 43_200  # SQS never keeps a message invisible past 12 h from its receive


def lease_extension(
    elapsed_s: float, timeout_s: int, interval_s: float, limit_s: float = SQS_MAX_VISIBILITY_S
) -> int | None:
    """Seconds to extend a running job's message by, at a heartbeat ``elapsed_s`` after its receive.

    Never past ``limit_s`` (less one heartbeat of margin). None when the extension could not last
    until the next heartbeat: the job must stop and give its message back before SQS shows it to
    another worker anyway.
    """
    seconds = min(timeout_s, int(limit_s - elapsed_s - interval_s))
    return seconds if seconds > interval_s else None


@dataclass(frozen=True)
class RestartPolicy:
    """When the pool restarts a dead worker process, and when it gives up.

    A worker that dies young (before ``reset_s``) adds to its slot's count of crashes in a row;
    one that ran longer starts the count again. The n-th restart in a row waits
    ``base_s * 2^(n-1)`` (capped at ``maximum_s``); past ``max_restarts`` the answer is None: a
    crash loop, which the pool reports by draining and exiting non-zero.
    """

    base_s: float = 1.0
    maximum_s: float = 60.0
    max_restarts: int = 5
    reset_s: float = 60.0

    def crashes(self, previous: int, lived_s: float) -> int:
        """The slot's crashes in a row, counting this death."""
        return 1 if lived_s >= self.reset_s else previous + 1

    def delay(self, crashes: int) -> float | None:
        if crashes > self.max_restarts:
            return None
        return float(min(self.base_s * 2 ** min(crashes - 1, 30), self.maximum_s))
