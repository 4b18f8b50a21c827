"""`arbiter bench faults`: the figures of docs/failure-modes.md, JSON Lines throughput over HTTP and
Batch Transform sizing (``--lines 60 --questions 10`` by default).

Serves the default model over loopback (as `arbiter serve` would) and posts JSON Lines bodies to
`/invocations`: independent decisions (one question per ~1 kB state) and grouped ones (``--questions``
per state, consecutive). Prints decisions/s for each, how many decisions fit in SageMaker async
inference's one-hour invocation limit, and the `MaxPayloadInMB` the server advertises for Batch
Transform's default (600 s) and longest (3,600 s) invocation timeouts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from adapter import execution
from adapter.app import create_app
from arbiter.engine import Engine, open_engine
from arbiter.settings import ServerSettings
from bench.figures import Ratio, check

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {"lines": 6, "questions": 3}


def _lines(count: int, questions: int) -> bytes:
    out = []
    for i in range(count):
        state = json.loads(execution.probe_lines(1)[0])["state"]
        state["ticket"] = f"T-{i // questions}"
        state["text"] = state["text"].replace("Customer 0", f"Customer {i // questions}")
        out.append(
            json.dumps(
                {
                    "id": f"d{i}",
                    "state": state,
                    "question": f"Question {i % questions}: which queue should handle this?",
                    "options": [
                        {"id": "identity", "description": "Identity and single sign-on"},
                        {"id": "billing", "description": "Billing and invoices"},
                        {"id": "general", "description": "General support"},
                    ],
                }
            )
        )
    return ("\n".join(out) + "\n").encode()


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, list[Any]]:
    started = time.perf_counter()
    async with session.post(
        url, data=body, headers={"Content-Type": "application/jsonlines"}
    ) as response:
        records = [json.loads(line) for line in (await response.read()).splitlines()]
    return time.perf_counter() - started, records


async def _measure(engine: Engine, lines: int, questions: int) -> list[tuple[str, int, float]]:
    runner = web.AppRunner(create_app(ServerSettings(), lambda: engine, close_engine=False))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rows = []
    try:
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for _ in range(1200):  # the model loads in a thread at start-up
                if (await session.get(f"{base}/ping")).status == 200:
                    break
                await asyncio.sleep(0.1)
            for label, per_state in (
                ("independent (1 question per state)", 1),
                (f"grouped ({questions} questions per state)", questions),
            ):
                print(f"[bench faults] {lines} lines, {label}", file=sys.stderr, flush=True)
                engine.cache.clear()
                seconds, records = await _post(
                    session, f"{base}/invocations", _lines(lines, per_state)
                )
                assert len(records) == lines, len(records)
                rows.append((label, sum("result" in r for r in records), seconds))
    finally:
        await runner.cleanup()
    return rows


def main(args: argparse.Namespace) -> int:
    engine = open_engine()
    try:
        rows = asyncio.run(_measure(engine, args.lines, args.questions))
        speed = execution.measure(engine)
        info = (
            f"{engine.model_info.file}, {engine.settings.n_threads} threads, n_ctx {engine.n_ctx}"
        )
    finally:
        engine.close()
    print(f"model {info}")
    print("| JSON Lines body | decisions | seconds | decisions/s | in one hour |")
    print("|---|---|---|---|---|")
    for label, ok, seconds in rows:
        rate = ok / seconds
        print(f"| {label} | {ok} | {seconds:.1f} | {rate:.2f} | {int(rate * 3600):,} |")
    # Grouping only removes prefills: grouped lines cannot take longer than independent ones.
    (_, _, independent_s), (_, _, grouped_s) = rows
    check(
        [
            Ratio(
                "grouped_vs_independent",
                independent_s / grouped_s,
                (independent_s / grouped_s,),
                1.0,
            )
        ]
    )
    print()
    print(
        f"Batch Transform probe: {speed.seconds_per_mb:.0f} s per MB of ~1 kB lines "
        f"({speed.lines_per_s:.2f} lines/s)"
    )
    for timeout_s in (600, 3600):
        mb = execution.payload_mb(speed, timeout_s)
        print(f"  InvocationsTimeoutInSeconds {timeout_s}: MaxPayloadInMB {mb}")
    return 0
