"""What the fan-out's fault tests share: a fleet behind the fault proxy run on a few jobs until
they finish, rules that pick which requests a fault hits, and an engine that raises on poison."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tests.aws import aws_clients, list_keys
from tests.fakes import FakeEngine, decision_line
from tests.faults.fleet import Fleet
from tests.faults.invariants import Job, records_may_repeat, single_path_records, violations
from tests.faults.proxy import Call
from tests.worker.fanout_support import fanout_settings, pending
from worker.outputs import output_keys
from worker.settings import WorkerSettings
from worker.stack import ensure_stack


class PoisonEngine(FakeEngine):
    """Raises on any batch that holds a decision whose state is ``POISON``."""

    def score(self, decisions: Any) -> Any:
        if any(d.state == "POISON" for d in decisions):
            raise RuntimeError("this engine cannot score poison")
        return super().score(decisions)


def fault_settings(endpoint: str, **kw: Any) -> WorkerSettings:
    base = {"shard_lines": 4, "visibility_timeout_s": 2, "heartbeat_s": 0.5, **kw}
    return fanout_settings(endpoint, **base)


def numbered_body(n: int, states: list[str] | None = None) -> bytes:
    states = states or [f"S{i}" for i in range(n)]
    return "\n".join(decision_line(i, state=states[i]) for i in range(n)).encode()


async def versioned_stack(s3: Any, sqs: Any, settings: WorkerSettings) -> dict[str, str]:
    stack = await ensure_stack(s3, sqs, settings)
    await s3.put_bucket_versioning(Bucket="jobs", VersioningConfiguration={"Status": "Enabled"})
    return stack


async def drop(
    s3: Any, settings: WorkerSettings, key: str, body: bytes, engine: Any = None, **put: Any
) -> Job:
    answer = await s3.put_object(Bucket="jobs", Key=key, Body=body, **put)
    expected, numbers = await single_path_records(key, body, settings, engine or FakeEngine())
    return Job(key, answer["ETag"].strip('"'), body, expected, numbers)


def finished(
    s3: Any, sqs: Any, stack: dict[str, str], settings: WorkerSettings, jobs: list[Job]
) -> Callable[[], Any]:
    async def done() -> bool:
        for job in jobs:
            summary = output_keys(settings, job.key, job.etag).summary
            if summary not in await list_keys(s3, "jobs", summary):
                return False
        return not await pending(sqs, stack["queue_url"])

    return done


class Rule:
    """``action`` for the first ``times`` calls that ``match``; forward otherwise."""

    def __init__(self, match: Callable[[Call], bool], action: str, times: int = 1) -> None:
        self.match, self.action, self.times, self.hits = match, action, times, 0

    def __call__(self, call: Call) -> str:
        if self.hits < self.times and self.match(call):
            self.hits += 1
            return self.action
        return "forward"


class OncePerKey(Rule):
    """``action`` on the first call to each key that ``match``es (its resend goes through)."""

    def __init__(self, match: Callable[[Call], bool], action: str) -> None:
        super().__init__(match, action, times=10**6)
        self.seen: set[str] = set()

    def __call__(self, call: Call) -> str:
        if call.key in self.seen or not self.match(call):
            return "forward"
        self.seen.add(call.key)
        self.hits += 1
        return self.action


def rules(*each: Rule) -> Callable[[Call], str]:
    def decide(call: Call) -> str:
        for rule in each:
            action = rule(call)
            if action != "forward":
                return action
        return "forward"

    return decide


def holding(call: Call, kind: str) -> bool:
    """The worker holds a message of ``kind`` (shard, merge or job)."""
    if call.held is None:
        return False
    body = json.loads(call.held.body)
    found = "shard" if "arbiter_shard" in body else "merge" if "arbiter_merge" in body else "job"
    return found == kind


async def run_fleet(
    endpoint: str,
    settings: WorkerSettings,
    decide: Callable[[Call], str],
    bodies: dict[str, bytes],
    workers: int = 2,
    engine: Callable[[int], Any] = lambda n: FakeEngine(),
    within_s: float = 90,
) -> tuple[list[str], list[Job], Fleet]:
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        jobs = [await drop(s3, settings, k, b, engine(-1)) for k, b in bodies.items()]
        async with Fleet(endpoint, settings, decide, workers, engine) as fleet:
            await fleet.run_until(finished(s3, sqs, stack, settings, jobs), within_s)
        again = records_may_repeat(fleet.proxy.log, settings.dlq_name)
        found = await violations(s3, sqs, stack, settings, jobs, fleet.dead_letters, again)
        return found, jobs, fleet
