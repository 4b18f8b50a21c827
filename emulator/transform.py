"""Batch Transform's data plane, run here over the local S3 (`arbiter transform`).

For each object under the input prefix, as SageMaker does on an instance: the records
(``SplitType=Line``: lines) are posted to the container's ``/invocations`` in mini-batches
(``MultiRecord``: as many whole records as fit in ``MaxPayloadInMB``; ``SingleRecord``: one), with at
most ``MaxConcurrentTransforms`` requests at once across the job; the answers are assembled in input
order (``AssembleWith=Line``: each ends with a newline) into ``<output>/<key>.out``. Parameters the
job leaves unset come from the container's ``GET /execution-parameters``, then SageMaker's defaults.

The failure rules are the job's: a 5xx, a timeout or a broken connection is retried
``InvocationsMaxRetries`` times; a 4xx, a retry budget spent, a record over ``MaxPayloadInMB`` or an
unreadable object fails the job. The objects already written stay; the failed one and those in
progress are not written (a multipart upload is aborted). A bad *line* is not a failure: the
container answers it with an error record in its place, so the ``.out`` keeps one line per line.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from arbiter.settings import MB
from emulator.s3io import ObjectWriter, S3Uri, parse_uri
from infra.transform import TransformJob

DEFAULTS = {"MaxConcurrentTransforms": 1, "MaxPayloadInMB": 6, "BatchStrategy": "SingleRecord"}
_STRATEGY = {"MULTI_RECORD": "MultiRecord", "SINGLE_RECORD": "SingleRecord"}


class JobFailed(Exception):
    """The transform job failed; the message is its FailureReason."""


@dataclass(frozen=True)
class Resolved:
    max_concurrent: int
    max_payload_bytes: int  # 0: no limit
    strategy: str


@dataclass
class ObjectResult:
    input: str
    output: str
    records: int = 0
    mini_batches: int = 0
    bytes_out: int = 0


@dataclass
class JobResult:
    name: str
    status: str = "InProgress"
    failure_reason: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    objects: list[ObjectResult] = field(default_factory=list)
    seconds: float = 0.0

    def describe(self) -> dict[str, Any]:
        """A DescribeTransformJob-like summary."""
        out: dict[str, Any] = {
            "TransformJobName": self.name,
            "TransformJobStatus": self.status,
            **self.parameters,
            "Objects": [vars(o) for o in self.objects],
            "Seconds": round(self.seconds, 3),
        }
        if self.failure_reason:
            out["FailureReason"] = self.failure_reason
        return out


async def resolve(job: TransformJob, http: aiohttp.ClientSession, container_url: str) -> Resolved:
    """The job's values, else the container's ``/execution-parameters``, else the defaults."""
    offered: dict[str, Any] = {}
    try:
        async with http.get(container_url.rstrip("/") + "/execution-parameters") as response:
            if response.status == 200:
                offered = await response.json()
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


async def _lines(s3: Any, uri: S3Uri, gzip: bool) -> AsyncIterator[bytes]:
    """The object's lines, each with its newline (the last one may lack it)."""
    got = await s3.get_object(Bucket=uri.bucket, Key=uri.key)
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
    pending = b""
    async with got["Body"] as body:
        while chunk := await body.read(1024 * 1024):
            data = inflate.decompress(chunk) if inflate else chunk
            pending += data
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line + b"\n"
    if inflate:
        pending += inflate.flush()
    if pending:
        yield pending


async def mini_batches(
    lines: AsyncIterator[bytes], resolved: Resolved, split: str
) -> AsyncIterator[tuple[bytes, int]]:
    """(payload, records) per request."""
    limit = resolved.max_payload_bytes
    batch: list[bytes] = []
    size = 0
    async for line in lines:
        if limit and len(line) > limit:
            raise JobFailed(
                f"ClientError: a record of {len(line)} bytes is over MaxPayloadInMB "
                f"({limit // MB} MB)"
            )
        single = split == "Line" and resolved.strategy == "SingleRecord"
        if batch and (single or (split == "Line" and limit and size + len(line) > limit)):
            yield b"".join(batch), sum(1 for b in batch if b.strip())
            batch, size = [], 0
        batch.append(line)
        size += len(line)
    if batch:
        if split == "None" and limit and size > limit:
            raise JobFailed(f"ClientError: an object of {size} bytes is over MaxPayloadInMB")
        yield b"".join(batch), sum(1 for b in batch if b.strip())


