"""`arbiter submit` knows what the worker will do (issue 37 item 5): a file the worker ignores is
refused before anything is uploaded, a job too small to be split still shows its progress, and a
summary from an earlier run of the same file says it is one."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arbiter.errors import ArbiterError
from tests import ROOT
from tests.aws import aws_clients, list_keys
from tests.environ import environ_without
from tests.fakes import FakeEngine, decision_line
from tests.worker.support import make_consumer, settings_for
from worker import progress
from worker import submit as submit_module
from worker.stack import ensure_stack
from worker.submit import submit

pytestmark = pytest.mark.timeout(120)


async def test_a_file_the_worker_ignores_is_refused_before_it_is_uploaded(
    endpoint: str, tmp_path: Path
) -> None:
    settings = settings_for(endpoint)
    notes = tmp_path / "notes.txt"
    notes.write_text(decision_line(0) + "\n")
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        with pytest.raises(ArbiterError) as refused:
            await submit(settings, notes, timeout_s=900)
        assert await list_keys(s3, "jobs", "") == []  # nothing uploaded, nothing waited on
    assert "notes.txt" in refused.value.message and ".jsonl" in refused.value.message
    with pytest.raises(ArbiterError, match="outside the input prefix"):
        await submit(settings, notes, key="elsewhere/notes.jsonl", timeout_s=900)


def test_the_command_refuses_it_in_one_line_at_once(endpoint: str, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text(decision_line(0) + "\n")
    env = environ_without("ARBITER_", "AWS_")
    env.update(PYTHONPATH=str(ROOT), ARBITER_AWS_ENDPOINT_URL=endpoint)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "arbiter", "submit", str(notes)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("arbiter submit: refused: the worker ignores it") and "notes.txt" in line
    assert time.monotonic() - started < 30  # before: 900 s of waiting


async def test_a_small_job_shows_queued_then_its_lines_and_a_repeat_says_it_is_an_earlier_run(
    endpoint: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(progress, "EVERY_S", 0.0)  # every chunk's count written
    monkeypatch.setattr(submit_module, "LOG_EVERY_S", 0.0)  # and every change said
    settings = settings_for(endpoint, chunk_decisions=2)
    job = tmp_path / "small.jsonl"
    job.write_text("\n".join(decision_line(i) for i in range(10)) + "\n")
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        consumer, _ = await make_consumer(settings, s3, sqs, FakeEngine(delay_s=0.3))

        async def later() -> None:
            await asyncio.sleep(1.5)  # the job waits in the queue meanwhile
            await consumer.run()

        task = asyncio.create_task(later())
        try:
            summary = await submit(settings, job, timeout_s=60)
            first = capsys.readouterr().err
            again = await submit(settings, job, timeout_s=60)
            second = capsys.readouterr().err
        finally:
            consumer.stop()
            await task
    assert summary is not None and summary["lines"] == 10
    assert "queued" in first and "lines" in first and "10/10" in first
    counts = {int(n) for n in re.findall(r"\b(\d+)/10\b", first)}
    assert counts & set(range(1, 10)), first  # seen part-way, not only at the end
    assert "earlier run" not in first
    assert again == summary  # the same summary, returned at once...
    assert "unchanged since an earlier run" in second  # ...and said to be the earlier run's


async def test_progress_into_a_log_is_a_line_per_change_never_a_repainted_frame(
    endpoint: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """stderr is no terminal here (captured, as a log or CI's is): the bar's frames ("\\r" and
    a repaint every 0.5 s, dozens for a job of seconds) become a line per change, at most one a
    second here, the last always."""
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    monkeypatch.setattr(submit_module, "LOG_EVERY_S", 1.0)
    settings = settings_for(endpoint, chunk_decisions=1)
    job = tmp_path / "logged.jsonl"
    job.write_text("\n".join(decision_line(i) for i in range(12)) + "\n")
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        consumer, _ = await make_consumer(settings, s3, sqs, FakeEngine(delay_s=0.25))
        task = asyncio.create_task(consumer.run())
        try:
            started = time.monotonic()
            summary = await submit(settings, job, timeout_s=60)
            took = time.monotonic() - started
        finally:
            consumer.stop()
            await task
    said = capsys.readouterr().err
    assert summary is not None and summary["lines"] == 12
    assert "\r" not in said and "\x1b" not in said, repr(said)
    lines = [line for line in said.splitlines() if line.startswith("arbiter submit: ")]
    assert lines[0] == "arbiter submit: queued (12 lines)" and lines[-1].endswith("lines 12/12")
    assert len(lines) == len(set(lines)) and len(lines) <= took + 2, (took, lines)
