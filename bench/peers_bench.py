"""`arbiter bench peers`: Arbiter and llama.cpp's own C++ server, side by side on the same tokens.

The C++ server (the stock llama.cpp image's) is built here from the llama.cpp that the installed
llama-cpp-python vendors, with the wheel's CMake flags (:mod:`bench.llama_server`), so the two run
the same kernels. Both serve the same model with the same threads and context; requests alternate
one by one (the order flipped each pair), so the machine's noise falls on both alike, and every row
prints the median of the paired ratios (Arbiter's time over the server's) with their range.

Rows:
- **cold**: one decision with no shared state and no cache (Arbiter ``ARBITER_PREFIX_CACHE_MB=0``),
  against ``/completion`` on Arbiter's own prompt token ids, ``n_predict`` 1, ``cache_prompt``
  false: the same tokens prefilled once each. Run twice: as served by default (the state's prefix,
  then the question, two decodes: docs/decisions.md#numerics) and with ``ARBITER_PARALLEL_BRANCHES=true``
  (a lone cold question in one decode, as the server does).
- **shared**: the questions about one state as one Arbiter request, against one ``/completion``
  per question (``cache_prompt`` true, its best case).
- **interleaved**: several states' questions asked in turns, so no two requests in a row share a
  state: Arbiter's prefix cache against the server's slot cache.
- **chat**: the text path, ``/v1/chat/completions`` with ``max_tokens`` 1 and ``top_logprobs`` 20
  on both (models with a chat template; Arbiter's chat path must return ``logprobs``).

The server-side times each side reports (Arbiter's ``timing.total_s``, the server's
``timings.prompt_ms``) are printed beside the client's round trips.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from arbiter.schema import DecisionRequest
from bench import context_study, llama_server
from bench.common import (
    ONE_READ,
    QUESTIONS,
    ROOT,
    case_decision,
    free_port,
    sized_state,
    stop,
    wait_until_ready,
)
from bench.figures import Progress, Ratio, check

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {
    "decisions": 3,
    "states": 1,
    "repeats": 1,
    "study_repeats": 1,
    "no_chat": True,
}

LOGS = ROOT / ".bench"


@dataclass
class Sample:
    """One request's client round trip and the time its server says it computed."""

    wall_s: float
    server_s: float


def _post(url: str, body: Any, timeout_s: float = 600) -> tuple[dict[str, Any], float]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            out = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url} answered {exc.code}: {exc.read()[:500]!r}") from None
    return out, time.perf_counter() - started


# -- the two servers -------------------------------------------------------------------------------


