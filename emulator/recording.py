"""When an async answer cannot be recorded: wait for the store, do not ask the model again.

An outcome that neither S3 nor SNS would take goes back to the queue, and its wait doubles with
each receive (up to ``MOST_S``); after such a failure no request reaches the container until the
store answers a ``HeadBucket`` again. An outage spends waiting, not the model's time recomputing an
answer the store cannot keep (STYLE: retries by kind of fault). The request's
``RequestTTLSeconds`` still ends it, with a failure, once the store is back.
"""

from __future__ import annotations

from typing import Any

from arbiter.logging import get_logger

log = get_logger("arbiter.runtime")
MOST_S = 900


def unrecorded_delay(receives: int, first_s: float) -> int:
    """Seconds before a request whose outcome went unrecorded is taken again (its ``receives``-th
    receive): ``first_s`` doubling, at most ``MOST_S``."""
    return int(min(first_s * 2 ** min(max(receives - 1, 0), 12), MOST_S))


class StoreGate:
    """Shut when an outcome went unrecorded; opened by the next store probe that succeeds."""

    def __init__(self, s3: Any) -> None:
        self.s3 = s3
        self.shut = False

    async def open(self, bucket: str) -> bool:
        """Whether a request may be sent to the container now."""
        if not self.shut:
            return True
        try:
            await self.s3.head_bucket(Bucket=bucket)
        except Exception as exc:
            log.warning("async_store_still_down", bucket=bucket, error=repr(exc))
            return False
        self.shut = False
        log.info("async_store_back", bucket=bucket)
        return True
