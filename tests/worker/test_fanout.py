"""Fan-out on moto (server mode) with consumers in this process: a large job is split into shards,
scored by several consumers and merged once, in input order, into the single path's records. The
races (two last shards at once, two merges at once, a duplicate shard or job delivery, a drain in a
merge), a shard whose decisions all raise, a shard that fails for good, progress, the merge's part
plan. Faults injected in the AWS client's path are tests/worker/test_fanout_faults.py's."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from arbiter.engine import Engine
from arbiter.errors import MalformedRequest, PayloadTooLarge
from tests.aws import aws_clients, list_keys, read_object, receive_all
from tests.fakes import FakeEngine, decision_line
from tests.worker.fanout_support import (
    fanout_settings,
    job_body,
    job_lines,
    job_message,
    make_consumer,
    outputs,
    pending,
    run_until_done,
    sample,
    shard_messages,
    single_path,
    stripped,
    versions,
)
from worker.events import JobRef, ShardRef, UnreadableMessage, parse_message
from worker.fanout import job as fanout_job
from worker.fanout import merge, runner, status
from worker.fanout.frames import frame, unframe
from worker.fanout.keys import JobFolder, job_folder
from worker.fanout.merge import Merger
from worker.fanout.outcome import ShardOutcome
from worker.fanout.parts import plan_parts
from worker.fanout.plan import Manifest, ShardSpan
from worker.fanout.split import split_input
from worker.jobs import Located, locate
from worker.settings import WorkerSettings
from worker.stack import ensure_stack

MiB = 1024 * 1024


async def _stack(s3: Any, sqs: Any, settings: WorkerSettings) -> dict[str, str]:
    stack = await ensure_stack(s3, sqs, settings)
    # Versioned, so that "written once" can be counted: every write of a key is a version.
    await s3.put_bucket_versioning(Bucket="jobs", VersioningConfiguration={"Status": "Enabled"})
    return stack


async def _put(s3: Any, key: str, body: bytes) -> str:
    put = await s3.put_object(Bucket="jobs", Key=key, Body=body)
    return str(put["ETag"]).strip('"')


# -- the whole path --------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json"])
async def test_a_job_split_into_shards_gives_the_single_paths_records(
    endpoint: str, suffix: str
) -> None:
    settings = fanout_settings(endpoint, shard_lines=7)
    key = f"incoming/big{suffix}"
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        etag = await _put(s3, key, job_body(job_lines(60), suffix))
        alone = await single_path(s3, settings, key, FakeEngine())
        keys = outputs(settings, key, etag)
        made = [await make_consumer(settings, s3, sqs, FakeEngine()) for _ in range(3)]
        await run_until_done([c for c, _ in made], s3, sqs, stack["queue_url"], keys.summary)
        merged = await read_object(s3, "jobs", keys.results)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
        progress = json.loads(await read_object(s3, "jobs", status.status_key(keys)))
        left = await list_keys(s3, "jobs", "shards/")
    assert stripped(merged) == stripped(alone)  # the same records, line for line
    assert summary["shards"]["count"] >= 8 and summary["shards"]["failed"] == []
    bad = 3 if suffix == ".json" else 4
    assert summary["lines"] == len(stripped(alone)) == 60 + bad
    assert summary["failed"] == bad and summary["ok"] == 60
    assert progress["state"] == "done" and progress["shards"]["done"] == summary["shards"]["count"]
    assert progress["lines"] == {"total": 60 + bad, "done": 60 + bad, "failed": bad}
    assert left == []  # shard inputs, outputs and markers are gone
    registries = [r for _, r in made]
    assert sample(registries, "arbiter_worker_jobs_total", outcome="split") == 1
    assert sample(registries, "arbiter_worker_jobs_total", outcome="merged") == 1
    assert (
        sample(registries, "arbiter_worker_shards_total", outcome="ok")
        == summary["shards"]["count"]
    )
    assert sample(registries, "arbiter_worker_merges_total", outcome="ok") == 1


async def test_a_job_within_one_shard_runs_whole_as_before(endpoint: str) -> None:
    settings = fanout_settings(endpoint, shard_lines=30)
    body = "\n".join(decision_line(i) for i in range(30)).encode()
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        etag = await _put(s3, "incoming/small.jsonl", body)
        keys = outputs(settings, "incoming/small.jsonl", etag)
        consumer, registry = await make_consumer(settings, s3, sqs, FakeEngine())
        await run_until_done([consumer], s3, sqs, stack["queue_url"], keys.summary)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
        everything = await list_keys(s3, "jobs")
    assert "shards" not in summary and summary["lines"] == 30
    assert sorted(everything) == sorted(["incoming/small.jsonl", keys.results, keys.summary])
    assert sample([registry], "arbiter_worker_jobs_total", outcome="ok") == 1
    assert sample([registry], "arbiter_worker_shards_total", outcome="ok") == 0


async def test_shard_boundaries_are_a_function_of_the_input(endpoint: str) -> None:
    settings = fanout_settings(endpoint, shard_lines=8)
    lines = job_lines(70, run=5)
    async with aws_clients(endpoint) as (s3, sqs):
        await _stack(s3, sqs, settings)
        etag = await _put(s3, "incoming/same.jsonl.gz", job_body(lines, ".jsonl.gz"))
        ref = JobRef("jobs", "incoming/same.jsonl.gz")
        found = await locate(s3, ref, settings)
        assert isinstance(found, Located) and found.etag == etag
        splits = []
        for base in ("shards/a/", "shards/b/"):
            folder = JobFolder(base)
            manifest = await split_input(s3, found, folder, settings, 8)
            assert isinstance(manifest, Manifest)
            inputs = [
                await read_object(s3, "jobs", folder.input(manifest.plan, s.index))
                for s in manifest.shards
            ]
            splits.append((manifest, inputs))
    (first, inputs_a), (second, inputs_b) = splits
    assert first.writer != second.writer
    assert first.plan == second.plan  # the same cut has the same name
    assert first.shards == second.shards and inputs_a == inputs_b
    assert sum(s.items for s in first.shards) == first.items == 70 + 4
    # A run of 5 lines of one state stays in one shard when the cut can move by 2 (a quarter of 8).
    state = {
        n: json.loads(x)["state"] for n, x in enumerate(lines, 1) if x.startswith(b'{"id": "d')
    }
    for span in first.shards[1:]:
        previous = first.shards[span.index - 1]
        before, after = state.get(previous.last), state.get(span.first)
        moved_all_it_could = previous.items - 8 == 2
        assert before is None or before != after or moved_all_it_could, span


async def test_shard_records_match_the_single_path_with_the_real_engine(
    endpoint: str, engine: Engine
) -> None:
    settings = fanout_settings(endpoint, shard_lines=6, max_line_bytes=64 * 1024)
    questions = ["Which team should handle it?", "How urgent is it?", "Refund or replace?"]
    states = [
        f"Ticket {s}: the customer reports problem number {s * 7} since Monday." for s in range(7)
    ]
    body = "\n".join(
        decision_line(i, state=states[i // 3], question=questions[i % 3]) for i in range(21)
    ).encode()
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        etag = await _put(s3, "incoming/real.jsonl", body)
        keys = outputs(settings, "incoming/real.jsonl", etag)
        engine.cache.clear()
        alone = stripped(await single_path(s3, settings, "incoming/real.jsonl", engine))
        engine.cache.clear()
        consumer, _ = await make_consumer(settings, s3, sqs, engine)
        await run_until_done([consumer], s3, sqs, stack["queue_url"], keys.summary, within_s=240)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
        merged = stripped(await read_object(s3, "jobs", keys.results))
    assert summary["shards"]["count"] == 4 and summary["ok"] == 21
    assert summary["shards"]["prefix_reuse"]["runs_cut_by_shards"] == 0  # runs of 3 kept whole
    assert len(merged) == len(alone) == 21
    worst = 0.0
    for got, want in zip(merged, alone, strict=True):
        a, b = got.pop("result"), want.pop("result")
        assert got == want  # line and id
        pa, pb = a.pop("probabilities"), b.pop("probabilities")
        worst = max(worst, *(abs(x - y) for x, y in zip(pa, pb, strict=True)))
        for field in ("option_logits", "allowed_mass", "choice"):
            a.pop(field), b.pop(field)
        assert a == b  # ids, prompt (sha256, tokens), model, status: equal
    print(f"largest probability difference, shards vs one worker: {worst:.2e}")
    assert worst <= 1e-3


# -- races -----------------------------------------------------------------------------------------


def _barrier_on(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, parties: int = 2) -> None:
    """The next ``parties`` calls of ``owner.name`` wait for one another, then go on together."""
    original = getattr(owner, name)
    barrier = asyncio.Barrier(parties)
    calls = [0]

    async def gated(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] <= parties:
            await asyncio.wait_for(barrier.wait(), 20)
        return await original(*args, **kw)

    monkeypatch.setattr(owner, name, gated)


async def _split(
    s3: Any, sqs: Any, url: str, settings: WorkerSettings, consumer: Any, n: int, key: str
) -> tuple[Any, dict[int, dict[str, Any]]]:
    """Drop a job of ``n`` lines, split it with ``consumer``; its keys and its shard messages."""
    body = "\n".join(decision_line(i, state=f"S{i}") for i in range(n)).encode()
    etag = await _put(s3, key, body)
    await consumer.handle(await job_message(sqs, url))
    count = -(-n // settings.shard_lines)
    return outputs(settings, key, etag), await shard_messages(sqs, url, count)


async def test_two_workers_finishing_the_last_two_shards_at_once_merge_once(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = fanout_settings(endpoint, shard_lines=4)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        url = stack["queue_url"]
        (a, ra), (b, rb) = [await make_consumer(settings, s3, sqs, FakeEngine()) for _ in "ab"]
        keys, messages = await _split(s3, sqs, url, settings, a, 16, "incoming/race.jsonl")
        await a.handle(messages[0])
        await a.handle(messages[1])
        # Both publish their outcome at the same moment: both would list all four outcomes, but
        # only the count that completes the status sends the merge message.
        _barrier_on(monkeypatch, runner, "publish")
        await asyncio.gather(a.handle(messages[2]), b.handle(messages[3]))
        triggers = await receive_all(sqs, url, wait=1)
        for message in triggers:
            await sqs.change_message_visibility(
                QueueUrl=url, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=0
            )
        await run_until_done([a, b], s3, sqs, url, keys.summary)
        alone = await single_path(s3, settings, "incoming/race.jsonl", FakeEngine())
        merged = await read_object(s3, "jobs", keys.results)
        written = (await versions(s3, keys.results), await versions(s3, keys.summary))
    assert [json.loads(m["Body"])["arbiter_merge"] for m in triggers] == [2]  # one trigger
    assert written == (1, 1)
    assert sample([ra, rb], "arbiter_worker_merges_total", outcome="ok") == 1
    assert stripped(merged) == stripped(alone)


async def test_two_merges_at_once_write_the_results_and_the_summary_once(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No claim: every object a merge writes is a function of the immutable outcomes, and the
    conditional completion and summary keep each single."""
    settings = fanout_settings(endpoint, shard_lines=4)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        url = stack["queue_url"]
        (a, _), (b, _) = [await make_consumer(settings, s3, sqs, FakeEngine()) for _ in "ab"]
        keys, messages = await _split(s3, sqs, url, settings, a, 12, "incoming/twomerges.jsonl")
        for i in range(3):
            await a.handle(messages[i])
        [trigger] = await receive_all(sqs, url, wait=1)
        await sqs.send_message(QueueUrl=url, MessageBody=trigger["Body"])  # a duplicate trigger
        [copy] = await receive_all(sqs, url, wait=1)
        _barrier_on(monkeypatch, merge, "complete_upload")  # both complete at the same moment
        await asyncio.gather(a.handle(trigger), b.handle(copy))
        assert await pending(sqs, url) == 0
        written = (await versions(s3, keys.results), await versions(s3, keys.summary))
        merged = await read_object(s3, "jobs", keys.results)
        uploads = await s3.list_multipart_uploads(Bucket="jobs")
        left = await list_keys(s3, "jobs", "shards/")
    assert written == (1, 1)
    assert not uploads.get("Uploads") and left == []  # the losing upload was aborted
    assert [r["line"] for r in stripped(merged)] == list(range(1, 13))


