"""Where each task of a hung run is waiting: the chain of awaits down to the future it is parked on,
for the message of a test that timed out (``Task.print_stack`` shows only a suspended task's top
frame)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


def awaiting(task: asyncio.Task[Any]) -> str:
    """``task``'s name and its await chain, one ``file:line in function`` per step."""
    steps = []
    node: Any = task.get_coro()
    for _ in range(64):
        frame = getattr(node, "cr_frame", None) or getattr(node, "gi_frame", None)
        if frame is None:
            if node is not None:
                steps.append(f"    on {type(node).__name__}: {node!r:.160}")
            break
        code = frame.f_code
        steps.append(f"    {code.co_filename}:{frame.f_lineno} in {code.co_name}")
        node = getattr(node, "cr_await", None) or getattr(node, "gi_yieldfrom", None)
    return "\n".join([f"  task {task.get_name()}:", *steps])


def where_they_wait(tasks: Iterable[asyncio.Task[Any]]) -> str:
    return "\n".join(awaiting(t) for t in tasks if not t.done())
