"""Which failures count towards a message's tries, and which are the store's or the queue's.

A shard, job or merge is given up (a shard's lines ``shard_failed``, a job dead-lettered) only for
what its own work causes: the engine failing, an input that cannot be read as the plan says, a bug.
Those are :attr:`Fault.WORK` and spend one of the message's tries. What S3 or SQS does to every
message alike (5xx and ``SlowDown``, throttling, timeouts, connection errors, a 409
``ConditionalRequestConflict``, a role denied by a bad deploy) is :attr:`Fault.STORE` or
:attr:`Fault.QUEUE`: the message is retried with backoff without spending a try, and the worker's
circuit breaker (:mod:`worker.breaker`) stops receiving while the store is down, so an outage of any
length burns no message (counted as tries, 75 s of 503s on the shard inputs would turn 8 of 12
good lines into ``shard_failed``).

A 403 is the store's: S3 answers it to a role without a grant, and the fix is a deploy, never a
change of the data (a read of a missing key under a role without ``s3:ListBucket`` is resolved to
"missing" before it gets here, :func:`worker.s3io.gone`). But not a 403 (or a KMS refusal) on the
read of one job's input that a listing shows is there: that is the object's own (its key, its ACL,
a policy on its tags), raised as :class:`worker.jobs.InputDenied` with ``fault = Fault.WORK``, and
its job is rejected on its last try, with its record (as an outage it would be held for a day,
then dead-lettered without one). An exception that names its own ``fault`` is taken at its word.
"""

from __future__ import annotations

import asyncio
from enum import StrEnum

import aiohttp
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError


class Fault(StrEnum):
    WORK = "work"  # the engine or the data: counts towards the give-up
    STORE = "store"  # S3 unavailable, throttling, denied: retried, never counted
    QUEUE = "queue"  # SQS likewise
    RACE = "race"  # another worker is doing this step now: retried, never counted, no breaker

    @property
    def counts(self) -> bool:
        """Whether a receive that failed with this fault spends one of the message's tries."""
        return self is Fault.WORK


class Transient(Exception):
    """A store or queue fault that the worker names itself (a status that stays contended, SQS
    refusing sends): retried like any S3 or SQS error, never counted."""

    fault = Fault.STORE


class QueueRefused(Transient):
    """SQS kept refusing messages the worker must send."""

    fault = Fault.QUEUE


class Busy(Transient):
    """An ordinary race at a job's end (another worker sending its records, a status key that
    kept changing): the message comes back after a backoff, spends no try, and opens no breaker,
    logs no error and moves no outage metric, since S3 is healthy (an alarm on the breaker
    would fire on these)."""

    fault = Fault.RACE


SQS_OPERATIONS = frozenset(
    {
        "ReceiveMessage",
        "SendMessage",
        "SendMessageBatch",
        "DeleteMessage",
        "DeleteMessageBatch",
        "ChangeMessageVisibility",
        "ChangeMessageVisibilityBatch",
        "GetQueueUrl",
        "GetQueueAttributes",
    }
)
# Error codes that name a passing condition of the service, whatever their HTTP status.
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "RequestTimeoutException",
        "ServiceUnavailable",
        "InternalError",
        "InternalFailure",
        "ConditionalRequestConflict",
        "OperationAborted",
        "KMS.ThrottlingException",
        "OverLimit",
        "AccessDenied",
        "AccessDeniedException",
        "Forbidden",
        "InvalidAccessKeyId",
        "ExpiredToken",
        "ExpiredTokenException",
        "SignatureDoesNotMatch",
        "RequestTimeTooSkewed",
    }
)
TRANSIENT_STATUS = frozenset({403, 408, 409, 429})


def _client_fault(exc: ClientError) -> Fault:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    if code in TRANSIENT_CODES or status in TRANSIENT_STATUS or status >= 500:
        return Fault.QUEUE if exc.operation_name in SQS_OPERATIONS else Fault.STORE
    return Fault.WORK


def classify(exc: BaseException) -> Fault:
    """The fault of a failed receive (see the module doc), following what it was raised from:
    a ``JobFailed`` raised from an S3 error is the store's."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(fault := getattr(current, "fault", None), Fault):
            return fault
        if isinstance(current, ClientError):
            fault = _client_fault(current)
            if fault is not Fault.WORK:
                return fault
        elif isinstance(
            current,
            HTTPClientError
            | BotoConnectionError
            | IncompleteReadError
            | aiohttp.ClientError
            | ConnectionError
            | asyncio.TimeoutError,
        ):
            return Fault.STORE
        current = current.__cause__
    return Fault.WORK


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