async def test_a_duplicate_shard_delivery_is_published_once(endpoint: str) -> None:
    settings = fanout_settings(endpoint, shard_lines=4)
    barrier = threading.Barrier(2, timeout=20)

    class Together(FakeEngine):
        def score(self, decisions: Any) -> Any:
            if self.calls == 0:
                barrier.wait()  # both copies of shard 0 are scored at the same moment
            return super().score(decisions)

    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        url = stack["queue_url"]
        a, ra = await make_consumer(settings, s3, sqs, FakeEngine())
        keys, messages = await _split(s3, sqs, url, settings, a, 12, "incoming/dup.jsonl")
        await sqs.send_message(QueueUrl=url, MessageBody=messages[0]["Body"])
        [copy] = await receive_all(sqs, url, wait=1)
        (c1, r1), (c2, r2) = [await make_consumer(settings, s3, sqs, Together()) for _ in "12"]
        await asyncio.gather(c1.handle(messages[0]), c2.handle(copy))
        etag = keys.results.split(".")[-3]
        folder = job_folder(settings, "jobs", "incoming/dup.jsonl", etag)
        published = await list_keys(s3, "jobs", f"{folder.base}out/00000.")
        await a.handle(messages[1])
        await a.handle(messages[2])
        await run_until_done([a], s3, sqs, url, keys.summary)  # the merge message
        alone = await single_path(s3, settings, "incoming/dup.jsonl", FakeEngine())
        merged = await read_object(s3, "jobs", keys.results)
    assert len(published) == 1  # the losing attempt deleted its own output
    registries = [ra, r1, r2]
    assert sample(registries, "arbiter_worker_shards_total", outcome="ok") == 3
    assert sample(registries, "arbiter_worker_shards_total", outcome="duplicate") == 1
    assert stripped(merged) == stripped(alone)


