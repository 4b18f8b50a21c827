"""How much bounded concurrency gains the split and the merge of one job, through the fault proxy
with added latency (issue 27, "Scale"): each step run twice in one run, one request at a time (as
before) and with the worker's bounds, and the ratio of their times.

- ``split``: :func:`worker.fanout.split.split_input` of one job into ``--shards`` shard inputs, with
  one upload in flight (before) and :data:`~worker.fanout.split.UPLOADS`;
- ``merge``: the merge's results upload (:meth:`worker.fanout.merge.Merger._results`) of
  ``--shards`` outputs of ``--output-kb`` each (small outputs are read by ranged GETs and joined into
  parts), one GET in flight per part (before) and
  :data:`~worker.fanout.merge.PIECE_CONCURRENCY`.

moto in a thread stands in for S3 (in tests/, not bench/: the proxy and moto are not in the wheel).

    python -m tests.worker.fanout_bench --shards 64 --latency-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from botocore.config import Config

from tests.aws import CREDS, moto_endpoint
from tests.faults.proxy import FaultProxy
from tests.worker.fanout_support import done_outputs
from worker.events import JobRef
from worker.fanout import merge, split
from worker.fanout.keys import JobFolder
from worker.fanout.outcome import ShardOutcome
from worker.fanout.plan import Manifest
from worker.jobs import Located, locate
from worker.outputs import OutputKeys
from worker.settings import WorkerSettings

BUCKET = "fanbench"


def _line(i: int) -> str:
    options = [{"id": "a", "label": "A"}, {"id": "b", "label": "B"}]
    return json.dumps({"id": f"d{i}", "state": {"n": i}, "question": "?", "options": options})


async def _split(s3: Any, settings: WorkerSettings, ref: JobRef, run: int) -> float:
    found = await locate(s3, ref, settings)
    assert isinstance(found, Located)
    folder = JobFolder(f"shards/bench-{run}/")
    started = time.perf_counter()
    cut = await split.split_input(s3, found, folder, settings, settings.shard_lines)
    assert isinstance(cut, Manifest)
    return time.perf_counter() - started


async def _merge(
    s3: Any, settings: WorkerSettings, outcomes: list[ShardOutcome], run: int
) -> float:
    keys = OutputKeys(f"results/bench-{run}.results.jsonl", f"results/bench-{run}.summary.json")
    merger = merge.Merger(s3, settings)
    started = time.perf_counter()
    await merger._results(keys, outcomes, f"digest-{run}")
    return time.perf_counter() - started


async def measure(shards: int, latency_s: float, output_kb: int) -> dict[str, Any]:
    proxy = FaultProxy(moto_endpoint(), latency_s=latency_s)
    await proxy.start()
    url = await proxy.endpoint(1)
    lines = 50
    settings = WorkerSettings(aws_endpoint_url=url, bucket=BUCKET, shard_lines=lines)
    rows: dict[str, dict[str, float]] = {}
    try:
        from aiobotocore.session import get_session

        config = Config(max_pool_connections=32, retries={"mode": "standard"})
        kw = {"region_name": "us-east-1", "endpoint_url": url, "config": config, **CREDS}
        async with get_session().create_client("s3", **kw) as s3:
            await s3.create_bucket(Bucket=BUCKET)
            body = "\n".join(_line(i) for i in range(shards * lines)).encode()
            await s3.put_object(Bucket=BUCKET, Key="incoming/job.jsonl", Body=body)
            ref = JobRef(BUCKET, "incoming/job.jsonl")
            data = (b"x" * 99 + b"\n") * (output_kb * 1024 // 100)
            outputs = [(f"shards/out/{i:05d}.jsonl", data, 1) for i in range(shards)]
            outcomes = await done_outputs(s3, BUCKET, outputs)
            bounds = {"split": split.UPLOADS, "merge": merge.PIECE_CONCURRENCY}
            for run, (uploads, pieces) in enumerate(((1, 1), (bounds["split"], bounds["merge"]))):
                split.UPLOADS, merge.PIECE_CONCURRENCY = uploads, pieces
                name = "one at a time" if run == 0 else "bounded"
                rows[f"split, {name} ({uploads})"] = {
                    "seconds": round(await _split(s3, settings, ref, run), 2)
                }
                rows[f"merge, {name} ({pieces})"] = {
                    "seconds": round(await _merge(s3, settings, outcomes, run), 2)
                }
            split.UPLOADS, merge.PIECE_CONCURRENCY = bounds["split"], bounds["merge"]
    finally:
        await proxy.close()
    names = list(rows)
    for before, after in (names[0::2], names[1::2]):
        rows[after]["speedup"] = round(rows[before]["seconds"] / rows[after]["seconds"], 2)
    return {
        "shards": shards,
        "latency_ms": round(latency_s * 1000),
        "output_kb": output_kb,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.worker.fanout_bench")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--output-kb", type=int, default=200)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.shards, args.latency_ms / 1000, args.output_kb))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
