"""`arbiter work` as a real process tree on moto: SIGTERM drain, SIGKILL recovery, metrics, and
`arbiter local` + `arbiter submit` end to end with the real engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import ROOT
from tests.aws import aws_clients, list_keys, queue_counts, read_object, receive_all, wait_for
from tests.environ import environ_without
from tests.fakes import decision_line
from tests.ports import free_port
from worker.settings import WorkerSettings
from worker.stack import ensure_stack


class Proc:
    """A child process in its own session, its stderr+stdout collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in list(self.lines):
            if line.startswith("{") and f'"{name}"' in line:
                record = json.loads(line)
                if record.get("event") == name:
                    out.append(record)
        return out

    def wait_event(self, name: str, count: int = 1, within_s: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            found = self.events(name)
            if len(found) >= count:
                return found
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {count}x {name!r}; output:\n" + "\n".join(self.lines[-40:]))

    def kill_all(self) -> None:
        """SIGKILL the whole session this test started (pool, workers, their helpers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        self._reader.join(5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def _spawn(args: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(args, env)
        started.append(proc)
        return proc

    yield _spawn
    for proc in started:
        proc.kill_all()


def worker_env(endpoint: str, **extra: Any) -> dict[str, str]:
    env = environ_without("ARBITER_", "PROMETHEUS_")
    env.update(
        PYTHONPATH=str(ROOT),
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        ARBITER_AWS_ENDPOINT_URL=endpoint,
        ARBITER_BUCKET="jobs",
        ARBITER_WAIT_TIME_S="1",
        ARBITER_METRICS_PORT="0",
        ARBITER_WORKER_ENGINE_FACTORY="tests.fakes:make_fake_engine",
        ARBITER_RESTART_DELAY_S="0.2",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


WORK = [sys.executable, "-m", "arbiter", "work"]


def stack_settings(endpoint: str, **kw: Any) -> WorkerSettings:
    return WorkerSettings(aws_endpoint_url=endpoint, bucket="jobs", **kw)


async def test_sigterm_finishes_the_job_in_hand_and_exits_0(endpoint: str, spawn) -> None:
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, stack_settings(endpoint))
        pool = spawn(WORK, worker_env(endpoint, ARBITER_FAKE_DELAY_S=3))
        pool.wait_event("worker.ready")
        await s3.put_object(Bucket="jobs", Key="incoming/t.jsonl", Body=decision_line(1).encode())
        pool.wait_event("job.started")
        pool.popen.send_signal(signal.SIGTERM)
        assert pool.popen.wait(30) == 0
        assert len(await list_keys(s3, "jobs", "results/")) == 2  # finished, not abandoned
        assert await queue_counts(sqs, stack["queue_url"]) == (0, 0)
    assert pool.events("worker.stopped") and pool.events("pool.stopped")


async def test_sigkill_mid_job_is_redone_with_exactly_one_output(endpoint: str, spawn) -> None:
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, stack_settings(endpoint, visibility_timeout_s=3))
        env = worker_env(
            endpoint,
            ARBITER_FAKE_DELAY_S=2,
            ARBITER_VISIBILITY_TIMEOUT_S=3,
            ARBITER_HEARTBEAT_S=1,
            ARBITER_CHUNK_DECISIONS=2,
        )
        pool = spawn(WORK, env)
        pool.wait_event("worker.ready")
        body = "\n".join(decision_line(i) for i in range(6)).encode()  # 3 chunks: ~6 s
        await s3.put_object(Bucket="jobs", Key="incoming/k.jsonl", Body=body)
        [started] = pool.wait_event("job.started")
        await asyncio.sleep(1)
        os.kill(started["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        # nothing partial is visible: only the job's progress (status.json, gone when it ends)
        left = await list_keys(s3, "jobs", "results/")
        assert [k for k in left if not k.endswith(".status.json")] == []

        pool.wait_event("pool.worker_died")
        redone = pool.wait_event("job.started", count=2, within_s=30)[1]
        print(f"redelivered {time.monotonic() - killed_at:.1f} s after the kill (visibility 3 s)")
        assert redone["pid"] != started["pid"] and redone["receive_count"] == 2
        pool.wait_event("job.finished", within_s=30)
        await wait_for(lambda: _empty(sqs, stack["queue_url"]))
        keys = await list_keys(s3, "jobs", "results/")
        uploads = await s3.list_multipart_uploads(Bucket="jobs")
        records = [json.loads(x) for x in (await read_object(s3, "jobs", keys[0])).splitlines()]
        summary = json.loads(await read_object(s3, "jobs", keys[1]))
        pool.popen.send_signal(signal.SIGTERM)
        assert pool.popen.wait(30) == 0
    assert len(keys) == 2 and keys[0].endswith(".results.jsonl")
    assert not uploads.get("Uploads")
    # One complete results object: every line exactly once, in order, all scored.
    assert [(r["line"], r["id"]) for r in records] == [(i + 1, f"d{i}") for i in range(6)]
    assert all("result" in r for r in records)
    assert summary["lines"] == summary["ok"] == 6 and summary["worker"]["pid"] == redone["pid"]


async def _empty(sqs: Any, url: str) -> bool:
    return await queue_counts(sqs, url) == (0, 0)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def test_metrics_are_merged_from_two_worker_processes(endpoint: str, spawn) -> None:
    port = free_port()
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, stack_settings(endpoint))
        env = worker_env(
            endpoint,
            ARBITER_WORKER_PROCESSES=2,
            ARBITER_METRICS_PORT=port,
            ARBITER_FAKE_DELAY_S=1.5,
        )
        pool = spawn(WORK, env)
        pool.wait_event("worker.ready", count=2)
        for i in range(4):
            await s3.put_object(
                Bucket="jobs", Key=f"incoming/m{i}.jsonl", Body=decision_line(i).encode()
            )
        finished = pool.wait_event("job.finished", count=4, within_s=60)
        samples = _scrape(port)
        pool.popen.send_signal(signal.SIGTERM)
        assert pool.popen.wait(30) == 0
    assert len({f["pid"] for f in finished}) == 2  # both processes took jobs
    assert samples['arbiter_worker_jobs_total{outcome="ok"}'] == 4
    assert samples['arbiter_worker_lines_total{outcome="ok"}'] == 4
    assert samples["arbiter_worker_job_seconds_count"] == 4
    assert samples["arbiter_worker_visibility_extensions_total"] >= 0
    assert samples["arbiter_worker_receive_latency_seconds_count"] >= 4


def test_local_stack_and_submit_with_the_real_engine(spawn, tmp_path: Path) -> None:
    env = environ_without("ARBITER_", "PROMETHEUS_")
    env.update(PYTHONPATH=str(ROOT), ARBITER_WAIT_TIME_S="1", ARBITER_METRICS_PORT="0")
    env.pop("AWS_ACCESS_KEY_ID", None)
    local = spawn(
        [
            sys.executable,
            "-m",
            "arbiter",
            "local",
            "--moto-port",
            "0",
            "--no-serve",
            "--no-runtime",
        ],
        env,
    )
    deadline = time.monotonic() + 60
    endpoint = ""
    while not endpoint and time.monotonic() < deadline:
        for line in list(local.lines):
            if "S3 + SQS endpoint:" in line:
                endpoint = line.split()[-1]
        time.sleep(0.1)
    assert endpoint.startswith("http://127.0.0.1:"), "\n".join(local.lines)
    local.wait_event("worker.ready", within_s=120)
    job = tmp_path / "job.jsonl"
    job.write_text((ROOT / "examples" / "job.jsonl").read_text())
    submitted = subprocess.run(
        [sys.executable, "-m", "arbiter", "submit", str(job), "--timeout", "120"],
        cwd=ROOT,
        env={**env, "ARBITER_AWS_ENDPOINT_URL": endpoint},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert submitted.returncode == 0, submitted.stderr
    summary = json.loads(submitted.stdout)
    n_lines = sum(1 for line in job.read_text().splitlines() if line.strip())
    assert summary["lines"] == n_lines and summary["ok"] + summary["failed"] == n_lines
    assert summary["ok"] >= 1 and summary["model"]["architecture"] == "gemma3"
    local.popen.send_signal(signal.SIGTERM)
    assert local.popen.wait(60) == 0


async def test_a_crash_looping_worker_backs_off_then_the_pool_exits_non_zero(
    endpoint: str, spawn
) -> None:
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, stack_settings(endpoint))
    env = worker_env(endpoint, ARBITER_FAKE_CRASH=1, ARBITER_MAX_RESTARTS=3)
    pool = spawn(WORK, env)
    code = await asyncio.to_thread(pool.popen.wait, 90)
    died = pool.events("pool.worker_died")
    assert code == 1
    assert [d.get("restart_in_s") for d in died] == [0.2, 0.4, 0.8, None]  # doubling, then out
    assert pool.events("pool.crash_loop") and pool.events("pool.stopped")


async def test_drain_deadline_exits_without_waiting_for_the_running_chunk(
    endpoint: str, spawn
) -> None:
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, stack_settings(endpoint))
        await receive_all(sqs, stack["queue_url"])
        await sqs.purge_queue(QueueUrl=stack["queue_url"])
        env = worker_env(endpoint, ARBITER_FAKE_DELAY_S=60, ARBITER_DRAIN_DEADLINE_S=0.5)
        pool = spawn(WORK, env)
        pool.wait_event("worker.ready")
        await s3.put_object(Bucket="jobs", Key="incoming/x.jsonl", Body=decision_line(1).encode())
        pool.wait_event("job.started")
        await asyncio.sleep(0.5)  # the 60 s engine call is running
        started = time.monotonic()
        pool.popen.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(pool.popen.wait, 30)
        seconds = time.monotonic() - started
        [again] = await receive_all(sqs, stack["queue_url"], wait=1)  # released for another worker
    print(f"pool exited {seconds:.1f} s after SIGTERM (drain deadline 0.5 s, engine call 60 s)")
    assert code == 0 and pool.events("job.released")
    assert seconds < 10, f"the pool took {seconds:.1f} s to stop"
    assert again["Attributes"]["ApproximateReceiveCount"] == "1"  # a release is not a failure


def _peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    [line] = [x for x in status.splitlines() if x.startswith("VmHWM:")]
    return int(line.split()[1]) / 1024


def _gzip_bomb(good: bytes, giant_mb: int, newlines_mb: int) -> bytes:
    """``good``, a giant line, a run of newlines, ``good``: gzipped without holding it."""
    import zlib

    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    out = [compressor.compress(good + b"\n")]
    for block, count in ((b"x" * 2**20, giant_mb), (b"\n" * 2**20, newlines_mb)):
        out += [compressor.compress(block) for _ in range(count)]
    out += [compressor.compress(good), compressor.flush()]
    return b"".join(out)


BOMB_GIANT_MB, BOMB_NEWLINES_MB, RSS_GROWTH_BOUND_MB = 128, 256, 40


async def test_a_gzip_bomb_keeps_worker_memory_bounded_and_the_next_job_is_served(
    endpoint: str, spawn
) -> None:
    good = decision_line(1).encode()
    bomb = _gzip_bomb(good, BOMB_GIANT_MB, BOMB_NEWLINES_MB)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await ensure_stack(s3, sqs, stack_settings(endpoint))
        pool = spawn(WORK, worker_env(endpoint))
        pool.wait_event("worker.ready")
        warm = "\n".join(decision_line(i) for i in range(300)).encode()
        await s3.put_object(Bucket="jobs", Key="incoming/warm.jsonl", Body=warm)
        [first] = pool.wait_event("job.finished")
        before = _peak_rss_mb(first["pid"])
        await s3.put_object(Bucket="jobs", Key="incoming/bomb.jsonl.gz", Body=bomb)
        second = pool.wait_event("job.finished", count=2, within_s=180)[1]
        after = _peak_rss_mb(second["pid"])
        await s3.put_object(Bucket="jobs", Key="incoming/next.jsonl", Body=warm)
        third = pool.wait_event("job.finished", count=3, within_s=60)[2]
        keys = await list_keys(s3, "jobs", "results/bomb")
        records = [json.loads(x) for x in (await read_object(s3, "jobs", keys[0])).splitlines()]
        await wait_for(lambda: _empty(sqs, stack["queue_url"]))
        pool.popen.send_signal(signal.SIGTERM)
        assert pool.popen.wait(30) == 0
    print(
        f"bomb: {len(bomb) / 2**20:.2f} MB gzip -> {BOMB_GIANT_MB + BOMB_NEWLINES_MB} MB; "
        f"read in {second['seconds']:.1f} s; worker peak RSS {before:.0f} -> {after:.0f} MB"
    )
    assert first["pid"] == second["pid"] == third["pid"]  # the same worker, still serving
    assert third["lines"] == 300 and third["failed"] == 0
    assert [(r["line"], "result" in r) for r in records] == [
        (1, True),
        (2, False),
        (BOMB_NEWLINES_MB * 2**20 + 2, True),
    ]
    assert records[1]["error"]["code"] == "payload_too_large"
    assert after - before < RSS_GROWTH_BOUND_MB, (before, after)
