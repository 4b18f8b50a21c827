"""`arbiter bench worker`: a job's decisions/s end to end through the local stack vs the engine
alone on the same decisions in the same run, and grouped vs ungrouped scoring.

1. The job: ``--decisions`` decisions, 10 questions over each state of ``--state-tokens`` (~400)
   tokens (100 states for the default 1,000), written as a JSONL job file.
2. Engine alone: the same decisions through ``Engine.score`` in the worker's chunks (grouped by
   state, prefix cache cleared first), in this process.
3. Ungrouped: the first ``--ungrouped`` of them scored one call each, prefix cache cleared before
   each, so every decision prefills its whole prompt.
4. End to end: a moto server on 127.0.0.1, the bucket/queue/DLQ/notification, one `arbiter work`
   process (same thread count), and the job dropped into the input prefix; timed from the
   PutObject to the summary's appearance (the model load happens before, as in a running pool).
The job is cut into ``--segments`` parts and the three paths take turns on each part, so load from
other processes on a shared machine falls on all of them alike; they never run at the same time.

``--fanout N`` measures the fan-out instead (:func:`fanout_main`): the same job dropped into a fresh
local stack each time, timed from the PutObject to the summary: run whole by one worker process with
every core (the single path), split into shards for one such process, and split for N processes
with cores / N threads each; with each split run, the merge's own time and the prefix reuse the cut
kept, from the job's summary. The three take turns ``--repeats`` times, so load from other processes
falls on all alike; the fastest of each is reported (and the median).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from arbiter.settings import EngineSettings
from bench.common import QUESTIONS as CASE_QUESTIONS
from bench.common import ROOT, case_decision, sized_state
from bench.figures import Ratio, check

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {
    "decisions": 20,
    "ungrouped": 4,
    "state_tokens": 100,
    "segments": 2,
    "fanout": 0,
}

QUESTIONS = [*CASE_QUESTIONS, "What should happen next?", "Who should be told first?"]


def build_job(engine: Any, n: int, state_tokens: int) -> list[Any]:
    decisions: list[Any] = []
    for s in range(-(-n // len(QUESTIONS))):
        state = sized_state(engine, 500_000 + s, state_tokens, whole_prompt=False)
        for q, question in enumerate(QUESTIONS):
            if len(decisions) < n:
                d = case_decision(0, state, question)
                decisions.append(d.model_copy(update={"id": f"s{s}-q{q}"}))
    return decisions


def engine_path(engine: Any, decisions: list[Any], chunk: int) -> float:
    engine.cache.clear()
    started = time.perf_counter()
    for start in range(0, len(decisions), chunk):
        for outcome in engine.score(decisions[start : start + chunk]):
            assert not isinstance(outcome, Exception), outcome
    return time.perf_counter() - started


def ungrouped_path(engine: Any, decisions: list[Any]) -> float:
    elapsed = 0.0
    for d in decisions:
        engine.cache.clear()
        started = time.perf_counter()
        [outcome] = engine.score([d])
        elapsed += time.perf_counter() - started
        assert not isinstance(outcome, Exception), outcome
    return elapsed


def _start_worker(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "arbiter", "work"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


class Stack:
    """moto on 127.0.0.1, the bucket/queues/notification, and one `arbiter work` pool of
    ``processes`` worker processes (jobs split above ``shard_lines`` lines; 0: never)."""

    def __init__(
        self, n_threads: int, chunk: int, processes: int = 1, shard_lines: int = 0
    ) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        from worker.settings import WorkerSettings

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.settings = WorkerSettings(
            aws_endpoint_url=self.endpoint, bucket="bench", chunk_decisions=chunk
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_")}
        env.update(
            ARBITER_AWS_ENDPOINT_URL=self.endpoint,
            ARBITER_BUCKET="bench",
            ARBITER_WAIT_TIME_S="1",
            ARBITER_METRICS_PORT="0",
            ARBITER_WORKER_PROCESSES=str(processes),
            ARBITER_WORKER_THREADS=str(n_threads),
            ARBITER_CHUNK_DECISIONS=str(chunk),
            ARBITER_SHARD_LINES=str(shard_lines),
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
        )
        self.processes = processes
        # The queues exist before the workers look them up (a worker that finds none exits, and
        # the pool gives up after a few restarts).
        provision = threading.Thread(target=asyncio.run, args=(self._provision(),))
        provision.start()
        provision.join()
        self.worker = _start_worker(env)
        self.ready = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    async def _provision(self) -> None:
        from aiobotocore.session import get_session

        from worker.stack import ensure_stack

        kw = self.client_kwargs()
        session = get_session()
        async with (
            session.create_client("s3", **kw) as s3,
            session.create_client("sqs", **kw) as sqs,
        ):
            await ensure_stack(s3, sqs, self.settings)

    def _watch(self) -> None:
        assert self.worker.stderr is not None
        ready = 0
        for line in self.worker.stderr:
            if '"worker.ready"' in line:
                ready += 1
                if ready >= self.processes:
                    self.ready.set()

    def client_kwargs(self) -> dict[str, str]:
        return {
            "region_name": "us-east-1",
            "endpoint_url": self.endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
        }

    async def run_job(self, s3: Any, key: str, job: bytes) -> tuple[float, dict[str, Any]]:
        """Drop the job; seconds from PutObject to its summary, and the summary."""
        from worker.outputs import output_keys

        started = time.perf_counter()
        put = await s3.put_object(Bucket="bench", Key=key, Body=job)
        keys = output_keys(self.settings, key, put["ETag"].strip('"'))
        while True:
            try:
                got = await s3.get_object(Bucket="bench", Key=keys.summary)
                break
            except s3.exceptions.NoSuchKey:
                if self.worker.poll() is not None:
                    raise RuntimeError("the worker exited") from None
                await asyncio.sleep(0.1)
        elapsed = time.perf_counter() - started
        async with got["Body"] as body:
            summary: dict[str, Any] = json.loads(await body.read())
        return elapsed, summary

    @contextlib.asynccontextmanager
    async def s3_when_ready(self, within_s: float) -> AsyncIterator[Any]:
        """An S3 client of the stack once its workers are ready; the stack is closed after."""
        from aiobotocore.session import get_session

        try:
            async with get_session().create_client("s3", **self.client_kwargs()) as s3:
                if not await asyncio.to_thread(self.ready.wait, within_s):
                    raise RuntimeError("the workers did not become ready")
                yield s3
        finally:
            self.close()

    def close(self) -> None:
        if self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)
        try:
            self.worker.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.worker.pid, signal.SIGKILL)
            self.worker.wait()
        if self.worker.stderr is not None:
            self.worker.stderr.close()
        self.server.stop()


def _job_bytes(decisions: list[Any]) -> bytes:
    return "".join(d.model_dump_json(exclude_none=True) + "\n" for d in decisions).encode()


async def measure(
    engine: Any, decisions: list[Any], args: argparse.Namespace, threads: int, chunk: int
) -> dict[str, Any]:
    """The three paths, alternated segment by segment so that they share the machine's load."""
    n = len(decisions)
    segments = max(1, min(args.segments, n // 10))
    per = -(-n // segments)
    every = max(1, n // max(1, args.ungrouped))  # ungrouped sample: one decision in `every`
    totals: dict[str, Any] = {
        "engine_s": 0.0,
        "e2e_s": 0.0,
        "worker_engine_s": 0.0,
        "ungrouped_s": 0.0,
        "segments": [],
    }
    ungrouped_n = 0
    stack = Stack(threads, chunk)
    async with stack.s3_when_ready(180) as s3:
        for i in range(segments):
            part = decisions[i * per : (i + 1) * per]
            if not part:
                break
            engine_s = engine_path(engine, part, chunk)
            totals["engine_s"] += engine_s
            sample = [d for j, d in enumerate(part, start=i * per) if j % every == 0]
            ungrouped_s = ungrouped_path(engine, sample)
            totals["ungrouped_s"] += ungrouped_s
            ungrouped_n += len(sample)
            seconds, summary = await stack.run_job(
                s3, f"incoming/bench-{i}.jsonl", _job_bytes(part)
            )
            assert summary["ok"] == len(part), summary
            totals["e2e_s"] += seconds
            # Per decision, each path's seconds in this segment: the pairs of the ratios' spread.
            totals["segments"].append(
                (engine_s / len(part), seconds / len(part), ungrouped_s / max(1, len(sample)))
            )
            totals["worker_engine_s"] += summary["seconds"]["engine"]
            print(
                f"segment {i + 1}/{segments}: {len(part)} decisions, engine "
                f"{totals['engine_s']:.1f} s, end to end {totals['e2e_s']:.1f} s, "
                f"ungrouped {ungrouped_n} in {totals['ungrouped_s']:.1f} s",
                file=sys.stderr,
            )
    totals["ungrouped_n"] = ungrouped_n
    return totals


def main(args: argparse.Namespace) -> int:
    from arbiter.engine import open_engine

    if getattr(args, "fanout", 0):
        return fanout_main(args)
    settings = EngineSettings()
    threads = settings.n_threads
    engine = open_engine(settings, model=args.model)
    chunk = 256
    decisions = build_job(engine, args.decisions, args.state_tokens)
    n = len(decisions)
    print(f"job: {n} decisions, {-(-n // 10)} states x 10 questions", file=sys.stderr)
    t = asyncio.run(measure(engine, decisions, args, threads, chunk))
    engine.close()

    engine_rate = n / t["engine_s"]
    e2e_rate = n / t["e2e_s"]
    ungrouped_rate = t["ungrouped_n"] / t["ungrouped_s"]
    report = {
        "decisions": n,
        "states": -(-n // 10),
        "state_tokens": args.state_tokens,
        "threads": threads,
        "segments": args.segments,
        "engine_decisions_per_s": round(engine_rate, 3),
        "end_to_end_decisions_per_s": round(e2e_rate, 3),
        "end_to_end_vs_engine": round(e2e_rate / engine_rate, 3),
        # Same window, same process: the share of the jobs' wall time spent inside Engine.score.
        "worker_engine_share": round(t["worker_engine_s"] / t["e2e_s"], 3),
        "ungrouped_decisions": int(t["ungrouped_n"]),
        "ungrouped_decisions_per_s": round(ungrouped_rate, 3),
        "grouped_vs_ungrouped": round(engine_rate / ungrouped_rate, 2),
        "targets": {"end_to_end_vs_engine": ">= 0.90", "grouped_vs_ungrouped": ">= 4"},
        "warnings": check(_ratios(t["segments"], engine_rate, e2e_rate, ungrouped_rate)),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"decisions/s  engine alone {engine_rate:.2f}  end to end {e2e_rate:.2f}  "
            f"ratio {report['end_to_end_vs_engine']:.3f} (target >= 0.90); engine share of "
            f"the jobs' wall time {report['worker_engine_share']:.3f}\n"
            f"decisions/s  grouped {engine_rate:.2f}  ungrouped {ungrouped_rate:.2f}  "
            f"ratio {report['grouped_vs_ungrouped']:.2f}x (target >= 4x)"
        )
    return 0


def _ratios(
    segments: list[tuple[float, float, float]], engine: float, e2e: float, ungrouped: float
) -> list[Ratio]:
    """End to end runs the engine alone's work plus S3 and SQS, so it cannot be faster (a rate
    ratio above 1); grouping only removes prefills, so it cannot be slower than ungrouped."""
    return [
        Ratio(
            "end_to_end_vs_engine", e2e / engine, tuple(a / b for a, b, _ in segments), ceiling=1.0
        ),
        Ratio(
            "grouped_vs_ungrouped", engine / ungrouped, tuple(c / a for a, _, c in segments), 1.0
        ),
    ]


# -- fan-out ---------------------------------------------------------------------------------------


async def _one_run(
    job: bytes, key: str, threads: int, processes: int, shard_lines: int, chunk: int
) -> tuple[float, dict[str, Any]]:
    """A fresh stack and pool; seconds from the job's PutObject to its summary, and the summary."""
    stack = Stack(threads, chunk, processes=processes, shard_lines=shard_lines)
    async with stack.s3_when_ready(300) as s3:
        return await stack.run_job(s3, key, job)


def fanout_main(args: argparse.Namespace) -> int:
    """Job wall time: one process, whole (the single path) / one process, split / N processes,
    split; the merge's time and the prefix reuse kept."""
    from arbiter.engine import open_engine

    cores = EngineSettings().n_threads
    n = max(1, args.fanout)
    engine = open_engine(EngineSettings(), model=args.model)
    decisions = build_job(engine, args.decisions, args.state_tokens)
    engine.close()
    job = _job_bytes(decisions)
    # About four shards per process; 3 lines past a multiple of the 10 questions per state, so that
    # each cut lands inside a state's run and the split has to move it to keep the run whole.
    shard_lines = args.shard_lines or max(43, len(decisions) // (4 * n) // 10 * 10 + 3)
    runs = [
        ("one process, whole", 1, cores, 0),
        ("one process, split", 1, cores, shard_lines),
        (f"{n} processes, split", n, max(1, cores // n), shard_lines),
    ]
    print(
        f"job: {len(decisions)} decisions ({-(-len(decisions) // 10)} states x 10 questions), "
        f"{cores} cores, shards of {shard_lines} lines",
        file=sys.stderr,
    )
    walls: list[list[float]] = [[] for _ in runs]
    last: list[dict[str, Any]] = [{} for _ in runs]
    for repeat in range(max(1, args.repeats)):
        for i, (name, processes, threads, lines) in enumerate(runs):
            seconds, summary = asyncio.run(
                _one_run(job, f"incoming/fanout-{repeat}-{i}.jsonl", threads, processes, lines, 256)
            )
            assert summary["ok"] == len(decisions), summary
            walls[i].append(seconds)
            last[i] = summary
            print(f"round {repeat + 1}, {name}: {seconds:.1f} s", file=sys.stderr)
    rows = []
    for (name, processes, threads, _), times, summary in zip(runs, walls, last, strict=True):
        shards = summary.get("shards") or {}
        best = min(times)
        rows.append(
            {
                "run": name,
                "processes": processes,
                "threads_per_process": threads,
                "shards": shards.get("count", 0),
                "wall_s": round(best, 2),
                "wall_s_median": round(statistics.median(times), 2),
                "decisions_per_s": round(len(decisions) / best, 3),
                "merge_s": summary["seconds"].get("merge"),
                "prefix_reuse_kept": (shards.get("prefix_reuse") or {}).get("kept"),
                "runs_cut": (shards.get("prefix_reuse") or {}).get("runs_cut_by_shards"),
                "boundaries_moved": (shards.get("prefix_reuse") or {}).get(
                    "boundaries_moved_to_keep_runs"
                ),
            }
        )
    whole, split_one, split_n = (r["wall_s"] for r in rows)
    report = {
        "decisions": len(decisions),
        "cores": cores,
        "shard_lines": shard_lines,
        "runs": rows,
        f"speedup_{n}_processes_vs_whole": round(whole / split_n, 3),
        "split_overhead_one_process": round(split_one / whole, 3),
        # Round by round; splitting on one process adds the merge to the same work.
        "warnings": check(
            [
                Ratio(
                    f"speedup_{n}_processes_vs_whole",
                    whole / split_n,
                    tuple(a / b for a, b in zip(walls[0], walls[2], strict=True)),
                ),
                Ratio(
                    "split_overhead_one_process",
                    split_one / whole,
                    tuple(a / b for a, b in zip(walls[1], walls[0], strict=True)),
                    floor=1.0,
                ),
            ]
        ),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for r in rows:
            print(
                f"{r['run']:<22} {r['processes']} x {r['threads_per_process']} threads  "
                f"{r['shards']:>3} shards  {r['wall_s']:>7.1f} s (median {r['wall_s_median']:.1f})  "
                f"{r['decisions_per_s']:>6.2f}/s  "
                f"merge {r['merge_s'] if r['merge_s'] is not None else '-'} s  "
                f"prefix reuse kept {r['prefix_reuse_kept'] if r['prefix_reuse_kept'] is not None else '-'}"
                f" (cuts moved {r['boundaries_moved'] or 0}, runs cut {r['runs_cut'] or 0})"
            )
        print(
            f"{n} processes vs one process whole: {report[f'speedup_{n}_processes_vs_whole']:.2f}x; "
            f"splitting on one process costs {report['split_overhead_one_process']:.3f}x"
        )
    return 0
