"""A versioned bucket, as AWS runs it (issue 27): its notifications carry ``versionId``, and a read
that names a version needs ``s3:GetObjectVersion``, which the worker's role has not got. moto sends
no ``versionId`` and enforces no IAM, so the test puts both back: the notifications are re-sent
with the version S3 gave the object, and the proxy answers any request that names a version 403
``AccessDenied``. Before issue 27 the worker read with ``VersionId``: on AWS every job on such a
bucket was dead-lettered."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote_plus

from tests.aws import aws_clients, read_object, s3_notification
from tests.fakes import FakeEngine
from tests.faults.fleet import Fleet
from tests.faults.invariants import violations
from tests.faults.proxy import Call
from tests.faults.scenarios import (
    Rule,
    drop,
    fault_settings,
    finished,
    numbered_body,
    rules,
    versioned_stack,
)
from worker.outputs import output_keys


async def _as_aws_sends_it(s3: Any, sqs: Any, url: str) -> str:
    """Take moto's next notification off the queue and send it again with the object's
    ``versionId`` in each record; the version."""
    message = await s3_notification(sqs, url)
    await sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
    doc = json.loads(message["Body"])
    version = ""
    for record in doc["Records"]:
        obj = record["s3"]["object"]
        head = await s3.head_object(Bucket="jobs", Key=unquote_plus(obj["key"]))
        obj["versionId"] = version = head["VersionId"]
    await sqs.send_message(QueueUrl=url, MessageBody=json.dumps(doc))
    return version


async def test_jobs_on_a_versioned_bucket_run_under_a_role_without_get_object_version(
    endpoint: str,
) -> None:
    settings = fault_settings(endpoint)

    def names_a_version(call: Call) -> bool:
        return call.service == "s3" and call.version

    decide = rules(Rule(names_a_version, "deny", times=10**6))
    bodies = {
        "incoming/v-small.jsonl": numbered_body(3),
        "incoming/v-split.jsonl": numbered_body(12),
    }
    async with aws_clients(endpoint) as (s3, sqs):
        stack = await versioned_stack(s3, sqs, settings)
        jobs, versions = [], []
        for key, body in bodies.items():
            jobs.append(await drop(s3, settings, key, body))
            versions.append(await _as_aws_sends_it(s3, sqs, stack["queue_url"]))
        async with Fleet(endpoint, settings, decide, 2, lambda n: FakeEngine()) as fleet:
            await fleet.run_until(finished(s3, sqs, stack, settings, jobs), 45)
        bad = await violations(s3, sqs, stack, settings, jobs)
        summaries = [
            json.loads(await read_object(s3, "jobs", output_keys(settings, j.key, j.etag).summary))
            for j in jobs
        ]
    assert bad == []
    assert fleet.proxy.counts["deny"] == 0  # no request named a version
    assert [s["lines"] for s in summaries] == [3, 12] and "shards" in summaries[1]
    assert all(v for v in versions)
