"""A fleet fast enough to make one key hot (issue 27, "Scale"): the counts of one job's shards are
striped, so many workers finishing shards at once contend on no key, and one of them sends the
merge message. Throughput itself is measured by ``python -m tests.worker.status_bench``, not here."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest

from tests.aws import aws_clients
from worker.fanout import status
from worker.fanout.keys import JobFolder
from worker.fanout.outcome import ShardOutcome
from worker.fanout.plan import Manifest, ShardSpan
from worker.outputs import OutputKeys
from worker.s3io import PreconditionFailed


def _manifest(shards: int) -> Manifest:
    spans = [
        ShardSpan(index=i, first=10 * i + 1, last=10 * i + 10, items=10, bytes=1)
        for i in range(shards)
    ]
    return Manifest(
        plan="c" * 16,
        writer="w",
        input={},
        kind="line",
        shard_lines=10,
        items=10 * shards,
        shards=spans,
        created_at="2026-01-01T00:00:00+00:00",
        created_ts=1000.0,
    )


def _outcome(index: int) -> ShardOutcome:
    return ShardOutcome(
        index=index, state="done", attempt="a", output="x", bytes=1, lines=10, ok=10, failed=0
    )


async def test_32_workers_counting_one_jobs_shards_at_once_contend_on_no_key(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 shards counted by 32 concurrent workers: no key loses more than a few compare-and-swaps
    (with one status object for the whole job, as before, it lost dozens), every shard is counted
    once, and exactly one count sends the merge message."""
    manifest = _manifest(64)
    folder = JobFolder("shards/scale/")
    keys = OutputKeys("results/s.results.jsonl", "results/s.summary.json")
    key = status.status_key(keys)
    lost: Counter[str] = Counter()
    put_json = status.put_json

    async def counted_put(s3: Any, bucket: str, name: str, doc: Any, **condition: str) -> str:
        try:
            return await put_json(s3, bucket, name, doc, **condition)
        except PreconditionFailed:
            lost[name] += 1
            raise

    monkeypatch.setattr(status, "put_json", counted_put)
    async with aws_clients(endpoint) as (s3, _):
        await s3.create_bucket(Bucket="jobs")
        await s3.put_object(
            Bucket="jobs", Key=key, Body=json.dumps(status.initial(manifest, keys)).encode()
        )
        await status.start_stripes(s3, "jobs", folder, manifest)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(manifest.count):
            queue.put_nowait(index)
        merges: list[int] = []

        async def worker() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                await s3.put_object(Bucket="jobs", Key=folder.outcome(index), Body=b"{}")
                if await status.count(s3, "jobs", key, folder, manifest, _outcome(index)):
                    merges.append(index)

        await asyncio.gather(*(worker() for _ in range(32)))
        stripes = [
            json.loads(
                await (await s3.get_object(Bucket="jobs", Key=folder.stripe(k)))["Body"].read()
            )
            for k in range(manifest.stripe_count)
        ]
        again = await status.count(s3, "jobs", key, folder, manifest, _outcome(merges[0]))
        other = await status.count(
            s3, "jobs", key, folder, manifest, _outcome((merges[0] + 1) % 64)
        )
    hottest = max((n for name, n in lost.items() if name != key), default=0)
    assert hottest <= 4, f"a stripe lost {hottest} compare-and-swaps: {lost.most_common(3)}"
    assert sum(status.snapshot(s)[0] for s in stripes) == 64
    assert len(merges) == 1  # one merge message, from the count that claimed it
    assert again is True and other is False  # the claimer's message back sends it again; no other


def test_only_an_input_whose_size_shows_it_fits_is_split_without_counting_first() -> None:
    from worker.fanout.split import MAX_SHARDS, fits_unread

    most = 2 * MAX_SHARDS * 10  # bytes: an item is at least two (one, and its newline)
    assert fits_unread("incoming/a.jsonl", most - 2, 10)
    assert not fits_unread("incoming/a.jsonl", most, 10)
    assert not fits_unread("incoming/a.jsonl.gz", 100, 10)  # inflates to anything
    assert not fits_unread("incoming/a.json", None, 10)


class _InFlight:
    """The most calls of a coroutine function in flight at once, each made to take ``delay_s``
    (a distant store)."""

    def __init__(self, function: Any, delay_s: float = 0.05) -> None:
        self.function, self.delay_s, self.now, self.most = function, delay_s, 0, 0

    async def __call__(self, *args: Any, **kw: Any) -> Any:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(self.delay_s)
            return await self.function(*args, **kw)
        finally:
            self.now -= 1


async def test_the_split_uploads_several_shard_inputs_at_once(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One at a time, each PUT's round trip was the split's pace; now UPLOADS go up at once while
    the next shard is read, and every shard input arrives."""
    from tests.fakes import decision_line
    from tests.worker.fanout_support import fanout_settings
    from worker.events import JobRef
    from worker.fanout import split
    from worker.jobs import Located, locate

    uploads = _InFlight(split.upload_spool)
    monkeypatch.setattr(split, "upload_spool", uploads)
    settings = fanout_settings(endpoint, shard_lines=4)
    body = "\n".join(decision_line(i, state=f"S{i}") for i in range(40)).encode()
    async with aws_clients(endpoint) as (s3, _):
        await s3.create_bucket(Bucket="jobs")
        await s3.put_object(Bucket="jobs", Key="incoming/wide.jsonl", Body=body)
        ref = JobRef("jobs", "incoming/wide.jsonl")
        found = await locate(s3, ref, settings)
        assert isinstance(found, Located)
        folder = JobFolder("shards/wide/")
        cut = await split.split_input(s3, found, folder, settings, 4)
        assert isinstance(cut, Manifest)
        inputs = [
            await s3.head_object(Bucket="jobs", Key=folder.input(cut.plan, s.index))
            for s in cut.shards
        ]
    assert cut.count == 10 and len(inputs) == 10
    assert uploads.most == split.UPLOADS > 1


async def test_the_merge_reads_the_pieces_of_a_part_several_at_once(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small shard outputs are read by ranged GETs and joined into a part: one at a time, each
    GET's round trip was the merge's pace; now PIECE_CONCURRENCY at once, joined in order."""
    from tests.worker.fanout_support import done_outputs, fanout_settings
    from worker.fanout import merge

    settings = fanout_settings(endpoint)
    keys = OutputKeys("results/m.results.jsonl", "results/m.summary.json")
    async with aws_clients(endpoint) as (s3, _):
        await s3.create_bucket(Bucket="jobs")
        outputs = [
            (f"shards/m/out/{i:05d}.jsonl", f'{{"line": {i}}}\n'.encode() * 50, 50)
            for i in range(12)
        ]
        outcomes = await done_outputs(s3, "jobs", outputs)
        merger = merge.Merger(s3, settings)
        reads = _InFlight(merger._read)
        monkeypatch.setattr(merger, "_read", reads)
        stats = await merger._results(keys, outcomes, "d")
        got = await (await s3.get_object(Bucket="jobs", Key=keys.results))["Body"].read()
    assert stats["parts"] == 1 and not stats["reused_results"]
    assert got == b"".join(f'{{"line": {i}}}\n'.encode() * 50 for i in range(12))
    assert reads.most == merge.PIECE_CONCURRENCY > 1
