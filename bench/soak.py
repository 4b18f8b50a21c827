"""`arbiter bench soak` (`make soak`): mixed and hostile traffic against `arbiter serve` for minutes.

``--clients`` clients send, back to back for ``--minutes``, a seeded mix of what users and abusers
send: single decisions, grouped decisions, many-option decisions, System One, JSON Lines with bad
lines, chat (plain and streamed), hostile bodies (bad JSON, a 5 MB state, a lone surrogate, deep
nesting, an over-budget request, a wrong content type) and requests whose client disconnects
mid-work, over ``--states`` distinct states, so the prefix cache (``--prefix-cache-mb``) churns.

Every ``--sample-s`` the server's RSS and open file descriptors are read from ``/proc``, and its
prefix cache's bytes from ``/metrics``. Warm-up ends when the cache first holds 90% of its bound
(at the latest at a third of the run); the report gives RSS then and at the end, its growth per
1,000 requests after warm-up (a least-squares slope), the fd growth, p50/p99 latency of the first
and the last minute, and the count of every status by kind. It fails (exit 1) on any 5xx, on RSS
growth after warm-up over ``--max-growth-mb-per-1k`` per 1,000 requests (and never under
``--max-growth-mb``), fd growth over ``--max-fd-growth``, a server that is not
healthy at the end, or a start-up line that does not say where it listens and what guards it.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from arbiter.models import bundled_model
from bench.served import Served, metric, served

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {"minutes": 0.25, "clients": 2}

MB = 1024 * 1024
JSON = {"Content-Type": "application/json"}
JSONL = {"Content-Type": "application/jsonlines"}
REQUEST_TOKENS = 16_384  # the soak's ARBITER_MAX_REQUEST_TOKENS: an over-budget body stays small
WORDS = [
    "customer",
    "order",
    "invoice",
    "parcel",
    "refund",
    "login",
    "outage",
    "region",
    "payment",
    "agent",
    "damaged",
    "late",
]


@dataclass(frozen=True)
class Call:
    kind: str
    path: str
    body: bytes
    headers: dict[str, str]
    leave_after_s: float | None = None  # the client disconnects after this long
    stream: bool = False


@dataclass
class Record:
    at: float  # seconds since the start
    kind: str
    status: str  # the HTTP status, or "left" for a client that disconnected
    seconds: float


@dataclass
class Sample:
    at: float
    requests: int
    rss_mb: float
    fds: int
    cache_bytes: float


@dataclass
class Traffic:
    """Seeded request builders over a pool of distinct states."""

    states: int
    rng: random.Random
    calls: Counter[str] = field(default_factory=Counter)

    def state(self) -> str:
        n = self.rng.randrange(self.states)
        words = random.Random(n).choices(WORDS, k=40 + n % 60)
        return f"Case {n}: " + " ".join(words) + "."

    def decision(self, i: int, state: str | None = None, options: int = 3) -> dict[str, Any]:
        return {
            "id": f"d{i}",
            "state": state or self.state(),
            "question": self.rng.choice(["Which team?", "How urgent is it?", "What next?"]),
            "options": [{"id": f"o{k}", "description": f"Option {k}"} for k in range(options)],
        }

    def make(self) -> Call:
        kinds = list(BUILDERS)
        kind = self.rng.choices(kinds, weights=[BUILDERS[k][0] for k in kinds])[0]
        return BUILDERS[kind][1](self)


def _json(kind: str, path: str, body: Any, **kw: Any) -> Call:
    return Call(kind, path, json.dumps(body).encode(), JSON, **kw)


def _single(t: Traffic) -> Call:
    return _json("single", "/invocations", {"decision": t.decision(0)})


def _grouped(t: Traffic) -> Call:
    state = t.state()
    return _json("grouped", "/invocations", {"decisions": [t.decision(i, state) for i in range(4)]})


def _many_options(t: Traffic) -> Call:
    return _json("many-options", "/invocations", {"decision": t.decision(0, options=40)})


def _systemone(t: Traffic) -> Call:
    questions = {
        "refund": {"type": "noul", "instructions": "Is a refund asked for?"},
        "team": {"type": "choice", "criteria": {"billing": None, "shipping": "Deliveries"}},
        "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
    }
    body = {"model": "default", "state": t.state(), "questions": questions}
    return _json("systemone", "/v1/systemone", body)


def _jsonlines(t: Traffic) -> Call:
    lines = [json.dumps(t.decision(i)) for i in range(4)]
    lines.insert(2, "{not json")
    lines.append(json.dumps({"id": "bad", "state": "s", "question": "q", "options": []}))
    return Call("jsonlines", "/invocations", ("\n".join(lines) + "\n").encode(), JSONL)


def _chat(t: Traffic) -> Call:
    stream = t.rng.random() < 0.4
    body = {
        "messages": [{"role": "user", "content": f"Summarize: {t.state()}"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    return _json("chat", "/v1/chat/completions", body, stream=stream)


def _hostile(t: Traffic) -> Call:
    pick = t.rng.randrange(8)
    if pick == 0:
        return Call("hostile", "/invocations", b'{"decision": {"id": ', JSON)
    if pick == 1:
        return Call("hostile", "/invocations", b"[" * 50_000, JSON)
    if pick == 2:
        state = "The printer is on fire. " * (5 * MB // 24)
        return _json("hostile", "/invocations", {"decision": t.decision(0, state)})
    if pick == 3:
        body = {"decision": t.decision(0, "Order \ud800 lost")}
        return Call("hostile", "/invocations", json.dumps(body).encode(), JSON)
    if pick == 4:  # over the soak's token budget, each decision within the context
        long = " ".join(["refund"] * 600)
        decisions = [t.decision(i, f"{i}: {long}") for i in range(40)]
        return _json("hostile", "/invocations", {"decisions": decisions})
    if pick == 5:
        return Call("hostile", "/invocations", b"{}", {"Content-Type": "text/plain"})
    if pick == 6:
        return _json("hostile", "/invocations", {"decision": t.decision(0, options=300)})
    return _json("hostile", "/v1/systemone", {"model": "default", "state": {"k": "\udfff"}})


def _leaving(t: Traffic) -> Call:
    leave = t.rng.uniform(0.05, 0.6)
    if t.rng.random() < 0.3:
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "stream": True}
        return _json("leaving", "/v1/chat/completions", body, leave_after_s=leave, stream=True)
    decisions = [t.decision(i) for i in range(16)]
    return _json("leaving", "/invocations", {"decisions": decisions}, leave_after_s=leave)


BUILDERS = {
    "single": (30, _single),
    "grouped": (10, _grouped),
    "many-options": (5, _many_options),
    "systemone": (10, _systemone),
    "jsonlines": (10, _jsonlines),
    "chat": (10, _chat),
    "hostile": (15, _hostile),
    "leaving": (10, _leaving),
}


async def _send(session: aiohttp.ClientSession, base: str, call: Call) -> str:
    body = io.BytesIO(call.body)  # streamed: a 5 MB body written at once would stall the loop
    async with session.post(base + call.path, data=body, headers=call.headers) as response:
        if call.stream and call.leave_after_s is not None:
            await response.content.readline()
            return "left"  # leaving the block closes the connection mid-stream
        await response.read()
        return str(response.status)


async def _client(
    session: aiohttp.ClientSession,
    base: str,
    traffic: Traffic,
    clock: tuple[float, float],
    out: list[Record],
) -> None:
    start, until = clock
    while (now := time.monotonic()) < until:
        call = traffic.make()
        started = time.perf_counter()
        try:
            if call.leave_after_s is not None and not call.stream:
                try:
                    async with asyncio.timeout(call.leave_after_s):
                        status = await _send(session, base, call)
                except TimeoutError:
                    status = "left"
            else:
                status = await _send(session, base, call)
        except aiohttp.ClientError as exc:
            status = f"client-error:{type(exc).__name__}"
        out.append(Record(now - start, call.kind, status, time.perf_counter() - started))


async def _sampler(
    server: Served, session: aiohttp.ClientSession, every_s: float, until: float, done: Any
) -> list[Sample]:
    samples: list[Sample] = []
    started = time.monotonic()
    while True:
        async with session.get(server.base + "/metrics") as response:
            cache = metric(await response.text(), "arbiter_prefix_cache_bytes") or 0.0
        now = time.monotonic()
        samples.append(Sample(now - started, len(done), server.rss_mb(), server.open_fds(), cache))
        if now >= until:
            return samples
        await asyncio.sleep(min(every_s, max(0.0, until - now)))


def _slope_per_1k(samples: list[Sample]) -> float:
    if len(samples) < 3 or samples[-1].requests == samples[0].requests:
        return 0.0
    x = np.array([s.requests for s in samples], dtype=float)
    y = np.array([s.rss_mb for s in samples], dtype=float)
    return float(np.polyfit(x, y, 1)[0] * 1000)


def _growth_mb(samples: list[Sample]) -> float:
    """RSS at the end over RSS after warm-up, each the mean of three samples (one sample is
    noisy: a 5 MB body in flight)."""
    if len(samples) < 2:
        return 0.0
    k = min(3, len(samples) // 2)
    return float(
        np.mean([s.rss_mb for s in samples[-k:]]) - np.mean([s.rss_mb for s in samples[:k]])
    )


def allowed_growth_mb(requests: int, per_1k: float, floor_mb: float) -> float:
    """The bound: ``per_1k`` MB per 1,000 requests after warm-up, and never under ``floor_mb`` (a
    short run's few hundred requests cannot tell a few MB of noise from a trend)."""
    return max(floor_mb, per_1k * requests / 1000)


def _latency(records: list[Record]) -> dict[str, float]:
    ok = [r.seconds for r in records if r.status == "200"]
    single = [r.seconds for r in records if r.status == "200" and r.kind == "single"]

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1000 if values else float("nan")

    return {
        "requests": len(records),
        "ok_p50_ms": pct(ok, 50),
        "ok_p99_ms": pct(ok, 99),
        "single_p50_ms": pct(single, 50),
        "single_p99_ms": pct(single, 99),
    }


def _summary(
    args: argparse.Namespace,
    records: list[Record],
    samples: list[Sample],
    server: Served,
    healthy: bool,
    seconds: float,
) -> dict[str, Any]:
    bound = args.prefix_cache_mb * MB
    full = next((s for s in samples if s.cache_bytes >= 0.9 * bound), None)
    warm_at = min(full.at if full else seconds, seconds / 3)
    after = [s for s in samples if s.at >= warm_at]
    warm, end = after[0], samples[-1]
    statuses: dict[str, Counter[str]] = {}
    for r in records:
        statuses.setdefault(r.kind, Counter())[r.status] += 1
    first = [r for r in records if r.at < 60]
    last = [r for r in records if r.at >= seconds - 60]
    five_xx = sum(1 for r in records if r.status.startswith("5"))
    listening = [e for e in server.log_events() if e.get("event") == "listening"]
    startup = listening[0] if listening else {}
    summary: dict[str, Any] = {
        "minutes": seconds / 60,
        "clients": args.clients,
        "states": args.states,
        "prefix_cache_mb": args.prefix_cache_mb,
        "requests": len(records),
        "requests_per_s": len(records) / seconds,
        "statuses": {k: dict(sorted(v.items())) for k, v in sorted(statuses.items())},
        "5xx": five_xx,
        "warm_up_s": warm_at,
        "cache_full_at_s": full.at if full else None,
        "rss_start_mb": samples[0].rss_mb,
        "rss_warm_mb": warm.rss_mb,
        "rss_end_mb": end.rss_mb,
        "rss_max_mb": max(s.rss_mb for s in samples),
        "rss_growth_mb_per_1k": _slope_per_1k(after),
        "rss_growth_mb": _growth_mb(after),
        "requests_after_warm_up": end.requests - warm.requests,
        "fds_warm": warm.fds,
        "fds_end": end.fds,
        "fds_max": max(s.fds for s in samples),
        "first_minute": _latency(first),
        "last_minute": _latency(last),
        "healthy_after": healthy,
        "startup_line": {k: startup.get(k) for k in ("url", "reach", "api_key")},
        "samples": [[round(x.at, 1), x.requests, round(x.rss_mb, 1), x.fds] for x in samples],
    }
    allowed = allowed_growth_mb(
        summary["requests_after_warm_up"], args.max_growth_mb_per_1k, args.max_growth_mb
    )
    summary["rss_growth_allowed_mb"] = allowed
    summary["pass"] = {
        "no_5xx": five_xx == 0,
        "rss_growth_within_bound": summary["rss_growth_mb"] <= allowed,
        f"fd_growth<={args.max_fd_growth}": end.fds - warm.fds <= args.max_fd_growth,
        "healthy_after": healthy,
        "startup_line_says_loopback_and_no_key": str(startup.get("reach", "")).startswith(
            "loopback"
        )
        and str(startup.get("api_key", "")).startswith("no API key"),
    }
    return summary


async def _soak(server: Served, args: argparse.Namespace) -> dict[str, Any]:
    seconds = args.minutes * 60
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=args.clients + 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.monotonic()
        clock = (started, started + seconds)
        clients = [
            _client(
                session,
                server.base,
                Traffic(args.states, random.Random(args.seed + n)),
                clock,
                records,
            )
            for n in range(args.clients)
        ]
        sampling = asyncio.create_task(_sampler(server, session, args.sample_s, clock[1], records))
        await asyncio.gather(*clients)
        samples = await sampling
        elapsed = time.monotonic() - started
        await asyncio.sleep(1.0)
        async with session.get(server.base + "/ping") as response:
            healthy = response.status == 200
        one = {"decision": Traffic(args.states, random.Random(1)).decision(0)}
        async with session.post(server.base + "/invocations", json=one) as response:
            healthy = healthy and response.status == 200
    return _summary(args, records, samples, server, healthy, elapsed)


def _print(s: dict[str, Any]) -> None:
    print(
        f"soak: {s['minutes']:.1f} min, {s['clients']} clients, {s['states']} states, prefix "
        f"cache {s['prefix_cache_mb']:g} MB: {s['requests']} requests "
        f"({s['requests_per_s']:.1f}/s), 5xx: {s['5xx']}"
    )
    print("statuses by kind:")
    for kind, counts in s["statuses"].items():
        print(f"  {kind:13} " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    full = s["cache_full_at_s"]
    print(
        f"warm-up {s['warm_up_s']:.0f} s (cache 90% full at "
        f"{'never' if full is None else f'{full:.0f} s'}); RSS start {s['rss_start_mb']:.0f} MB, "
        f"after warm-up {s['rss_warm_mb']:.0f} MB, end {s['rss_end_mb']:.0f} MB, max "
        f"{s['rss_max_mb']:.0f} MB; after warm-up {s['rss_growth_mb']:+.1f} MB over "
        f"{s['requests_after_warm_up']} requests (bound {s['rss_growth_allowed_mb']:.0f} MB), slope "
        f"{s['rss_growth_mb_per_1k']:+.2f} MB per 1,000 requests"
    )
    print(f"open fds after warm-up {s['fds_warm']}, end {s['fds_end']}, max {s['fds_max']}")
    for name in ("first_minute", "last_minute"):
        m = s[name]
        print(
            f"{name.replace('_', ' ')}: {m['requests']} requests; 200s p50 {m['ok_p50_ms']:.0f} ms"
            f" p99 {m['ok_p99_ms']:.0f} ms; single decisions p50 {m['single_p50_ms']:.0f} ms p99 "
            f"{m['single_p99_ms']:.0f} ms"
        )
    line = s["startup_line"]
    print(f"start-up line: {line['url']}, {line['reach']}; {line['api_key']}")
    print("pass: " + ", ".join(f"{k}={v}" for k, v in s["pass"].items()))


def main(args: argparse.Namespace) -> int:
    env = {
        "ARBITER_PREFIX_CACHE_MB": str(args.prefix_cache_mb),
        "ARBITER_MAX_REQUEST_TOKENS": str(REQUEST_TOKENS),
    }
    # The bundled model unless one is named: the bounds and the traffic are sized for it, and a
    # machine where `make run` installed the 1.5B (the default it would serve) must pass the same.
    model = args.model if args.model is not None else bundled_model().path
    with served(env, model=model) as server:
        summary = asyncio.run(_soak(server, args))
    if args.json:
        print(json.dumps(summary))
    else:
        _print(summary)
    return 0 if all(summary["pass"].values()) else 1
