"""Provisioning of the job bucket and queues: what `arbiter local`, the tests and the benchmark
create on a moto server (and what infrastructure code would create on AWS)."""

from __future__ import annotations

import json
from typing import Any

from botocore.exceptions import ClientError

from worker.settings import WorkerSettings
from worker.tries import REDRIVE_MARGIN

_EXISTS = {"QueueAlreadyExists", "QueueNameExists"}  # moto's code; AWS's query-compatible one


async def ensure_stack(s3: Any, sqs: Any, settings: WorkerSettings) -> dict[str, str]:
    """Create (idempotently) the bucket, the dead-letter queue, the job queue with a redrive
    policy to it, and the S3 -> SQS notification for objects created under the input prefix.
    The redrive allows REDRIVE_MARGIN receives more than the worker's own tries
    (:mod:`worker.tries`)."""
    try:
        await s3.create_bucket(Bucket=settings.bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in {
            "BucketAlreadyOwnedByYou",
            "BucketAlreadyExists",
        }:
            raise
    dlq_url = await ensure_queue(sqs, settings.dlq_name, {})
    dlq_arn = await _arn(sqs, dlq_url)
    redrive = {
        "deadLetterTargetArn": dlq_arn,
        "maxReceiveCount": str(settings.max_receive_count + REDRIVE_MARGIN),
    }
    queue_url = await ensure_queue(
        sqs,
        settings.queue_name,
        {
            "VisibilityTimeout": str(settings.visibility_timeout_s),
            "RedrivePolicy": json.dumps(redrive),
        },
    )
    queue_arn = await _arn(sqs, queue_url)
    await s3.put_bucket_notification_configuration(
        Bucket=settings.bucket,
        NotificationConfiguration={
            "QueueConfigurations": [
                {
                    "Id": "arbiter-jobs",
                    "QueueArn": queue_arn,
                    "Events": ["s3:ObjectCreated:*"],
                    "Filter": {
                        "Key": {"FilterRules": [{"Name": "prefix", "Value": settings.input_prefix}]}
                    },
                }
            ]
        },
    )
    return {"queue_url": queue_url, "dlq_url": dlq_url, "queue_arn": queue_arn}


async def _arn(sqs: Any, url: str) -> str:
    attrs = await sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])
    return str(attrs["Attributes"]["QueueArn"])


async def ensure_queue(sqs: Any, name: str, attributes: dict[str, str]) -> str:
    """The queue ``name`` with ``attributes``: created, or, when it exists with others (a setting
    changed since it was made, or a kept local state: CreateQueue then answers QueueAlreadyExists,
    on AWS as in moto), given them. Its messages stay."""
    try:
        return str((await sqs.create_queue(QueueName=name, Attributes=attributes))["QueueUrl"])
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in _EXISTS:
            raise
    url = str((await sqs.get_queue_url(QueueName=name))["QueueUrl"])
    if attributes:
        await sqs.set_queue_attributes(QueueUrl=url, Attributes=attributes)
    return url
