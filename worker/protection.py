"""ECS task scale-in protection: the tasks a scale-in stops are the idle ones.

The stack scales the worker service in by its idle tasks while a job's tail still runs
(``WorkerScaleIn`` in ``infra/cloudformation/serving.yaml``). ECS chooses the tasks it stops among
the unprotected ones, so a task protects itself while any of its worker processes holds a message
and clears the protection once all of them have been idle for ``task_protection_idle_s`` (a
worker between two messages of the same backlog stays protected). Without it, a scale-in could stop
a task two minutes into a four-minute shard: the message would come back (SIGTERM releases it),
but the work would be paid twice.

The task is one for all its processes, so the pool process alone calls the ECS agent
(``$ECS_AGENT_URI/task-protection/v1/state``); each worker marks its own slot of a shared array
while it holds a message (:class:`InHand`). The protection is asked for ``task_protection_minutes``
and renewed at half of that while held, so a pool that dies protected is free again within that
time. A refused or failed call is logged and counted, never fatal: an unprotected task still
drains its message on SIGTERM, so nothing is lost, only repeated.

A protection is bounded: ECS does not stop a protected task for a deployment either,
and a task busy through a whole backlog would hold a new task definition off until the backlog
drained (``arbiter deploy`` waits at most an hour). So one busy stretch is protected for at most
``window_s`` (``ARBITER_TASK_PROTECTION_WINDOW_MINUTES``, 15); then the protection is cleared and
not asked again for ``rest_s`` (``ARBITER_TASK_PROTECTION_REST_S``, 120 s) however busy the task
is, which is when a deployment waiting on it (or a scale-in) may stop it: its SIGTERM drains the
messages in hand, whose work is repeated elsewhere. A deployment thus waits at most the window
and the rest for a busy task, not the backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

log = structlog.get_logger("arbiter.pool")

PATH = "/task-protection/v1/state"


class InHand:
    """One worker process's slot in the pool's shared array: 1 while it holds a message."""

    def __init__(self, slots: Any, index: int) -> None:
        self.slots, self.index = slots, index

    def __call__(self, holding: bool) -> None:
        self.slots[self.index] = 1 if holding else 0


class ProtectionRefused(Exception):
    """The agent answered, but did not set the protection (its ``failure`` or ``error``)."""


@dataclass(frozen=True)
class Bounds:
    """How long a protection is asked for (``minutes``), how long the task may be idle before it
    is cleared, how long one busy stretch is protected at most and the rest after it (see the
    module doc), and the agent call's timeout and the wait after a failed one."""

    minutes: int
    idle_s: float
    window_s: float = 900.0
    rest_s: float = 120.0
    timeout_s: float = 5.0
    retry_s: float = 30.0


class TaskProtection:
    """Keeps the task protected while :meth:`update` is told it is busy; see the module doc."""

    def __init__(self, agent_uri: str, metrics: Any, bounds: Bounds) -> None:
        self.url = agent_uri.rstrip("/") + PATH
        self.minutes, self.idle_s, self.metrics = bounds.minutes, bounds.idle_s, metrics
        self.window_s, self.rest_s = bounds.window_s, bounds.rest_s
        timeout_s, retry_s = bounds.timeout_s, bounds.retry_s
        self.since: float | None = None  # when the protection now held was set (its window's start)
        self.rest_until = 0.0  # after a window, not protected again before this
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        # Monotonic; None: not protected, as far as this process knows.
        self.protected_until: float | None = None
        self.idle_since: float | None = None
        self.retry_s, self.quiet_until = retry_s, 0.0  # after a failed call, not again for a while

    async def update(self, busy: bool, now: float | None = None) -> None:
        """Protect (or renew) when busy, for at most ``window_s`` at a stretch and then not for
        ``rest_s``; clear once idle for ``idle_s``."""
        now = time.monotonic() if now is None else now
        self.idle_since = None if busy else (now if self.idle_since is None else self.idle_since)
        if now < self.quiet_until:
            return
        if busy and self.since is not None and now - self.since >= self.window_s:
            want: bool | None = False  # the window is over: let a deployment in
        elif busy and now < self.rest_until:
            return  # resting after a window
        elif busy:  # protect, or renew once half of the protection has run
            renew_at = (
                None if self.protected_until is None else self.protected_until - self.minutes * 30
            )
            want = True if renew_at is None or now >= renew_at else None
        else:  # clear, once idle for the grace
            graced = self.idle_since is not None and now - self.idle_since >= self.idle_s
            want = False if self.protected_until is not None and graced else None
        if want is None:
            return
        if await self._put(want):
            self.protected_until = now + self.minutes * 60 if want else None
            if not want or self.since is None:
                self.since = now if want else None
            if not want and busy:
                self.rest_until = now + self.rest_s
                log.info("pool.task_protection_rest", window_s=self.window_s, rest_s=self.rest_s)
        else:
            self.quiet_until = now + self.retry_s

    async def run(self, busy: Any, stopping: asyncio.Event, every_s: float = 1.0) -> None:
        """Call :meth:`update` every ``every_s`` with ``busy()`` until ``stopping`` is set."""
        while not stopping.is_set():
            await self.update(bool(busy()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=every_s)

    async def _put(self, enabled: bool) -> bool:
        body: dict[str, Any] = {"ProtectionEnabled": enabled}
        if enabled:
            body["ExpiresInMinutes"] = self.minutes
        try:
            async with (
                aiohttp.ClientSession(timeout=self.timeout) as session,
                session.put(self.url, json=body) as response,
            ):
                answer = await response.json(content_type=None)
                if response.status != 200 or not isinstance(answer, dict):
                    raise ProtectionRefused(f"HTTP {response.status}: {answer!r}")
                refused = answer.get("failure") or answer.get("error")
                if refused or "protection" not in answer:
                    raise ProtectionRefused(repr(refused or answer))
        except (aiohttp.ClientError, TimeoutError, ValueError, ProtectionRefused) as exc:
            self.metrics.task_protection_errors.inc()
            log.warning(
                "pool.task_protection_failed",
                enabled=enabled,
                reason=str(exc) or type(exc).__name__,
                hint="the task role needs ecs:UpdateTaskProtection on its own task",
            )
            return False
        self.metrics.task_protected.set(1 if enabled else 0)
        log.info("pool.task_protection", enabled=enabled, minutes=self.minutes if enabled else None)
        return True
