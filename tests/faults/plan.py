"""What a campaign seed (tests/faults/campaign.py) does to its fleet's requests: the plan decides
each request from the seed, the worker and that worker's request number, so it replays exactly.

Besides lost answers, refused requests, faked deletes, duplicated sends, second deliveries, kills
and 409s, a seed may have an outage (:class:`Window`, issue 36): of the whole store or the whole
queue, or a partial one the breaker's probe does not see (every GET of a shard input, every GET,
every conditional write, every upload of records: some operations or keys failing while the
probe's LIST passes, as ``SlowDown`` on a hot prefix), lasting 3 to 12 s or flapping (down 1 to 3
s, up 1 to 2 s, 3 to 5 times), from 0.2 to 2 s after the first read of an input. A seed whose
queue goes down has shards that outlive their visibility (a slow engine) and, with two workers or
more, one try; most partial outages allow two (and their engine is slowed so the work meets the
outage): so a receive wrongly counted fails a shard. A seed may also drop a sealed job, whose input
the role may not read: it must be rejected with its record, never held as an outage.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.faults.proxy import Call

TRIES = 4  # the workers' own tries in most seeds; the redrive allows 3 more
CAPS = {
    "lose_response": 10,
    "fail_503": 6,
    "fail_500": 6,
    "fake_delete": 5,
    "duplicate": 5,
    "conflict_409": 6,
}
KILLS = ["kill_before", "kill_after", "kill_during"]
HITS: dict[str, Callable[[Call], bool]] = {
    "s3": lambda c: c.service == "s3",
    "sqs": lambda c: c.service == "sqs",
    "shard-inputs": lambda c: c.op == "GetObject" and "/in/" in c.key,
    "reads": lambda c: c.op == "GetObject",
    "conditional": lambda c: c.service == "s3" and c.write and c.conditional,
    "records": lambda c: c.op in ("PutObject", "UploadPart") and "/out/" in c.key,
}
PARTIAL = ("shard-inputs", "reads", "conditional", "records")


@dataclass(frozen=True)
class Window:
    """An outage: every request that ``hits`` (:data:`HITS`) answered 503 from ``start_s`` after
    the first read of an input (so that it meets the work, which small jobs finish in seconds)
    for ``length_s``, down and up by ``flap`` (down, up) seconds when given."""

    hits: str
    start_s: float
    length_s: float
    flap: tuple[float, float] | None = None

    @classmethod
    def pick(cls, r: random.Random) -> Window:
        roll = r.random()  # a whole outage, a partial one, or one that flaps
        hits = r.choice(["s3", "s3", "sqs"]) if roll < 0.35 else r.choice(["sqs", *PARTIAL])
        if roll < 0.7:
            return cls(hits, r.uniform(0.2, 2.0), r.uniform(3.0, 12.0))
        flap = (r.uniform(1.0, 3.0), r.uniform(1.0, 2.0))
        return cls(hits, r.uniform(0.2, 1.5), sum(flap) * r.randint(3, 5), flap)

    def cycle(self, since: float) -> int | None:
        """The down period ``since`` s after the drop falls in (0, 1, ...), or None if up."""
        t = since - self.start_s
        if not 0 <= t < self.length_s:
            return None
        if self.flap is None:
            return 0
        period = sum(self.flap)
        return int(t // period) if t % period < self.flap[0] else None


@dataclass
class Plan:
    """A seed's faults (see the module doc): ``__call__`` decides each request."""

    seed: int
    p: dict[str, float]
    kills: dict[tuple[int, int], str]
    forbid: bool
    exhaust: int | None  # a shard index whose every try is killed
    outage: Window | None = None
    sealed: str | None = None  # the key of a job whose input the role may not read
    tries: int = TRIES
    anchor: str = "reads"  # the outage's clock starts at the first request of these (HITS)
    anchored: float | None = None  # when it did
    counts: Counter[str] = field(default_factory=Counter)
    copies: int = 0  # UploadPartCopy requests: merges of several parts copied inside S3
    began: float | None = None  # when the jobs were dropped (the anchor is looked for from then)
    # Receives each worker handled while the whole store was down, by down period: with the
    # breaker, the one in hand and at most one received before its first fault.
    held_in_outage: dict[tuple[int, int], set[str]] = field(default_factory=dict)

    @classmethod
    def pick(cls, r: random.Random, seed: int, workers: int) -> Plan:
        p = {
            "lose_response": r.choice([0, 0.03, 0.08]),
            "fail": r.choice([0, 0.03, 0.06]),
            "fake_delete": r.choice([0, 0.15, 0.3]),
            "duplicate": r.choice([0, 0.15, 0.3]),
            "redeliver": r.choice([0, 0, 0.1]) if workers > 1 else 0,
            "conflict": r.choice([0, 0, 0.05, 0.1]),
        }
        kills = {
            (r.randrange(workers + 2), r.randint(3, 80)): r.choice(KILLS)
            for _ in range(r.choice([0, 1, 1, 2]))
        }
        exhaust = r.randrange(3) if r.random() < 0.15 else None
        outage = Window.pick(r) if r.random() < 0.3 else None
        plan = cls(seed, p, kills, r.random() < 0.25, exhaust, outage)
        if workers > 1 and r.random() < 0.1:
            # One try, four workers (tests/faults/campaign.py) and SQS flapping faster than the
            # shards run, so that a free worker receives a message whose lease the outage took
            # while its holder still scores it. A
            # kill, a second delivery or a shard killed on purpose would each fail a shard for
            # good, so this seed has none of them; only the outage may count (it must not).
            # The outage's clock starts at the first read of a shard input: shards are in hand.
            flap = (r.uniform(2.5, 3.5), r.uniform(1.0, 2.0))
            plan.outage = Window("sqs", r.uniform(0.3, 1.0), sum(flap) * r.randint(3, 5), flap)
            plan.tries, plan.kills, plan.exhaust, plan.p["redeliver"] = 1, {}, None, 0
            plan.anchor = "shard-inputs"
        elif outage is not None and outage.hits in PARTIAL and r.random() < 0.6:
            # Two tries through a partial outage (the probe passes, so receives go on failing):
            # a store fault counted twice fails a shard. At most one kill, no second delivery,
            # no shard killed on purpose (each of its kills also spends a try of whatever else
            # its worker holds: seed 2, loaded, failed shard 0 that way).
            plan.tries, plan.p["redeliver"], plan.exhaust = 2, 0, None
            plan.kills = dict(list(kills.items())[:1])
        elif r.random() < 0.12:
            # No kills: one that lands on a receive of the sealed job (or on a worker holding it)
            # spends a try that never read the input, and the job is dead-lettered past its tries
            # without its rejection (seed 7, loaded, waited for it to the deadline).
            plan.sealed = f"incoming/sealed-{seed}.jsonl"
            plan.kills, plan.exhaust = {}, None
        return plan

    @property
    def slow(self) -> bool:
        """Shards outlive their visibility (the queue goes down while they are in hand)."""
        return self.outage is not None and self.outage.hits == "sqs"

    def _down(self, call: Call) -> bool:
        """Whether ``call`` falls in the seed's outage."""
        if self.anchored is None and self.began is not None and HITS[self.anchor](call):
            self.anchored = time.monotonic()
        if self.outage is None or self.anchored is None or not HITS[self.outage.hits](call):
            return False
        cycle = self.outage.cycle(time.monotonic() - self.anchored)
        if cycle is not None and self.outage.hits == "s3" and call.held is not None:
            held = self.held_in_outage.setdefault((call.worker, cycle), set())
            held.add(call.held.receipt)
        return cycle is not None

    def breaker_violations(self) -> list[str]:
        """Workers that went on taking messages while the whole store was down."""
        return [
            f"worker {worker} handled {len(held)} receives in one store outage (the breaker "
            "lets it take none after its first failure)"
            for (worker, _), held in sorted(self.held_in_outage.items())
            if len(held) > 3
        ]

    def _capped(self, action: str) -> str:
        if self.counts[action] >= CAPS.get(action, 3):
            return "forward"
        self.counts[action] += 1
        return action

    def __call__(self, call: Call) -> str:
        self.copies += call.op == "UploadPartCopy"
        if (kill := self.kills.pop((call.worker, call.number), None)) is not None:
            return kill
        if self.exhaust is not None and call.op == "GetObject" and "/in/" in call.key:
            held = call.held
            body = json.loads(held.body) if held else {}
            if body.get("index") == self.exhaust and held and held.receive_count <= self.tries:
                return "kill_before"
        if self.sealed is not None and call.op == "GetObject" and call.key == self.sealed:
            return "deny"
        if self._down(call):
            self.counts["outage"] += 1
            return "fail_503"
        if self.forbid and call.op in ("GetObject", "HeadObject"):
            return "forbid_missing"
        roll = random.Random(f"{self.seed}/{call.worker}/{call.number}").random()
        if call.write and roll < self.p["lose_response"]:
            return self._capped("lose_response")
        roll = random.Random(f"{self.seed}/{call.worker}/{call.number}/409").random()
        if call.write and call.conditional and roll < self.p["conflict"]:
            return self._capped("conflict_409")
        roll = random.Random(f"{self.seed}/{call.worker}/{call.number}/fail").random()
        if roll < self.p["fail"]:
            return self._capped("fail_503" if roll < self.p["fail"] / 2 else "fail_500")
        roll = random.Random(f"{self.seed}/{call.worker}/{call.number}/sqs").random()
        if call.op in ("DeleteMessage", "DeleteMessageBatch") and roll < self.p["fake_delete"]:
            return self._capped("fake_delete")
        if call.op in ("SendMessage", "SendMessageBatch") and roll < self.p["duplicate"]:
            return self._capped("duplicate")
        if call.op == "ReceiveMessage" and roll < self.p["redeliver"]:
            return self._capped("redeliver")
        return "forward"
