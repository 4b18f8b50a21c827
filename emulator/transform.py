"""Batch Transform's data plane, run here over the local S3 (`arbiter transform`).

For each input object (under the prefix, or listed by a manifest: ``emulator.inputs``), as
SageMaker does on an instance (``emulator.objects``; with ``DataProcessing``, each record filtered
and its answer joined: ``emulator.dataprocessing``): the records
(``SplitType=Line``: lines) are posted to the container's ``/invocations`` in mini-batches
(``MultiRecord``: as many whole records as fit in ``MaxPayloadInMB``; ``SingleRecord``: one), with at
most ``MaxConcurrentTransforms`` requests at once across the job; the answers are assembled in input
order (``AssembleWith=Line``: each ends with a newline) into ``<output>/<key>.out``. Parameters the
job leaves unset come from the container's ``GET /execution-parameters``, then SageMaker's defaults.

The failure rules are the job's: a 5xx, a timeout or a broken connection is retried
``InvocationsMaxRetries`` times; a 4xx, a retry budget spent, a record over ``MaxPayloadInMB`` or an
unreadable object fails that object, and the job: the other objects go on and are written, as on
AWS; the failed one is not written (a multipart upload is aborted). A bad *line* is not a failure: the
container answers it with an error record in its place, so the ``.out`` keeps one line per line.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from arbiter.settings import MB
from emulator.dataprocessing import DataProcessing
from emulator.inputs import Input, InputsFailed, job_inputs
from emulator.objects import ObjectResult, Resolved, Transform
from emulator.transform_client import JobFailed
from infra.transform import TransformJob

DEFAULTS = {"MaxConcurrentTransforms": 1, "MaxPayloadInMB": 6, "BatchStrategy": "SingleRecord"}
_STRATEGY = {"MULTI_RECORD": "MultiRecord", "SINGLE_RECORD": "SingleRecord"}


@dataclass
class JobResult:
    name: str
    status: str = "InProgress"
    failure_reason: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    objects: list[ObjectResult] = field(default_factory=list)
    failed_objects: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    def describe(self) -> dict[str, Any]:
        """A DescribeTransformJob-like summary."""
        out: dict[str, Any] = {
            "TransformJobName": self.name,
            "TransformJobStatus": self.status,
            **self.parameters,
            "Objects": [vars(o) for o in self.objects],
            "FailedObjects": self.failed_objects,
            "Seconds": round(self.seconds, 3),
        }
        if self.failure_reason:
            out["FailureReason"] = self.failure_reason
        return out


async def resolve(job: TransformJob, http: aiohttp.ClientSession, container_url: str) -> Resolved:
    """The job's values, else the container's ``/execution-parameters``, else the defaults."""
    offered: dict[str, Any] = {}
    url = container_url.rstrip("/") + "/execution-parameters"
    # On AWS the container starts with the job's Environment, so an Arbiter container sizes its
    # MaxPayloadInMB to the job's InvocationsTimeoutInSeconds; the running one here is told it.
    sized = {"InvocationsTimeoutInSeconds": str(job.invocations_timeout_s)}
    try:
        for query in (sized, None):  # a container that refuses the query is asked plainly
            async with http.get(url, params=query) as response:
                if response.status == 200:
                    offered = await response.json()
                    break
    except aiohttp.ClientError as exc:
        raise JobFailed(
            f"ClientError: the container at {container_url} does not answer ({exc})"
        ) from exc
    payload = job.max_payload_mb
    if payload is None:
        payload = int(offered.get("MaxPayloadInMB", DEFAULTS["MaxPayloadInMB"]))
    concurrent = job.max_concurrent_transforms or int(
        offered.get("MaxConcurrentTransforms", DEFAULTS["MaxConcurrentTransforms"])
    )
    strategy = job.batch_strategy or _STRATEGY.get(
        str(offered.get("BatchStrategy")), str(DEFAULTS["BatchStrategy"])
    )
    return Resolved(max(1, concurrent), payload * MB, strategy)


def _reason(failure: BaseException) -> str:
    if isinstance(failure, (JobFailed, InputsFailed)):
        return str(failure)
    return f"ClientError: {type(failure).__name__}: {failure}"


async def run_transform(
    job: TransformJob, *, s3: Any, http: aiohttp.ClientSession, container_url: str
) -> JobResult:
    """Run the job; the result says Completed or Failed (with the reason), never raises for the
    job's own failures."""
    job.validate()
    processing = DataProcessing.of(job)  # what cannot run here is refused before anything runs
    started = time.perf_counter()
    result = JobResult(job.job_name())
    try:
        resolved = await resolve(job, http, container_url)
        result.parameters = {
            "BatchStrategy": resolved.strategy,
            "MaxPayloadInMB": resolved.max_payload_bytes // MB,
            "MaxConcurrentTransforms": resolved.max_concurrent,
        }
        inputs = await job_inputs(s3, job.data_type, job.input_uri, job.output_uri)
        transform = Transform(job, resolved, s3, http, container_url, processing)
        objects = asyncio.Semaphore(resolved.max_concurrent)

        async def one(item: Input) -> None:
            async with objects:
                done = await transform.run_object(item.source, item.output)
            result.objects.append(done)

        # Objects are independent, as on AWS: one that fails does not stop the others' uploads;
        # the job fails if any did, with the first failure (in input order) as its reason.
        outcomes = await asyncio.gather(*(one(item) for item in inputs), return_exceptions=True)
        failures = [(i, o) for i, o in zip(inputs, outcomes, strict=True) if o is not None]
        result.objects.sort(key=lambda o: o.input)
        for item, failure in failures:
            result.failed_objects.append({"input": str(item.source), "reason": _reason(failure)})
        if failures:
            raise failures[0][1]
        result.status = "Completed"
    except Exception as failed:  # S3 refused, an object vanished: the job fails, saying why
        result.status = "Failed"
        result.failure_reason = _reason(failed)
    result.seconds = time.perf_counter() - started
    return result