class Transform:
    """One job's run: its slots, its objects, its first failure."""

    def __init__(
        self, job: TransformJob, resolved: Resolved, s3: Any, http: aiohttp.ClientSession, url: str
    ) -> None:
        self.job = job
        self.resolved = resolved
        self.s3 = s3
        self.http = http
        self.url = url.rstrip("/") + "/invocations"
        self.slots = asyncio.Semaphore(resolved.max_concurrent)

    async def invoke(self, payload: bytes) -> bytes:
        """One mini-batch, retried as the job's ModelClientConfig says; slot released after."""
        job = self.job
        timeout = aiohttp.ClientTimeout(total=job.invocations_timeout_s)
        headers = {"Content-Type": job.content_type, "Accept": job.accept}
        last = ""
        try:
            for attempt in range(job.invocations_max_retries + 1):
                try:
                    async with self.http.post(
                        self.url, data=payload, headers=headers, timeout=timeout
                    ) as response:
                        body = await response.read()
                    if response.status < 400:
                        return body
                    last = f"Received {response.status} from the container: {body[:300]!r}"
                    if response.status < 500:
                        break  # a refusal is not retried: it would be refused again
                except (TimeoutError, aiohttp.ClientError) as exc:
                    last = f"the container did not answer ({type(exc).__name__}: {exc})"
                if attempt < job.invocations_max_retries:
                    await asyncio.sleep(min(2.0**attempt * 0.1, 2.0))
            raise JobFailed(f"ClientError: {last}")
        finally:
            self.slots.release()

    async def run_object(self, key: str, output: S3Uri) -> ObjectResult:
        source = S3Uri(parse_uri(self.job.input_uri).bucket, key)
        result = ObjectResult(str(source), str(output))
        writer = ObjectWriter(self.s3, output, self.job.accept)
        pending: deque[asyncio.Task[bytes]] = deque()
        try:
            lines = _lines(self.s3, source, self.job.compression == "Gzip")
            async for payload, records in mini_batches(lines, self.resolved, self.job.split_type):
                await self.slots.acquire()  # read no further ahead than there are slots
                pending.append(asyncio.create_task(self.invoke(payload)))
                result.records += records
                result.mini_batches += 1
                while pending and pending[0].done():
                    await self._assemble(writer, await pending.popleft())
            while pending:
                await self._assemble(writer, await pending.popleft())
            await writer.close()
        except BaseException:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await writer.abort()
            raise
        result.bytes_out = writer.bytes
        return result

    async def _assemble(self, writer: ObjectWriter, body: bytes) -> None:
        if self.job.assemble_with == "Line" and body and not body.endswith(b"\n"):
            body += b"\n"
        await writer.write(body)


async def input_keys(s3: Any, prefix: S3Uri) -> list[str]:
    keys: list[str] = []
    token: dict[str, str] = {}
    while True:
        got = await s3.list_objects_v2(Bucket=prefix.bucket, Prefix=prefix.key, **token)
        keys += [o["Key"] for o in got.get("Contents", []) if not o["Key"].endswith("/")]
        if not got.get("IsTruncated"):
            return keys
        token = {"ContinuationToken": got["NextContinuationToken"]}


def output_for(key: str, prefix: S3Uri, output: S3Uri) -> S3Uri:
    """``<output>/<key relative to the input prefix's folder>.out``."""
    folder = prefix.key[: prefix.key.rfind("/") + 1]
    return output.join(key[len(folder) :] + ".out")


async def run_transform(
    job: TransformJob, *, s3: Any, http: aiohttp.ClientSession, container_url: str
) -> JobResult:
    """Run the job; the result says Completed or Failed (with the reason), never raises for the
    job's own failures."""
    job.validate()
    started = time.perf_counter()
    result = JobResult(job.job_name())
    try:
        resolved = await resolve(job, http, container_url)
        result.parameters = {
            "BatchStrategy": resolved.strategy,
            "MaxPayloadInMB": resolved.max_payload_bytes // MB,
            "MaxConcurrentTransforms": resolved.max_concurrent,
        }
        prefix, output = parse_uri(job.input_uri), parse_uri(job.output_uri)
        keys = await input_keys(s3, prefix)
        if not keys:
            raise JobFailed(f"ClientError: no input objects under {job.input_uri}")
        transform = Transform(job, resolved, s3, http, container_url)
        objects = asyncio.Semaphore(resolved.max_concurrent)

        async def one(key: str) -> None:
            async with objects:
                done = await transform.run_object(key, output_for(key, prefix, output))
            result.objects.append(done)

        async with asyncio.TaskGroup() as group:
            for key in keys:
                group.create_task(one(key))
        result.objects.sort(key=lambda o: o.input)
        result.status = "Completed"
    except* JobFailed as failed:
        result.status = "Failed"
        result.failure_reason = str(failed.exceptions[0])
    except* Exception as broken:  # S3 refused, an object vanished: the job fails, saying why
        result.status = "Failed"
        first = broken.exceptions[0]
        result.failure_reason = f"ClientError: {type(first).__name__}: {first}"
    result.seconds = time.perf_counter() - started
    return result
