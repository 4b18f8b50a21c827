"""`arbiter check-fanout` on a local stack: a small split job runs and every check holds; a stack
that loses a line or leaves a shard behind is caught."""

from __future__ import annotations

import asyncio
import json

from tests.aws import aws_clients, read_object
from tests.fakes import FakeEngine
from tests.worker.support import make_consumer, settings_for
from worker.check import check_fanout, verify
from worker.fanout.keys import job_folder
from worker.outputs import output_keys
from worker.stack import ensure_stack


async def test_check_fanout_runs_a_split_job_and_every_check_holds(endpoint: str) -> None:
    settings = settings_for(endpoint, shard_lines=1000)  # the workers' size: the job asks for 8
    async with aws_clients(endpoint) as (s3, sqs):
        await ensure_stack(s3, sqs, settings)
        await s3.put_bucket_versioning(Bucket="jobs", VersioningConfiguration={"Status": "Enabled"})
        made = [await make_consumer(settings, s3, sqs, FakeEngine()) for _ in "ab"]
        tasks = [asyncio.create_task(c.run()) for c, _ in made]
        try:
            ok, checks = await check_fanout(
                settings, 30, 8, timeout_s=60, keep=True, progress=False
            )
        finally:
            for consumer, _ in made:
                consumer.stop()
            await asyncio.gather(*tasks)
        names = [what for what, _, _ in checks]
        failed = [c for c in checks if not c[1]]
        [summary_key] = [
            o["Key"]
            for o in (await s3.list_objects_v2(Bucket="jobs", Prefix="results/"))["Contents"]
            if o["Key"].endswith(".summary.json")
        ]
        summary = json.loads(await read_object(s3, "jobs", summary_key))
        # A lost line and a shard left behind are caught.
        key, etag = summary["input"]["key"], summary["input"]["etag"]
        keys = output_keys(settings, key, etag)
        records = (await read_object(s3, "jobs", keys.results)).splitlines()
        await s3.put_object(Bucket="jobs", Key=keys.results, Body=b"\n".join(records[1:]))
        folder = job_folder(settings, "jobs", key, etag)
        await s3.put_object(Bucket="jobs", Key=f"{folder.base}outcome/00000.json", Body=b"{}")
        tampered = {
            what for what, held, _ in await verify(s3, settings, key, etag, 30, 8) if not held
        }
    assert ok and failed == [], failed
    assert summary["shards"]["count"] == 4 and "the results written once" in names
    assert "the dead-letter queue did not grow" in names
    assert {"one record per line, in order", "nothing left in the shard folder"} <= tampered
