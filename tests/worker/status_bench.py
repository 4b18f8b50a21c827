"""How fast one split job's shards can be counted, through the fault proxy with added latency (issue
27, "Scale"): shard completions per second at N concurrent workers, four ways in the same run.

- ``outcome only``: each completion is one PutObject of its own key (the shard's outcome), the
  ceiling of any design that writes an outcome per shard;
- ``one status (before)``: the outcome, then the count into the job's one status object, as the
  worker did it before the status was striped (a GET and an ``If-Match`` PUT of one key, again on a
  412 or 409; :func:`_count_once` keeps that code here as the baseline);
- ``striped status``: the outcome, then the worker's count now (:func:`worker.fanout.status.count`:
  the shard's stripe by compare-and-swap, then the status: until it lands for the count that
  completes a stripe, one try for the others);
- ``listing``: the outcome, then one ``ListObjectsV2`` of the outcomes (a page of up to 1,000 keys)
  to see whether the job is complete (what counting by listing would cost per shard).

What carries to AWS is what each way makes per shard, ``requests_per_shard`` and the counts that
``gave_up`` (``Contended``: each costs a receive and its requests again): those are properties of
the protocol. The speeds (shards/s, requests/s and their ratio to the ceiling) are the harness's:
moto in a thread, on whatever else the machine runs, serves every key at the same few dozen
requests a second (issue 36: the ceiling moved from 37 to 129 PUTs/s with the machine's load, where
50 ms of latency alone would allow ~580/s), so they are printed under ``harness`` and say nothing
of S3, which documents at least 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD requests a second
per prefix (``s3_documented_per_prefix``), and serializes conditional writes to one key.

    python -m tests.worker.status_bench --workers 32 --shards 256 --latency-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from botocore.config import Config

from tests.aws import CREDS, moto_endpoint
from tests.faults.proxy import Call, FaultProxy
from worker.fanout import status
from worker.fanout.keys import JobFolder
from worker.fanout.outcome import ShardOutcome
from worker.fanout.plan import Manifest, ShardSpan
from worker.outputs import OutputKeys

BUCKET = "bench"
STATUS = "results/job.status.json"
WAYS = ("outcome only", "one status (before)", "striped status", "listing")


def _manifest(shards: int) -> Manifest:
    spans = [
        ShardSpan(index=i, first=i * 100 + 1, last=i * 100 + 100, items=100, bytes=1)
        for i in range(shards)
    ]
    now = time.time()
    return Manifest(
        plan="b" * 16,
        writer="bench",
        input={"bucket": BUCKET, "key": "incoming/job.jsonl"},
        kind="line",
        shard_lines=100,
        items=shards * 100,
        shards=spans,
        created_at="",
        created_ts=now,
    )


def _initial_once(shards: int) -> dict[str, Any]:
    """The status before it was striped: one bitmap of every shard."""
    return {
        "state": "running",
        "shards": {"total": shards, "done": 0, "failed": 0},
        "lines": {"total": shards * 100, "done": 0, "failed": 0},
        "started_ts": time.time(),
        "counted": "00" * (-(-shards // 8)),
    }


def _count_once(doc: dict[str, Any], index: int) -> dict[str, Any] | None:
    """The count before the status was striped (worker.fanout.status.count_shard as it was)."""
    counted = bytearray.fromhex(doc["counted"])
    byte, bit = divmod(index, 8)
    if counted[byte] & (1 << bit):
        return None
    counted[byte] |= 1 << bit
    shards = {**doc["shards"], "done": doc["shards"]["done"] + 1}
    lines = {**doc["lines"], "done": doc["lines"]["done"] + 100}
    return {**doc, "shards": shards, "lines": lines, "counted": counted.hex()}


def _outcome(index: int) -> ShardOutcome:
    return ShardOutcome(
        index=index, state="done", attempt="a", output="x", bytes=1, lines=100, ok=100, failed=0
    )


async def _run(
    workers: int, shards: int, one: Callable[[int], Awaitable[None]]
) -> tuple[float, float]:
    """Complete ``shards`` shards with ``workers`` concurrent loops; (completions/s, seconds)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(shards):
        queue.put_nowait(index)

    async def loop() -> None:
        while not queue.empty():
            await one(queue.get_nowait())

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(workers)))
    seconds = time.perf_counter() - started
    return shards / seconds, seconds


