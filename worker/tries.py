"""How many tries a message has, and which of them a receive is: the one policy every step reads.

**Tries.** The worker allows a message ``ARBITER_MAX_RECEIVE_COUNT`` receives (its *tries*); the
queue's redrive policy allows :data:`REDRIVE_MARGIN` more, so the worker always sees the receive
after a message's last try, even when that try died with its worker (SIGKILL, OOM, an abort in
llama.cpp, a stopped task). A receive count also grows when SQS shows a message again while a slow
holder still works on it (a second delivery; a lapsed visibility), and that holder may yet finish:
a shard message's first receive past the tries leaves the message to it (not deleted: that would
end its lease and its work) and the next one fails a shard that still has no outcome, without
running it, so its job still finishes; a job message gets one last look after a delay and is
dead-lettered if its job has neither a summary nor a manifest by then. Only a message that outlives
even the margin (every receive failing before the worker can answer it) is moved by SQS's redrive.

**What counts.** A receive's number is SQS's ``ApproximateReceiveCount`` plus the failed receives
its message carried over from before a release (:data:`FAILED_RECEIVES`), less the receives of it
that met a queue fault (:mod:`worker.uncounted`: recorded in the job's folder, read only once the
number reaches the tries). Only a failure of the work itself (:class:`worker.faults.Fault`) is let
count: a receive that failed on a store or queue fault, an end-of-job race, or that was released at
a drain deadline, is given back as a new message that carries the count it had (so the receive is
not counted, and SQS's redrive, which counts the message's own receives, never sees an outage), its
count of such receives (:data:`OUTAGES`, for the backoff) and the outage's clock.

**The outage clock** measures the outage, not the wait: :data:`OUTAGE_S` is the time between the
message's faults, each gap counted only up to the delay it was given back with plus ``lag_s`` (a
free worker's longest wait before it receives: a breaker's probe delay and a long poll), and
:data:`OUTAGE_LAST` when the last one was. A message that waited in a backlog for an hour between
two 503 bursts has met an outage of seconds, not an hour (counting the wait would fail a shard
past ``ARBITER_MAX_OUTAGE_S`` at the next burst on a healthy store). A message failing on
nothing but outages for longer than ``ARBITER_MAX_OUTAGE_S`` is given up, loudly, before SQS's
retention would drop it silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from worker.events import Ignored, Ref, UnreadableMessage, parse_message
from worker.policies import ExponentialBackoff

REDRIVE_MARGIN = 3  # receives the queue's redrive allows beyond the worker's own tries
SQS_MAX_DELAY_S = 900  # SendMessage's DelaySeconds limit

FAILED_RECEIVES = "ArbiterFailedReceives"  # counted receives before a release
LAST_LOOK = "ArbiterLastLook"  # a job out of tries, given one more look
OUTAGES = "ArbiterOutages"  # receives given back for a store, queue or race fault (not counted)
OUTAGE_S = "ArbiterOutageSeconds"  # the outage's length as the message met it (see the doc)
OUTAGE_LAST = "ArbiterOutageLast"  # epoch seconds of the message's last store or queue fault
OUTAGE_SINCE = "ArbiterOutageSince"  # older workers' first fault (read as the last one)
ATTRIBUTES = [FAILED_RECEIVES, LAST_LOOK, OUTAGES, OUTAGE_S, OUTAGE_LAST, OUTAGE_SINCE]


def _number(message: dict[str, Any], name: str) -> float | None:
    raw = message.get("MessageAttributes", {}).get(name, {}).get("StringValue")
    with contextlib.suppress(TypeError, ValueError):
        return float(raw)
    return None


@dataclass(frozen=True)
class Receive:
    """One receive of a message: the message as SQS gave it, its body parsed once
    (:meth:`read`), and its number as the tries count it. The one object the handler, the
    uncounted records, the dispatch, the answers and the fan-out are handed (the fan-out reads its
    number and, for a give-up decided before it runs, its reason)."""

    count: int  # its number among the message's counted tries
    outages: int = 0  # earlier receives given back for a fault not the work's
    outage_s: float = 0.0  # the outage's length so far, as the message met it
    outage_last: float | None = None  # when its last store or queue fault was
    last_look: bool = False
    raw: int = 1  # SQS's ApproximateReceiveCount: this receive of this message
    message_id: str | None = None  # stable across redeliveries
    reason: str | None = None  # why the tries ended, where the worker gave them up itself
    message: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    entries: tuple[Ref | Ignored, ...] = ()  # what its body announces (:meth:`read`)
    unreadable: str | None = None  # why its body is no message the worker reads

    @classmethod
    def read(cls, message: dict[str, Any], *, bucket: str, input_prefix: str) -> Receive:
        """This receive of ``message``, its body parsed (the only parse of it)."""
        receive = cls.of(message)
        try:
            entries = parse_message(message["Body"], bucket=bucket, input_prefix=input_prefix)
        except UnreadableMessage as exc:
            return dataclasses.replace(receive, unreadable=str(exc))
        return dataclasses.replace(receive, entries=tuple(entries))

    @property
    def refs(self) -> list[Ref]:
        """The jobs, shards and merges the message announces (its ignored entries left out)."""
        return [e for e in self.entries if not isinstance(e, Ignored)]

    @classmethod
    def of(cls, message: dict[str, Any]) -> Receive:
        """This receive's number alone, its body not read."""
        raw = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
        count = raw + max(0, int(_number(message, FAILED_RECEIVES) or 0))
        last = _number(message, OUTAGE_LAST)
        return cls(
            count=count,
            outages=max(0, int(_number(message, OUTAGES) or 0)),
            outage_s=max(0.0, _number(message, OUTAGE_S) or 0.0),
            outage_last=last if last is not None else _number(message, OUTAGE_SINCE),
            last_look=LAST_LOOK in message.get("MessageAttributes", {}),
            raw=raw,
            message_id=message.get("MessageId"),
            message=message,
        )