async def test_a_duplicate_job_delivery_splits_once(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = fanout_settings(endpoint, shard_lines=4)
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        url = stack["queue_url"]
        body = "\n".join(decision_line(i, state=f"S{i}") for i in range(12)).encode()
        etag = await _put(s3, "incoming/twice.jsonl", body)
        first = await job_message(sqs, url)
        await sqs.send_message(QueueUrl=url, MessageBody=first["Body"])  # S3 sent it twice
        [second] = await receive_all(sqs, url, wait=1)
        (a, ra), (b, rb) = [await make_consumer(settings, s3, sqs, FakeEngine()) for _ in "ab"]
        _barrier_on(monkeypatch, fanout_job, "read_manifest")  # both find no manifest, both split
        await asyncio.gather(a.handle(first), b.handle(second))
        received: list[dict[str, Any]] = []
        for _ in range(20):
            received += await receive_all(sqs, url, wait=1)
            if len(received) >= 6:
                break
        folder = job_folder(settings, "jobs", "incoming/twice.jsonl", etag)
        manifest = json.loads(await read_object(s3, "jobs", folder.manifest))
        inputs = await list_keys(s3, "jobs", folder.base)
        for message in received:
            await sqs.change_message_visibility(
                QueueUrl=url, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=0
            )
        keys = outputs(settings, "incoming/twice.jsonl", etag)
        await run_until_done([a, b], s3, sqs, url, keys.summary)
        merged = await read_object(s3, "jobs", keys.results)
    # The loser of the manifest write repaired (sent the shards too): it cannot know the winner's
    # message would come back if the winner died.
    assert sorted(json.loads(m["Body"])["index"] for m in received) == [0, 0, 1, 1, 2, 2]
    assert {json.loads(m["Body"])["plan"] for m in received} == {manifest["plan"]}
    assert [k for k in inputs if "/in/" in k] == [
        folder.input(manifest["plan"], i) for i in range(3)
    ]  # both cut the same inputs to the same keys
    assert sample([ra, rb], "arbiter_worker_jobs_total", outcome="split") == 1
    assert sample([ra, rb], "arbiter_worker_jobs_total", outcome="repaired") == 1
    assert [r["line"] for r in stripped(merged)] == list(range(1, 13))


async def test_a_merge_stopped_at_a_drain_is_finished_by_another_worker(endpoint: str) -> None:
    settings = fanout_settings(endpoint, shard_lines=4, drain_deadline_s=0.2)
    body = "\n".join(decision_line(i, state=f"S{i}") for i in range(12)).encode()
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        etag = await _put(s3, "incoming/drained.jsonl", body)
        keys = outputs(settings, "incoming/drained.jsonl", etag)
        a, _ = await make_consumer(settings, s3, sqs, FakeEngine())
        merging = asyncio.Event()

        async def stuck(*args: Any) -> Any:
            merging.set()
            await asyncio.sleep(3600)  # a merge far longer than the drain deadline

        a.fanout.merger._results = stuck  # type: ignore[method-assign]
        task = asyncio.create_task(a.run())
        await asyncio.wait_for(merging.wait(), 30)
        a.stop()  # a deploy: SIGTERM
        await asyncio.wait_for(task, 10)
        stopped_at = time.monotonic()
        b, _ = await make_consumer(settings, s3, sqs, FakeEngine())
        await run_until_done([b], s3, sqs, stack["queue_url"], keys.summary)
        took = time.monotonic() - stopped_at
        written = (await versions(s3, keys.results), await versions(s3, keys.summary))
        uploads = await s3.list_multipart_uploads(Bucket="jobs")
    assert written == (1, 1) and not uploads.get("Uploads")
    assert took < 20, took  # released at the deadline, not after a visibility timeout


# -- failure and progress --------------------------------------------------------------------------


class PoisonEngine(FakeEngine):
    """Raises on any batch that holds a decision whose state is ``POISON``."""

    def score(self, decisions: Any) -> Any:
        if any(d.state == "POISON" for d in decisions):
            raise RuntimeError("this engine cannot score poison")
        return super().score(decisions)


async def test_a_shard_whose_decisions_all_raise_is_retried_then_written_as_the_single_path_writes_it(
    endpoint: str,
) -> None:
    """Every try but the last stops early (the engine may be broken on that worker); the last
    writes each line's own record, so the job equals the single path's, line for line."""
    settings = fanout_settings(endpoint, shard_lines=4, max_receive_count=2)
    states = ["A", "B", "C", "D", *["POISON"] * 4, "E", "F", "G", "H"]
    body = "\n".join(decision_line(i, state=s) for i, s in enumerate(states)).encode()
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        etag = await _put(s3, "incoming/poison.jsonl", body)
        keys = outputs(settings, "incoming/poison.jsonl", etag)
        consumer, registry = await make_consumer(settings, s3, sqs, PoisonEngine())
        await run_until_done([consumer], s3, sqs, stack["queue_url"], keys.summary)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
        records = stripped(await read_object(s3, "jobs", keys.results))
        progress = json.loads(await read_object(s3, "jobs", status.status_key(keys)))
        dead = await receive_all(sqs, stack["dlq_url"], wait=1)
        alone = stripped(await single_path(s3, settings, "incoming/poison.jsonl", PoisonEngine()))
    assert records == alone  # poison lines are engine_failure records, good lines are scored
    assert summary["shards"]["failed"] == [] and summary["errors_by_code"] == {"engine_failure": 4}
    assert [(r["id"], r["error"]["code"]) for r in records[4:8]] == [
        (f"d{i}", "engine_failure") for i in range(4, 8)
    ]
    assert progress["state"] == "done" and dead == []
    assert sample([registry], "arbiter_worker_jobs_total", outcome="failed") == 1  # try 1 stopped


class SlowOnSlow(FakeEngine):
    """Takes a second per decision whose state is ``SLOW``."""

    def score(self, decisions: Any) -> Any:
        time.sleep(sum(d.state == "SLOW" for d in decisions))
        return super().score(decisions)


async def test_a_shard_whose_lease_is_lost_at_its_last_receive_fails_and_the_job_finishes(
    endpoint: str,
) -> None:
    # SQS's 12 h limit, here 4 s: shard 1 needs 8 s on its one allowed receive.
    settings = fanout_settings(
        endpoint,
        shard_lines=4,
        max_receive_count=1,
        visibility_timeout_s=2,
        heartbeat_s=0.5,
        chunk_decisions=1,
    )
    states = ["A", "B", "C", "D", *["SLOW"] * 4]
    body = "\n".join(decision_line(i, state=s) for i, s in enumerate(states)).encode()
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await _stack(s3, sqs, settings)
        etag = await _put(s3, "incoming/slow.jsonl", body)
        keys = outputs(settings, "incoming/slow.jsonl", etag)
        consumer, registry = await make_consumer(
            settings, s3, sqs, SlowOnSlow(), visibility_limit_s=4
        )
        await run_until_done([consumer], s3, sqs, stack["queue_url"], keys.summary)
        summary = json.loads(await read_object(s3, "jobs", keys.summary))
        dead = await receive_all(sqs, stack["dlq_url"], wait=1)
        records = stripped(await read_object(s3, "jobs", keys.results))
    [failed] = summary["shards"]["failed"]
    assert failed["index"] == 1 and "visibility limit" in failed["error"]
    assert summary["ok"] == 4 and summary["errors_by_code"] == {"shard_failed": 4}
    assert [(r["line"], r["id"], r["error"]["code"]) for r in records[4:]] == [
        (i + 1, f"d{i}", "shard_failed") for i in range(4, 8)
    ]
    assert [json.loads(m["Body"])["index"] for m in dead] == [1]  # one copy, as a record
    assert sample([registry], "arbiter_worker_dlq_moves_total", reason="shard_failed") == 1


async def test_submit_shows_the_progress_of_a_split_job_then_its_summary(
    endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from worker.submit import submit

    settings = fanout_settings(endpoint, shard_lines=5, chunk_decisions=1)
    job = tmp_path / "progress.jsonl"
    job.write_text("\n".join(decision_line(i, state=f"S{i}") for i in range(40)))
    async with aws_clients(endpoint) as (s3, sqs):
        await _stack(s3, sqs, settings)
        made = [await make_consumer(settings, s3, sqs, FakeEngine(delay_s=0.02)) for _ in "ab"]
        tasks = [asyncio.create_task(c.run()) for c, _ in made]
        try:
            summary = await submit(settings, job, timeout_s=60)
        finally:
            for consumer, _ in made:
                consumer.stop()
            await asyncio.gather(*tasks)
    err = capsys.readouterr().err
    assert summary is not None and summary["lines"] == 40 and summary["shards"]["count"] == 8
    assert "8/8 shards" in err and "40/40" in err


# -- the merge's part plan -------------------------------------------------------------------------


@given(
    sizes=st.lists(st.integers(0, 40), max_size=30),
    copy_bits=st.lists(st.booleans(), min_size=30, max_size=30),
    target=st.integers(5, 16),
)
def test_every_part_but_the_last_is_at_least_the_minimum(
    sizes: list[int], copy_bits: list[bool], target: int
) -> None:
    copyable = copy_bits[: len(sizes)]
    parts = plan_parts(sizes, copyable, target, min_part=5)
    flat = [p for part in parts for p in part.pieces]
    joined = [(p.segment, p.start, p.end) for p in flat]
    expected: list[int] = []
    for seg, size in enumerate(sizes):
        expected += [seg] * size
    assert [seg for seg, start, end in joined for _ in range(start, end)] == expected
    assert all(a[2] == b[1] for a, b in itertools.pairwise(joined) if a[0] == b[0])
    assert all(part.size >= 5 for part in parts[:-1])
    for part in parts:
        if part.copy:
            [piece] = part.pieces
            assert copyable[piece.segment] and part.size >= 5
        else:
            assert part.size <= target + 5
    # Every copyable segment of at least 10 is mostly copied, never downloaded whole.
    for seg, size in enumerate(sizes):
        if copyable[seg] and size >= 10:
            copied = sum(p.size for p in parts if p.copy and p.pieces[0].segment == seg)
            assert copied >= size - 5


def _outcome(index: int, key: str, size: int) -> dict[str, Any]:
    return ShardOutcome(
        index=index, state="done", attempt="a", output=key, bytes=size, lines=1, ok=1, failed=0
    ).model_dump(mode="json")


async def test_the_merge_copies_large_outputs_inside_s3_and_joins_small_ones(endpoint: str) -> None:
    """moto refuses a part under 5 MiB that is not the last (EntityTooSmall), as S3 does."""
    settings = fanout_settings(endpoint)
    # 1 MiB is joined with the first 4 MiB of the 12 MiB output, whose other 8 MiB are copied; the
    # 7 MiB output is copied whole; 100 kB + 5.5 MiB + 3 kB are joined (5.5 MiB cannot both top up
    # the part before it and leave 5 MiB to copy); the 6 MiB output is copied; the last 2 MiB joined.
    sizes = [1 * MiB, 12 * MiB, 7 * MiB + 3, 100_000, 5 * MiB + 512 * 1024, 3000, 6 * MiB, 2 * MiB]
    async with aws_clients(endpoint) as (s3, sqs):
        await _stack(s3, sqs, settings)
        folder = job_folder(settings, "jobs", "incoming/parts.jsonl", "e" * 32)
        keys = outputs(settings, "incoming/parts.jsonl", "e" * 32)
        expected = b""
        spans = []
        for i, size in enumerate(sizes):
            line = f'{{"shard": {i}, "pad": "'.encode()
            data = (line + b"x" * (size - len(line) - 3) + b'"}\n')[:size]
            expected += data
            await s3.put_object(Bucket="jobs", Key=folder.output(i, "a"), Body=data)
            await s3.put_object(
                Bucket="jobs",
                Key=folder.outcome(i),
                Body=json.dumps(_outcome(i, folder.output(i, "a"), size)).encode(),
            )
            spans.append(ShardSpan(index=i, first=i + 1, last=i + 1, items=1, bytes=0))
        manifest = Manifest(
            plan="ab12" * 4,
            writer="w",
            input={"bucket": "jobs", "key": "incoming/parts.jsonl", "etag": "e" * 32},
            kind="line",
            shard_lines=1,
            items=len(sizes),
            shards=spans,
            created_at="2026-01-01T00:00:00+00:00",
            created_ts=time.time(),
        )
        summary = await Merger(s3, settings).merge(manifest, keys, folder)
        merged = await read_object(s3, "jobs", keys.results)
        left = await list_keys(s3, "jobs", folder.base)
    assert merged == expected and left == []
    plan = summary["shards"]["merge"]
    assert plan["copied_parts"] == 3 and plan["copied_bytes"] == 8 * MiB + 7 * MiB + 3 + 6 * MiB
    assert plan["copied_bytes"] + plan["joined_bytes"] == sum(sizes)
    print(f"merge of {sum(sizes) / MiB:.1f} MiB: {plan}")


# -- small pieces ----------------------------------------------------------------------------------

items_strategy = st.lists(
    st.tuples(
        st.integers(1, 10**9),
        st.one_of(
            st.binary(max_size=300),
            st.builds(MalformedRequest, st.text(max_size=40), code=st.sampled_from(["x", "y"])),
            st.builds(PayloadTooLarge, st.text(max_size=40)),
        ),
    ),
    max_size=40,
)


@given(items=items_strategy, piece=st.integers(1, 64))
async def test_shard_inputs_read_back_as_written(items: list[Any], piece: int) -> None:
    data = b"".join(frame(n, v) for n, v in items)

    async def chunks() -> Any:
        for start in range(0, len(data), piece):
            yield data[start : start + piece]

    back = [x async for x in unframe(chunks())]
    assert [n for n, _ in back] == [n for n, _ in items]
    for (_, got), (_, sent) in zip(back, items, strict=True):
        if isinstance(sent, bytes):
            assert got == sent
        else:
            assert type(got) is type(sent) and got.to_dict() == sent.to_dict()


def test_the_status_counts_each_shard_once_and_keeps_a_final_state() -> None:
    spans = [ShardSpan(index=i, first=1, last=1, items=10, bytes=1) for i in range(9)]
    manifest = Manifest(
        plan="a" * 16,
        writer="w",
        input={},
        kind="line",
        shard_lines=10,
        items=90,
        shards=spans,
        created_at="2026-01-01T00:00:00+00:00",
        created_ts=1000.0,
        stripes=4,
    )
    keys = outputs(WorkerSettings(), "incoming/s.jsonl", "e")
    # Shard 8 is in stripe 0 (8 mod 4), with shards 0 and 4: its third.
    stripe = status.initial_stripe(manifest, 0)
    assert stripe["size"] == 3
    stripe = status.count_in_stripe(stripe, 8, 10, 1, False)
    assert stripe is not None and status.count_in_stripe(stripe, 8, 10, 1, False) is None
    assert status.snapshot(stripe) == [1, 0, 10, 1] and not status.stripe_complete(stripe)
    doc = status.fold(status.initial(manifest, keys), 0, status.snapshot(stripe), now=1010.0)
    assert doc is not None and status.fold(doc, 0, [1, 0, 10, 1]) is None  # not newer
    assert doc["lines"] == {"total": 90, "done": 10, "failed": 1} and doc["eta_s"] == 80.0
    for index in (0, 4):
        stripe = status.count_in_stripe(stripe, index, 10, 0, index == 4)
        assert stripe is not None
    assert status.stripe_complete(stripe) and status.snapshot(stripe) == [3, 1, 30, 1]
    doc = status.fold(doc, 0, status.snapshot(stripe))
    assert doc is not None and doc["shards"] == {"total": 9, "done": 2, "failed": 1}
    for k, size in ((1, 2), (2, 2), (3, 2)):  # shards 1, 5 / 2, 6 / 3, 7
        doc = status.fold(doc, k, [size, 0, 10 * size, 0])
        assert doc is not None
    assert doc["shards"]["done"] == 8 and doc["lines"]["done"] == 90
    summary = {"lines": 90, "failed": 3, "shards": {"count": 9, "failed": []}}
    final = status.final(summary, keys)
    assert final["state"] == "done" and final["lines"] == {"total": 90, "done": 90, "failed": 3}
    assert status.fold(final, 0, [3, 0, 30, 0]) is None  # no progress after the end


def test_a_shard_prefix_that_overlaps_jobs_or_results_is_refused() -> None:
    for prefix in ("incoming/", "incoming/shards/", "results/x/", "res"):
        with pytest.raises(ValidationError, match="shard_prefix"):
            WorkerSettings(shard_prefix=prefix)


def test_shard_messages_are_read_and_checked() -> None:
    body = {"arbiter_shard": 2, "bucket": "jobs", "key": "incoming/a.jsonl", "etag": "e"}
    body |= {"plan": "ab12" * 4, "index": 3, "count": 8}
    [ref] = parse_message(json.dumps(body), bucket="jobs", input_prefix="incoming/")
    assert ref == ShardRef("jobs", "incoming/a.jsonl", "e", "ab12" * 4, 3, 8)
    for bad in ({"index": 8}, {"plan": "../x"}, {"count": 0}, {"arbiter_shard": 0}):
        with pytest.raises(UnreadableMessage):
            parse_message(json.dumps(body | bad), bucket="jobs", input_prefix="incoming/")
    [ignored] = parse_message(json.dumps(body | {"bucket": "x"}), bucket="jobs", input_prefix="i/")
    assert not isinstance(ignored, ShardRef)