async def measure(workers: int, shards: int, latency_s: float) -> dict[str, Any]:
    requests: dict[str, int] = {}
    row = [""]

    def seen(call: Call) -> str:
        requests[row[0]] = requests.get(row[0], 0) + 1
        return "forward"

    proxy = FaultProxy(moto_endpoint(), seen, latency_s=latency_s)
    await proxy.start()
    url = await proxy.endpoint(1)
    contended: dict[str, int] = {}  # counts that gave up after status.update's 25 tries
    counted: dict[str, int] = {}  # shards the status says are done, at the end
    merges: dict[str, int] = {}  # counts that found the job complete (would send the merge)
    try:
        from aiobotocore.session import get_session

        config = Config(max_pool_connections=workers * 2, retries={"mode": "standard"})
        kw = {"region_name": "us-east-1", "endpoint_url": url, "config": config, **CREDS}
        async with get_session().create_client("s3", **kw) as s3:
            await s3.create_bucket(Bucket=BUCKET)
            rows: dict[str, dict[str, float]] = {}
            manifest = _manifest(shards)
            keys = OutputKeys("results/job.results.jsonl", "results/job.summary.json")
            for name in WAYS:
                row[0] = name
                prefix = f"shards/{name.replace(' ', '-').strip('()')}/"
                folder = JobFolder(prefix)
                if name == "striped status":
                    await s3.put_object(
                        Bucket=BUCKET, Key=STATUS, Body=json.dumps(status.initial(manifest, keys))
                    )
                    await status.start_stripes(s3, BUCKET, folder, manifest)
                else:
                    await s3.put_object(
                        Bucket=BUCKET, Key=STATUS, Body=json.dumps(_initial_once(shards))
                    )

                async def one(index: int, name: str = name, folder: JobFolder = folder) -> None:
                    nonlocal contended, merges
                    await s3.put_object(Bucket=BUCKET, Key=folder.outcome(index), Body=b"x" * 200)
                    try:
                        if name == "one status (before)":
                            doc = await status.update(
                                s3, BUCKET, STATUS, lambda d: _count_once(d, index)
                            )
                            if doc is not None and doc["shards"]["done"] == shards:
                                merges[name] = merges.get(name, 0) + 1
                        elif name == "striped status":
                            done = await status.count(
                                s3, BUCKET, STATUS, folder, manifest, _outcome(index)
                            )
                            merges[name] = merges.get(name, 0) + bool(done)
                    except status.Contended:
                        contended[name] = contended.get(name, 0) + 1
                    if name == "listing":
                        await s3.list_objects_v2(Bucket=BUCKET, Prefix=folder.outcome_prefix)

                requests[name] = 0
                rate, seconds = await _run(workers, shards, one)
                rows[name] = {
                    "requests_per_shard": round(requests[name] / shards, 2),
                    "harness": {
                        "per_s": round(rate, 1),
                        "seconds": round(seconds, 2),
                        "requests_per_s": round(requests[name] / seconds, 1),
                    },
                }
                row[0] = ""
                if name != "outcome only" and name != "listing":
                    got = await s3.get_object(Bucket=BUCKET, Key=STATUS)
                    async with got["Body"] as body:
                        counted[name] = json.loads(await body.read())["shards"]["done"]
    finally:
        await proxy.close()
    ceiling = rows["outcome only"]["harness"]["per_s"]
    for name, row in rows.items():
        row["gave_up"] = contended.get(name, 0)
        row["harness"]["ratio"] = round(row["harness"]["per_s"] / ceiling, 3)
    return {
        "workers": workers,
        "shards": shards,
        "latency_ms": round(latency_s * 1000),
        "rows": rows,
        "status_counted": counted,
        # Counts that gave up after status.update's 25 tries (the worker retries their message).
        "status_contended_gave_up": contended,
        "merges_sent": merges,
        "s3_documented_per_prefix": S3_PER_PREFIX,
    }


# S3's documented request rates per prefix (Amazon S3 User Guide, "Best practices design patterns:
# optimizing Amazon S3 performance"): what a fleet may expect of the job folder's prefixes.
S3_PER_PREFIX = {"put_copy_post_delete_per_s": 3500, "get_head_per_s": 5500}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.worker.status_bench")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.workers, args.shards, args.latency_ms / 1000))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
