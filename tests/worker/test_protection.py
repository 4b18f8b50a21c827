"""ECS task scale-in protection (worker/protection.py): the policy against a fake ECS agent, then a
real `arbiter work` pool that protects its task while a worker holds a message and clears it once
idle."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.aws import aws_clients, list_keys
from tests.fakes import decision_line
from tests.worker import test_pool
from tests.worker.test_pool import WORK, stack_settings, worker_env
from worker.metrics import WorkerMetrics
from worker.protection import PATH, Bounds, TaskProtection
from worker.stack import ensure_stack


class FakeAgent:
    """The ECS agent's task-protection endpoint on loopback, in a thread of its own (the pool
    tests block their event loop while they wait); records every PUT body."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.answer: tuple[int, dict[str, Any]] | None = None  # set to make it refuse
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == PATH
                agent.calls.append(body)
                status, answer = agent.answer or (200, {"protection": {**body, "TaskArn": "t"}})
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def enabled(self) -> list[bool]:
        return [call["ProtectionEnabled"] for call in self.calls]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    fake = FakeAgent()
    yield fake
    fake.close()


spawn = test_pool.spawn  # its fixture: the processes a test starts are killed at its end


def protection(
    agent: FakeAgent, minutes: int = 60, idle_s: float = 30, **bounds: float
) -> TaskProtection:
    metrics = WorkerMetrics(CollectorRegistry())
    return TaskProtection(agent.uri, metrics, Bounds(minutes, idle_s, **bounds))


async def test_busy_protects_once_renews_at_half_and_idle_clears_after_the_grace(agent):
    guard = protection(agent, minutes=10, idle_s=30)
    await guard.update(True, now=0)
    assert agent.calls == [{"ProtectionEnabled": True, "ExpiresInMinutes": 10}]
    await guard.update(False, now=100)  # idle, but not for the 30 s grace
    await guard.update(False, now=129)
    await guard.update(True, now=130)  # busy again within the grace: still protected
    await guard.update(True, now=299)
    assert agent.enabled() == [True]
    await guard.update(True, now=300)  # half of the 10 minutes: renewed
    assert agent.enabled() == [True, True]
    await guard.update(False, now=310)
    await guard.update(False, now=339)
    assert agent.enabled() == [True, True]
    await guard.update(False, now=340)  # idle for the grace: cleared
    await guard.update(False, now=900)  # cleared already: no call
    assert agent.enabled() == [True, True, False]


async def test_a_busy_task_is_protected_for_a_window_then_rests_so_a_deployment_gets_in(agent):
    """Issue 36: a task busy through a whole backlog held a new task definition off until the
    backlog drained. One busy stretch is protected for the window at most, then the protection is
    cleared for the rest however busy the task stays, then asked again for a new window."""
    guard = protection(agent, minutes=10, window_s=900, rest_s=120)
    for now in range(0, 900, 60):  # busy all along, renewed at half of the 10 minutes
        await guard.update(True, now=now)
    assert agent.enabled() == [True, True, True]
    await guard.update(True, now=900)  # the window is over: cleared while still busy
    assert agent.enabled() == [True, True, True, False] and guard.protected_until is None
    for now in range(901, 1020, 10):  # resting: a deployment waiting on the task may stop it
        await guard.update(True, now=now)
    assert agent.enabled()[-1] is False and len(agent.calls) == 4
    await guard.update(True, now=1020)  # rested: protected again, for a new window
    assert agent.enabled() == [True, True, True, False, True]
    await guard.update(True, now=1919)
    assert len(agent.calls) == 6  # one renewal at 1320
    await guard.update(True, now=1920)
    assert agent.enabled()[-1] is False
    await guard.update(False, now=1930)  # idle after a window: nothing more to clear
    await guard.update(False, now=2000)
    assert len(agent.calls) == 7


async def test_a_refused_or_failed_call_is_counted_and_asked_again_later(agent):
    guard = protection(agent)
    agent.answer = (200, {"failure": {"Arn": "t", "Reason": "TASK_NOT_VALID"}})
    await guard.update(True, now=0)
    await guard.update(True, now=29)  # not asked again at once: the agent is not spammed
    assert agent.enabled() == [True]
    agent.answer = (400, {"error": {"Code": "AccessDeniedException", "Message": "no"}})
    await guard.update(True, now=30)
    assert guard.protected_until is None
    assert guard.metrics.task_protection_errors._value.get() == 2
    agent.answer = None
    await guard.update(True, now=60)  # asked again once the wait is over, and kept
    assert agent.enabled() == [True, True, True] and guard.protected_until is not None
    assert guard.metrics.task_protected._value.get() == 1

    gone = TaskProtection("http://127.0.0.1:9", WorkerMetrics(CollectorRegistry()), Bounds(60, 30))
    await gone.update(True, now=0)  # no agent listening: logged and counted, never raised
    assert gone.metrics.task_protection_errors._value.get() == 1


async def test_the_pool_protects_its_task_while_a_worker_holds_a_message(endpoint, agent, spawn):
    """Three jobs of 1 s each on one worker: protected at the first, kept between them (the gaps
    are shorter than the grace), cleared once the worker has been idle for the grace."""
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, stack_settings(endpoint))
        env = worker_env(
            endpoint,
            ECS_AGENT_URI=agent.uri,
            ARBITER_TASK_PROTECTION_IDLE_S=2,
            ARBITER_TASK_PROTECTION_MINUTES=5,
            ARBITER_FAKE_DELAY_S=1,
        )
        pool = spawn(WORK, env)
        pool.wait_event("worker.ready")
        assert agent.calls == []  # idle from the start: nothing asked
        for i in range(3):
            await s3.put_object(
                Bucket="jobs", Key=f"incoming/p{i}.jsonl", Body=decision_line(i).encode()
            )
        pool.wait_event("job.started")
        pool.wait_event("pool.task_protection", count=1, within_s=10)
        assert agent.calls == [{"ProtectionEnabled": True, "ExpiresInMinutes": 5}]
        pool.wait_event("job.finished", count=3, within_s=60)
        assert agent.enabled() == [True]  # not cleared between the jobs
        pool.wait_event("pool.task_protection", count=2, within_s=15)
        assert agent.enabled() == [True, False]
        assert len(await list_keys(s3, "jobs", "results/")) == 6


async def test_without_the_agent_the_pool_asks_nothing(endpoint, agent, spawn):
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, stack_settings(endpoint))
        env = worker_env(endpoint, ARBITER_TASK_PROTECTION="false", ECS_AGENT_URI=agent.uri)
        pool = spawn(WORK, env)
        pool.wait_event("worker.ready")
        await s3.put_object(Bucket="jobs", Key="incoming/n.jsonl", Body=decision_line(0).encode())
        pool.wait_event("job.finished")
    assert agent.calls == [] and not pool.events("pool.task_protection")
