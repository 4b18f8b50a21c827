"""Exactly one dead-letter record per failed shard, sent at the job's end from its summary alone.

The summary is the job's one true end: written once, and the only thing left of the job once its
folder is gone. So the records are made from the failed shards it lists, and by the end
(:meth:`~worker.fanout.merge.Merger.finalize`), not by the receives that failed a shard: a record
can then never name a shard the results hold as done (a failing worker whose outcome lost to
another's after the clean-up), and never be missing for a shard that failed (its worker died
before the record, and the merge and the clean-up ran before its message came back).

Several workers may run the end at once (the merge and a late shard message). The one that sends
is the one that claims ``<name>.<etag>.dead-letters.json`` beside the summary: created with
``If-None-Match: *``, or taken over with ``If-Match`` once an earlier claim is older than the
visibility timeout (its claimer died); the claimer sends the records and then marks the object
``sent``. An end that finds a fresh claim of another raises :class:`RecordsInFlight` (an end-of-job
race, :class:`worker.faults.Busy`: its message comes back after a backoff, spending no try and
opening no breaker) rather than go on to delete the job's folder, so the job is never ended while
its records are unsent: if that claimer died, the next run of the end takes its claim over. A
claimer killed after sending and before its mark, and a send whose answer was lost (botocore sends
it again), are the ways a record comes twice; none is ever lost.

The claim names the run it is for (the summary's ``finished_at``): a re-run of the same input (its
outputs deleted, its notification sent again) writes a summary of its own, and a claim or a
``sent`` mark of an earlier run is taken over like a stale one (else the first run's mark would
outlive it, and a re-run's failed shard would get no record). A claim that names no run (an older
worker's) is taken as this run's.

Each record is the shard's message (``{"arbiter_shard": 2, ...}``: what failed, in the shape a
worker reads) with what the summary says about it: ``failed`` (its lines, the error, after how
many receives) and ``summary_key``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import structlog

from worker.events import PROTOCOL, ShardMessage
from worker.faults import Busy
from worker.outputs import OutputKeys
from worker.s3io import PreconditionFailed, WriteConflict, get_json, put_json, put_new

log = structlog.get_logger("arbiter.worker")


class RecordsInFlight(Busy):
    """Another end is sending this job's dead-letter records now: this one comes back later."""


def records_key(keys: OutputKeys) -> str:
    return keys.summary.removesuffix("summary.json") + "dead-letters.json"


def failed_record(summary: dict[str, Any], failed: dict[str, Any], summary_key: str) -> str:
    """The DLQ record of one failed shard (see the module doc)."""
    shards, source = summary["shards"], summary["input"]
    message = ShardMessage(
        arbiter_shard=PROTOCOL,
        bucket=source["bucket"],
        key=source["key"],
        etag=source["etag"],
        plan=shards["plan"],
        index=failed["index"],
        count=shards["count"],
    )
    record = {**message.model_dump(mode="json"), "failed": failed, "summary_key": summary_key}
    return json.dumps(record)


class DeadLetters:
    """Sends a finished job's records once (see the module doc)."""

    def __init__(
        self, s3: Any, sqs: Any, bucket: str, dlq_url: str | None, stale_s: float, metrics: Any
    ) -> None:
        self.s3, self.sqs, self.bucket, self.dlq_url = s3, sqs, bucket, dlq_url
        self.stale_s, self.metrics = stale_s, metrics

    async def send(self, keys: OutputKeys, summary: dict[str, Any]) -> None:
        failed = summary.get("shards", {}).get("failed", [])
        if not failed or self.dlq_url is None or self.sqs is None:
            return
        key = records_key(keys)
        run = summary.get("finished_at")
        claim = {"state": "sending", "by": uuid.uuid4().hex[:12], "at": time.time(), "run": run}
        if not await self._claim(key, claim):
            return
        for entry in failed:
            body = failed_record(summary, entry, keys.summary)
            await self.sqs.send_message(QueueUrl=self.dlq_url, MessageBody=body)
            if self.metrics is not None:
                self.metrics.dlq_moves.labels("shard_failed").inc()
        log.error("job.shards_dead_lettered", shards=[f["index"] for f in failed])
        sent = {"state": "sent", "by": claim["by"], "records": [f["index"] for f in failed]}
        sent["run"] = run
        await put_json(self.s3, self.bucket, key, sent)

    async def _claim(self, key: str, claim: dict[str, Any]) -> bool:
        """Whether this end is the one to send (see the module doc)."""
        for _ in range(10):
            got = await get_json(self.s3, self.bucket, key)
            if got is None:
                if await put_new(self.s3, self.bucket, key, claim):
                    return True
                continue
            found, etag = got
            ours = found.get("run", claim["run"]) == claim["run"]  # not an earlier run's
            if ours and found.get("state") == "sent":
                return False
            if ours and claim["at"] - float(found.get("at", 0)) < self.stale_s:
                raise RecordsInFlight(f"{key}: claimed by {found.get('by')}")
            try:
                await put_json(self.s3, self.bucket, key, claim, IfMatch=etag)
            except (PreconditionFailed, WriteConflict):
                continue
            return True
        raise RecordsInFlight(f"{key}: contended")