def _attribute(value: str, kind: str = "Number") -> dict[str, str]:
    return {"DataType": kind, "StringValue": value}


@dataclass(frozen=True)
class Tries:
    """The worker's tries on its queue (see the module doc): ``own`` is
    ``ARBITER_MAX_RECEIVE_COUNT``, ``redrive`` the queue's ``maxReceiveCount`` (None: no DLQ)."""

    own: int
    redrive: int | None = None
    backoff: ExponentialBackoff = field(default_factory=ExponentialBackoff)
    max_outage_s: float = 86_400.0
    lag_s: float = 50.0  # a free worker's longest wait before it receives (probe delay + poll)

    @property
    def limit(self) -> int:
        """The receives the worker allows a message: its own limit, lowered if the queue's redrive
        would move a message before the worker saw the receive after its last try."""
        if self.redrive is None:
            return self.own
        return max(1, min(self.own, self.redrive - REDRIVE_MARGIN))

    @property
    def too_tight(self) -> bool:
        """The queue's redrive lowered the worker's own tries."""
        return self.limit < self.own

    def last(self, count: int) -> bool:
        """This receive is the message's last try (a failure of its work gives it up)."""
        return count >= self.limit

    def past(self, count: int) -> bool:
        """The message's last try ended without an answer (it died with its worker)."""
        return count > self.limit

    def first_past(self, count: int) -> bool:
        """The first receive past the tries: its last try may still run (a second delivery)."""
        return count == self.limit + 1

    def retry_delay(self, receive: Receive) -> int:
        """Visibility delay after a counted failure."""
        return self.backoff.delay(receive.count)

    def outage_delay(self, receive: Receive) -> int:
        """Delay of the copy of a message that failed on a store or queue fault: the backoff of
        its outages, within SendMessage's 15-minute limit."""
        return min(SQS_MAX_DELAY_S, self.backoff.delay(receive.outages + 1))

    def outage_s(self, receive: Receive, now: float | None = None) -> float:
        """The outage's length as the message has met it, a fault now included: each gap since
        its last fault counted up to the delay it was given back with plus ``lag_s`` (see the
        module doc)."""
        if receive.outage_last is None:
            return receive.outage_s
        gap = max(0.0, (time.time() if now is None else now) - receive.outage_last)
        given = min(SQS_MAX_DELAY_S, self.backoff.delay(receive.outages))
        return receive.outage_s + min(gap, given + self.lag_s)

    def outage_over(self, receive: Receive, now: float | None = None) -> bool:
        """The message has failed on outages alone for longer than ``max_outage_s``."""
        return self.outage_s(receive, now) > self.max_outage_s

    def carried(
        self,
        receive: Receive,
        outage: bool = False,
        last_look: bool = False,
        busy: bool = False,
        now: float | None = None,
    ) -> dict[str, dict[str, str]]:
        """The attributes of a message given back as a new one, this receive not counted:
        ``outage``, it failed on a store or queue fault (the clock runs); ``busy``, on an
        end-of-job race (only the backoff grows); ``last_look``, it is a job's last look (carried
        by any later copy)."""
        attributes = {FAILED_RECEIVES: _attribute(str(receive.count - 1))}
        outages, seconds, last = receive.outages, receive.outage_s, receive.outage_last
        if outage or busy:
            outages += 1
        if outage:
            now = time.time() if now is None else now
            seconds, last = self.outage_s(receive, now), now
        if outages:
            attributes[OUTAGES] = _attribute(str(outages))
        if last is not None:
            attributes[OUTAGE_S] = _attribute(f"{seconds:.1f}")
            attributes[OUTAGE_LAST] = _attribute(f"{last:.1f}")
        if last_look or receive.last_look:
            attributes[LAST_LOOK] = _attribute("1", "String")
        return attributes