@contextmanager
def cpp_server(model: Path, n_ctx: int, threads: int) -> Iterator[str]:
    binary = llama_server.ensure_built(LOGS / "llama-server-build.log")
    port = free_port()
    log = LOGS / "llama-server.log"
    cmd = [
        str(binary),
        "-m", str(model),
        "-c", str(n_ctx),
        "-t", str(threads),
        "-tb", str(threads),
        "-np", "1",
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(proc, f"http://127.0.0.1:{port}/health", "llama-server", log, 300, 0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@contextmanager
def arbiter_server(
    model: Path, threads: int, cache_mb: float, *, parallel_branches: bool = False
) -> Iterator[str]:
    port = free_port()
    log = LOGS / "arbiter-serve.log"
    env = {
        **os.environ,
        "ARBITER_N_THREADS": str(threads),
        "ARBITER_PREFIX_CACHE_MB": str(cache_mb),
        "ARBITER_PARALLEL_BRANCHES": str(parallel_branches).lower(),
        "ARBITER_ORDER_POLICY": ONE_READ,
        "ARBITER_LOG_LEVEL": "warning",
    }
    cmd = [sys.executable, "-m", "arbiter", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*cmd, "--model", str(model)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        wait_until_ready(proc, f"http://127.0.0.1:{port}/ping", "arbiter serve", log, 300, 0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


# -- one request each ----------------------------------------------------------------------------


def arbiter_decide(base: str, decisions: list[DecisionRequest]) -> Sample:
    wire = [d.model_dump(mode="json", exclude_none=True) for d in decisions]
    body: Any = {"decision": wire[0]} if len(wire) == 1 else {"decisions": wire}
    out, wall = _post(f"{base}/invocations", body)
    if "result" in out:
        return Sample(wall, float(out["result"]["timing"]["total_s"]))
    return Sample(wall, sum(float(r["timing"]["total_s"]) for r in out["results"]))


def cpp_complete(base: str, tokens: np.ndarray, *, cache: bool) -> Sample:
    body = {"prompt": tokens.tolist(), "n_predict": 1, "cache_prompt": cache, "temperature": 0}
    out, wall = _post(f"{base}/completion", body)
    timings = out.get("timings", {})
    return Sample(wall, (timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000)


def paired(
    pairs: Sequence[tuple[Callable[[], Sample], Callable[[], Sample]]], warmup: int = 1
) -> dict[str, Any]:
    """Run each (Arbiter, server) pair, alternating which goes first; the ratios' statistics."""
    for ours, theirs in pairs[:warmup]:
        ours()
        theirs()
    a: list[Sample] = []
    b: list[Sample] = []
    for i, (ours, theirs) in enumerate(pairs):
        if i % 2 == 0:
            a.append(ours())
            b.append(theirs())
        else:
            b.append(theirs())
            a.append(ours())
    ratios = [x.wall_s / y.wall_s for x, y in zip(a, b, strict=True)]
    server_ratios = [x.server_s / y.server_s for x, y in zip(a, b, strict=True) if y.server_s]
    return {
        "n": len(ratios),
        "arbiter_p50_ms": 1000 * statistics.median(s.wall_s for s in a),
        "server_p50_ms": 1000 * statistics.median(s.wall_s for s in b),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "pairs": ratios,
        "compute_ratio_median": statistics.median(server_ratios) if server_ratios else None,
        "arbiter_compute_p50_ms": 1000 * statistics.median(s.server_s for s in a),
        "server_compute_p50_ms": 1000 * statistics.median(s.server_s for s in b),
    }


# -- the decisions -------------------------------------------------------------------------------


@dataclass
class Workload:
    cold: list[tuple[DecisionRequest, np.ndarray]]
    shared: list[tuple[DecisionRequest, np.ndarray]]
    interleaved: list[tuple[DecisionRequest, np.ndarray]]
    texts: list[str]  # the cold decisions' prompt text, for the chat row


def build_workload(model: Path, decisions: int, states: int) -> Workload:
    """Decisions sized like the issue's (326-408 prompt tokens) and their exact prompt tokens, from
    an engine of the same model (closed before the servers start)."""
    from arbiter.engine import open_engine
    from arbiter.settings import EngineSettings

    engine = open_engine(EngineSettings(model=model, n_threads=1, prefix_cache_mb=0))
    try:
        cold = []
        for i in range(decisions):
            state = sized_state(engine, 9000 + i, 330 + (i * 7) % 80)
            d = case_decision(i, state, QUESTIONS[i % len(QUESTIONS)])
            cold.append((d, engine.prompt_tokens(d)))
        one = sized_state(engine, 777, 330)
        shared = [
            (d, engine.prompt_tokens(d))
            for d in (case_decision(i, one, q) for i, q in enumerate(QUESTIONS))
        ]
        many = [sized_state(engine, 500 + s, 330) for s in range(states)]
        interleaved = []
        for q in range(3):
            for s, state in enumerate(many):
                d = case_decision(100 * s + q, state, QUESTIONS[q])
                interleaved.append((d, engine.prompt_tokens(d)))
        texts = [engine.prompts.render(d).text for d, _ in cold]
        return Workload(cold, shared, interleaved, texts)
    finally:
        engine.close()


# -- the rows ------------------------------------------------------------------------------------


def cold_row(arbiter: str, cpp: str, work: Workload) -> dict[str, Any]:
    pairs = [
        (partial(arbiter_decide, arbiter, [d]), partial(cpp_complete, cpp, t, cache=False))
        for d, t in work.cold
    ]
    row = paired(pairs)
    row["tokens"] = [int(min(len(t) for _, t in work.cold)), int(max(len(t) for _, t in work.cold))]
    return row


def shared_row(arbiter: str, cpp: str, work: Workload, repeats: int) -> dict[str, Any]:
    decisions = [d for d, _ in work.shared]

    def theirs() -> Sample:
        cpp_complete(cpp, np.array([1, 2, 3], dtype=np.int32), cache=True)  # evict the slot
        samples = [cpp_complete(cpp, t, cache=True) for _, t in work.shared]
        return Sample(sum(s.wall_s for s in samples), sum(s.server_s for s in samples))

    row = paired([(lambda: arbiter_decide(arbiter, decisions), theirs)] * repeats)
    row["questions"] = len(decisions)
    return row


def interleaved_row(arbiter: str, cpp: str, work: Workload) -> dict[str, Any]:
    # One pass over every state first: Arbiter's prefix cache then holds them (as it would in
    # steady traffic); the server gets the same pass.
    for d, t in work.interleaved[: len(work.interleaved) // 3]:
        arbiter_decide(arbiter, [d])
        cpp_complete(cpp, t, cache=True)
    pairs = [
        (partial(arbiter_decide, arbiter, [d]), partial(cpp_complete, cpp, t, cache=True))
        for d, t in work.interleaved
    ]
    return paired(pairs, warmup=0)


def chat_body(text: str) -> dict[str, Any]:
    """How text-path users read options: one token, greedy, the top 20 log-probabilities."""
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
    }


def chat_sample(base: str, text: str, *, cpp: bool) -> Sample:
    body = chat_body(text)
    if cpp:
        body["cache_prompt"] = False  # each request prefilled whole, as Arbiter's chat path does
    out, wall = _post(f"{base}/v1/chat/completions", body)
    if not out["choices"][0].get("logprobs"):
        raise RuntimeError(f"{base} answered no logprobs: {out}")
    timings = out.get("timings", {})
    server = (timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000
    return Sample(wall, server or wall)


def chat_row(model: Path, n_ctx: int, threads: int, texts: list[str]) -> dict[str, Any]:
    """The text path on a model with a chat template: both servers render it themselves."""
    with cpp_server(model, n_ctx, threads) as cpp, arbiter_server(model, threads, 0) as arbiter:
        pairs = [
            (partial(chat_sample, arbiter, t, cpp=False), partial(chat_sample, cpp, t, cpp=True))
            for t in texts
        ]
        row = paired(pairs)
        ours, _ = _post(f"{arbiter}/v1/chat/completions", chat_body(texts[0]))
        theirs, _ = _post(f"{cpp}/v1/chat/completions", chat_body(texts[0]))
        row["prompt_tokens"] = {
            "arbiter": ours["usage"]["prompt_tokens"],
            "llama_server": theirs["usage"]["prompt_tokens"],
        }
        row["model"] = model.name
    return row


def _fmt(row: dict[str, Any]) -> str:
    return (
        f"Arbiter p50 {row['arbiter_p50_ms']:8.1f} ms | llama-server p50 {row['server_p50_ms']:8.1f}"
        f" ms | paired ratio {row['ratio_median']:.3f} ({row['ratio_min']:.2f}-"
        f"{row['ratio_max']:.2f}), n={row['n']}"
    )


def main(args: argparse.Namespace) -> int:
    from arbiter.models import bundled_model, smollm2_path

    LOGS.mkdir(exist_ok=True)
    model = Path(args.model) if args.model else bundled_model().path
    threads = args.threads
    work = build_workload(model, args.decisions, args.states)
    rows: dict[str, Any] = {}
    if getattr(args, "smoke", False) and not args.only_study and llama_server.built() is None:
        print(
            "[bench peers] llama-server is not built here (about 20 minutes on 2 cores, once): "
            "this smoke run measures the in-process study alone",
            file=sys.stderr,
        )
        args.only_study = True
    if not args.only_study:
        binary = llama_server.ensure_built(LOGS / "llama-server-build.log")
        print(f"llama-server: {binary}", flush=True)
    if not args.no_study:
        print("in process, the same tokens on contexts that differ in one setting:", flush=True)
        rows["context"] = context_study.study(
            model,
            threads,
            args.n_ctx,
            [d for d, _ in work.cold],
            args.study_repeats,
            Progress("peers, the study"),
        )
        print(context_study.render(rows["context"]), flush=True)
    if args.only_study:
        report = {"model": model.name, "threads": threads, "rows": rows}
        report["warnings"] = check(_ratios(rows))
        if args.json:
            print(json.dumps(report))
        return 0
    with cpp_server(model, args.n_ctx, threads) as cpp:
        with arbiter_server(model, threads, cache_mb=0) as arbiter:
            rows["cold"] = cold_row(arbiter, cpp, work)
            print(f"cold single decision        {_fmt(rows['cold'])}", flush=True)
            rows["shared"] = shared_row(arbiter, cpp, work, args.repeats)
            print(f"{len(work.shared)} questions, one state    {_fmt(rows['shared'])}", flush=True)
        with arbiter_server(model, threads, cache_mb=0, parallel_branches=True) as arbiter:
            rows["cold_one_pass"] = cold_row(arbiter, cpp, work)
            print(f"  ... ARBITER_PARALLEL_BRANCHES {_fmt(rows['cold_one_pass'])}", flush=True)
        with arbiter_server(model, threads, cache_mb=256) as arbiter:
            rows["interleaved"] = interleaved_row(arbiter, cpp, work)
            print(f"interleaved states          {_fmt(rows['interleaved'])}", flush=True)
    chat_model = Path(args.chat_model) if args.chat_model else smollm2_path()
    if chat_model is not None and not args.no_chat:
        texts = [work.texts[i] for i in range(min(len(work.texts), args.decisions))]
        rows["chat"] = chat_row(chat_model, args.n_ctx, threads, texts)
        print(f"chat, top_logprobs 20 ({chat_model.name})  {_fmt(rows['chat'])}", flush=True)
    report = {"model": model.name, "threads": threads, "rows": rows}
    report["warnings"] = check(_ratios(rows))
    if args.json:
        print(json.dumps(report))
    return 0


def _ratios(rows: dict[str, Any]) -> list[Ratio]:
    """Each paired row's median ratio and its pairs (two servers: no physical floor between them),
    and the study's rows against the server-shaped context's prefill."""
    out = [
        Ratio(name, row["ratio_median"], tuple(row["pairs"]))
        for name, row in rows.items()
        if name != "context"
    ]
    out += [
        Ratio(f"study: {name.strip()}", row["ratio_median"], tuple(row["pairs"]))
        for name, row in list(rows.get("context", {}).items())[1:]
    ]
    return out
