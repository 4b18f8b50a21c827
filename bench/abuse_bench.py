"""`arbiter bench abuse`: what abusive requests cost the others, on a local `arbiter serve`.

Every figure is a ratio against a baseline measured in the same run, on the real model with the
default settings (one request computing at a time):

1. A decision's latency idle, then sent together with ``--chats`` parallel 5 MB chat messages
   (each refused from its bytes before admission, a 400 as OpenAI's routes answer): the p50 over
   the idle p50 (target <= 1.5). Then
   while as many clients post 5 MB chats back to back (reported, no target: on a small machine the
   benchmark's own clients and the bytes they move compete with the model for the CPUs).
2. A 5 MB state, and a 6 MB ``decisions`` body of 256 long prompts: the time to their 422 and 413,
   over one decision's time (target: milliseconds, a small fraction of one decision).
3. A 256-decision request whose client disconnects mid-run: the time from the disconnect until no
   request holds a slot (``arbiter_in_flight`` on /metrics), over one decision's time (target <= 1),
   and a probe decision's numbers before and after (must be equal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import aiohttp

from bench.figures import Progress, check, paired, verdict
from bench.served import Served, metric, served

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {"repeats": 3, "chats": 1, "disconnect_after_s": 1.0}

MB = 1024 * 1024
JSON = {"Content-Type": "application/json"}
OPTIONS = [
    {"id": "billing", "description": "Billing and invoices"},
    {"id": "access", "description": "Account access and login"},
    {"id": "shipping", "description": "Shipping and delivery"},
]


def decision(i: int, salt: str = "") -> dict[str, Any]:
    """A ~100-token support decision over a state no other sample uses."""
    return {
        "id": f"d{i}",
        "state": f"Ticket {salt}{i}: the customer in region {i % 7} says parcel {i * 31} arrived "
        "two weeks late and damaged, and that the invoice charged express delivery anyway.",
        "question": "Which team should handle this ticket?",
        "options": OPTIONS,
    }


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, float]:
    started = time.perf_counter()
    async with session.post(url, data=body, headers=JSON) as response:
        await response.read()
        return response.status, time.perf_counter() - started


async def _decisions(session: aiohttp.ClientSession, base: str, n: int, salt: str) -> list[float]:
    seconds = []
    for i in range(n):
        body = json.dumps({"decision": decision(i, salt)}).encode()
        status, elapsed = await _post(session, f"{base}/invocations", body)
        if status != 200:
            raise RuntimeError(f"a benchmark decision failed with {status}")
        seconds.append(elapsed)
    return seconds


# What the server answers each abuse with: OpenAI's 400 on /v1/* and 422 on /invocations for what
# cannot fit (adapter.middleware). tests/bench/test_abuse_bench.py holds these to the server.
CHAT_REFUSED = 400
STATE_REFUSED = 422


def _chat_body() -> bytes:
    message = "The printer is on fire again. " * (5 * MB // 30)
    return json.dumps({"messages": [{"role": "user", "content": message}]}).encode()


def _state_body() -> bytes:
    huge = "The printer is on fire. " * (5 * MB // 24)
    return json.dumps({"decision": {**decision(0), "state": huge}}).encode()


async def _with_bursts(
    session: aiohttp.ClientSession, base: str, n: int, chats: int
) -> tuple[list[float], list[float], list[tuple[int, float]]]:
    """Decision latencies alone and sent together with ``chats`` parallel 5 MB chats, the two
    interleaved (a shared machine's load drifts: each pair sees about the same)."""
    chat = _chat_body()
    idle: list[float] = []
    burst: list[float] = []
    answers: list[tuple[int, float]] = []
    for i in range(n):
        idle += await _decisions(session, base, 1, f"idle-{i}-")
        body = json.dumps({"decision": decision(i, "burst-")}).encode()
        sent = [_post(session, f"{base}/v1/chat/completions", chat) for _ in range(chats)]
        (status, elapsed), *chats_answered = await asyncio.gather(
            _post(session, f"{base}/invocations", body), *sent
        )
        if status != 200:
            raise RuntimeError(f"a benchmark decision failed with {status}")
        burst.append(elapsed)
        answers += chats_answered
    return idle, burst, answers


async def _under_flood(
    session: aiohttp.ClientSession, base: str, n: int, chats: int
) -> tuple[list[float], list[tuple[int, float]]]:
    """Decision latencies while ``chats`` clients post 5 MB chat messages back to back."""
    chat = _chat_body()
    stop = asyncio.Event()
    answers: list[tuple[int, float]] = []

    async def flood() -> None:
        while not stop.is_set():
            answers.append(await _post(session, f"{base}/v1/chat/completions", chat))

    floods = [asyncio.create_task(flood()) for _ in range(chats)]
    try:
        await asyncio.sleep(1.0)  # the floods are running
        seconds = await _decisions(session, base, n, "flood-")
    finally:
        stop.set()
        await asyncio.gather(*floods)
    return seconds, answers


async def _refusals(session: aiohttp.ClientSession, base: str, n: int) -> dict[str, Any]:
    """A 5 MB state and a 6 MB body of 256 long prompts: status, code, seconds to refuse."""
    long_prompt = "The order arrived late and damaged, the customer asks for a refund. " * 340
    many = {"decisions": [{**decision(i), "state": f"{i}: {long_prompt}"} for i in range(256)]}
    bodies = {"5 MB state": _state_body(), "6 MB decisions": json.dumps(many).encode()}
    out: dict[str, Any] = {}
    for name, body in bodies.items():
        seconds = [(await _post(session, f"{base}/invocations", body))[1] for _ in range(n)]
        async with session.post(f"{base}/invocations", data=body, headers=JSON) as response:
            status, error = response.status, (await response.json())["error"]
        out[name] = {
            "status": status,
            "code": error["code"],
            "p50_s": statistics.median(seconds),
            "mb": len(body) / MB,
        }
    return out


async def _in_flight(session: aiohttp.ClientSession, base: str) -> float:
    async with session.get(f"{base}/metrics") as response:
        return metric(await response.text(), "arbiter_in_flight") or 0.0


async def _disconnect(session: aiohttp.ClientSession, base: str, after_s: float) -> dict[str, Any]:
    """A 256-decision request, its client gone after ``after_s``: when is the engine free?"""
    probe = json.dumps({"decision": decision(0, "probe-")}).encode()

    async def result() -> dict[str, Any]:
        async with session.post(f"{base}/invocations", data=probe, headers=JSON) as response:
            return dict((await response.json())["result"])

    before = await result()
    body = json.dumps({"decisions": [decision(i, "many-") for i in range(256)]}).encode()
    request = asyncio.create_task(_post(session, f"{base}/invocations", body))
    await asyncio.sleep(after_s)
    request.cancel()
    gone = time.perf_counter()
    for _ in range(12_000):  # a minute at most
        if await _in_flight(session, base) == 0:
            break
        await asyncio.sleep(0.005)
    freed = time.perf_counter() - gone
    after = await result()
    same = (after["option_logits"], after["probabilities"]) == (
        before["option_logits"],
        before["probabilities"],
    )
    return {"freed_s": freed, "probe_unchanged": same}


async def _run(server: Served, args: argparse.Namespace) -> dict[str, Any]:
    base = server.base
    timeout = aiohttp.ClientTimeout(total=600)
    progress = Progress("abuse")
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await _decisions(session, base, 3, "warm-")
        progress(f"decisions alone and with {args.chats} parallel 5 MB chats", always=True)
        idle, loaded, chats = await _with_bursts(session, base, args.repeats, args.chats)
        progress(f"decisions while {args.chats} clients post 5 MB chats", always=True)
        flooded, flood = await _under_flood(session, base, args.repeats, args.chats)
        progress("a 5 MB state and a 6 MB body of decisions", always=True)
        refusals = await _refusals(session, base, 5)
        progress("a 256-decision request whose client disconnects", always=True)
        disconnect = await _disconnect(session, base, args.disconnect_after_s)
        async with session.get(f"{base}/metrics") as response:
            text = await response.text()
    one = statistics.median(idle)
    chat_statuses = sorted({status for status, _ in chats})
    summary: dict[str, Any] = {
        "decision_idle_p50_s": one,
        "decision_under_chats_p50_s": statistics.median(loaded),
        "under_chats_ratio": statistics.median(loaded) / one,
        "chats_sent": len(chats),
        "chat_statuses": chat_statuses,
        "chat_refusal_p50_s": statistics.median(s for _, s in chats),
        "decision_under_flood_p50_s": statistics.median(flooded),
        "under_flood_ratio": statistics.median(flooded) / one,
        "flood_chats_sent": len(flood),
        "flood_statuses": sorted({status for status, _ in flood}),
        "freed_after_disconnect_s": disconnect["freed_s"],
        "freed_ratio": disconnect["freed_s"] / one,
        "probe_unchanged": disconnect["probe_unchanged"],
        "cancelled_computing": metric(text, "arbiter_cancelled_total", stage="computing"),
    }
    for name, refused in refusals.items():
        summary[name] = {**refused, "ratio": refused["p50_s"] / one}
    # A load only slows a decision (interleaved with the idle ones; the flood's are paired by index).
    summary["warnings"] = check(
        [
            paired("under_chats_ratio", loaded, idle, floor=1.0),
            paired("under_flood_ratio", flooded, idle, floor=1.0),
        ]
    )
    summary["pass"] = {
        "under_chats_ratio<=1.5": summary["under_chats_ratio"] <= 1.5,
        "chats_refused": chat_statuses == [CHAT_REFUSED]
        and summary["flood_statuses"] == [CHAT_REFUSED],
        "5MB_state_refused": summary["5 MB state"]["status"] == STATE_REFUSED,
        "5MB_state_in_ms": summary["5 MB state"]["ratio"] < 0.5,
        "6MB_decisions_413_budget": summary["6 MB decisions"]["code"]
        == "request_token_budget_exceeded",
        "freed_within_one_decision": summary["freed_ratio"] <= 1.0,
        "probe_unchanged": summary["probe_unchanged"],
    }
    return summary


def main(args: argparse.Namespace) -> int:
    with served(model=args.model) as server:
        summary = asyncio.run(_run(server, args))
    if args.json:
        print(json.dumps(summary))
    else:
        s = summary
        ms = 1000
        print(f"one decision, idle (p50 of {args.repeats}): {s['decision_idle_p50_s'] * ms:.0f} ms")
        print(
            f"  sent with {args.chats} parallel 5 MB chats: {s['decision_under_chats_p50_s'] * ms:.0f}"
            f" ms, ratio {s['under_chats_ratio']:.2f} ({s['chats_sent']} chats, statuses "
            f"{s['chat_statuses']}, p50 {s['chat_refusal_p50_s'] * ms:.0f} ms each)"
        )
        print(
            f"  while {args.chats} clients post 5 MB chats back to back: "
            f"{s['decision_under_flood_p50_s'] * ms:.0f} ms, ratio {s['under_flood_ratio']:.2f} "
            f"({s['flood_chats_sent']} chats, statuses {s['flood_statuses']})"
        )
        for name in ("5 MB state", "6 MB decisions"):
            r = s[name]
            print(
                f"{name} ({r['mb']:.1f} MB): {r['status']} {r['code']} in "
                f"{r['p50_s'] * ms:.0f} ms, {r['ratio']:.2f} of one decision"
            )
        print(
            f"256 decisions, client gone after {args.disconnect_after_s:g} s: engine free after "
            f"{s['freed_after_disconnect_s'] * ms:.0f} ms, {s['freed_ratio']:.2f} of one decision;"
            f" probe unchanged: {s['probe_unchanged']}; cancelled: {s['cancelled_computing']}"
        )
        print("pass: " + ", ".join(f"{k}={v}" for k, v in s["pass"].items()))
    return verdict(summary["pass"], TARGETS, getattr(args, "smoke", False))


# The performance targets among the passes; the others are the server's behaviour, always checked.
TARGETS = {"under_chats_ratio<=1.5", "5MB_state_in_ms", "freed_within_one_decision"}
