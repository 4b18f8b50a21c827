"""One input object's run in a transform job: its mini-batches (held, at most
``MaxConcurrentTransforms`` in flight, their answers assembled in input order) or, where nothing
limits a request, the object streamed as one; the calls themselves, and their retries, are
:mod:`emulator.transform_client`'s.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from arbiter.settings import MB
from emulator.dataprocessing import DataProcessing, RecordFailed
from emulator.s3io import ObjectWriter, S3Uri
from emulator.splits import (
    MAX_PAYLOAD,
    SINGLE_RECORD_CAP,
    OverLimit,
    StreamedBody,
    mini_batches,
    object_chunks,
    records,
)
from emulator.transform_client import JobFailed, TransformClient
from infra.transform import TransformJob


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


class ReadAhead:
    """Bytes of request payloads read but not yet assembled, across the job: at most ``limit``
    (SageMaker's MaxConcurrentTransforms x MaxPayloadInMB bound), or one payload when it alone is
    larger."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.changed = asyncio.Condition()

    def fits(self, size: int) -> bool:
        return self.held == 0 or self.held + size <= self.limit

    async def take(self, size: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.fits(size))
            self.held += size

    async def give(self, size: int) -> None:
        async with self.changed:
            self.held -= size
            self.changed.notify_all()


@dataclass
class Pending:
    """A mini-batch in flight: its request, its size in the read-ahead, and (with DataProcessing)
    its records as read and the number of the first."""

    task: asyncio.Task[bytearray]
    size: int
    originals: list[bytes]
    first: int


class Transform:
    """One job's run: its slots, its read-ahead, its objects."""

    def __init__(
        self,
        job: TransformJob,
        resolved: Resolved,
        s3: Any,
        http: aiohttp.ClientSession,
        url: str,
        processing: DataProcessing,
    ) -> None:
        self.job = job
        self.processing = processing
        self.resolved = resolved
        self.s3 = s3
        self.client = TransformClient(job, http, url, resolved.max_concurrent)
        self.read_ahead = ReadAhead(MAX_PAYLOAD)
        self.gzip = job.compression == "Gzip"
        limit = resolved.max_payload_bytes
        # What has no limit is never gathered: the object is one request, streamed.
        self.streams = job.split_type == "None" or (
            limit == 0 and resolved.strategy == "MultiRecord" and not processing.active
        )

    async def run_object(self, source: S3Uri, output: S3Uri) -> ObjectResult:
        if self.streams:
            return await self._streamed(source, output)
        return await self._batched(source, output)

    async def _batched(self, source: S3Uri, output: S3Uri) -> ObjectResult:
        """Records gathered into mini-batches, at most MaxConcurrentTransforms of them in flight
        and read ahead, their answers assembled in input order."""
        result = ObjectResult(str(source), str(output))
        writer = ObjectWriter(self.s3, output, self.job.accept)
        pending: deque[Pending] = deque()
        limit = self.resolved.max_payload_bytes
        single = self.job.split_type == "Line" and self.resolved.strategy == "SingleRecord"
        kept: deque[bytes] = deque()  # with DataProcessing: each record as read, for its answer
        try:
            lines = records(object_chunks(self.s3, source, self.gzip), limit or SINGLE_RECORD_CAP)
            if self.processing.active:
                lines = self._processed(lines, kept)
            async for payload, count in mini_batches(lines, limit or MAX_PAYLOAD, single):
                # The answers wait for the one before them: read no further ahead than there are
                # slots, nor than the job's read-ahead holds (assembling frees it).
                while pending and (
                    len(pending) >= self.resolved.max_concurrent
                    or not self.read_ahead.fits(len(payload))
                ):
                    await self._assemble(writer, pending.popleft())
                await self.read_ahead.take(len(payload))
                await self.client.slots.acquire()
                task = asyncio.create_task(self.client.invoke(payload))
                originals = [kept.popleft() for _ in range(count)] if self.processing.active else []
                pending.append(Pending(task, len(payload), originals, result.records + 1))
                result.records += count
                result.mini_batches += 1
                while pending and pending[0].task.done():
                    await self._assemble(writer, pending.popleft())
            while pending:
                await self._assemble(writer, pending.popleft())
            await writer.close()
        except BaseException as failed:
            for held in pending:
                held.task.cancel()
                await self.read_ahead.give(held.size)
            await asyncio.gather(*(held.task for held in pending), return_exceptions=True)
            await writer.abort()
            if isinstance(failed, (OverLimit, RecordFailed)):
                raise JobFailed(f"ClientError: {failed}") from failed
            raise
        result.bytes_out = writer.bytes
        return result

    async def _processed(
        self, lines: AsyncIterator[bytes], kept: deque[bytes]
    ) -> AsyncIterator[bytes]:
        """Each record as InputFilter selects it (blank lines are no records), the record itself
        kept for its answer."""
        number = 0
        async for line in lines:
            if line.strip():
                number += 1
                kept.append(line)
                yield self.processing.request_line(line, number)

    async def _assemble(self, writer: ObjectWriter, held: Pending) -> None:
        try:
            body = await held.task
        finally:
            await self.read_ahead.give(held.size)
        if self.processing.active:
            await self._joined(writer, held, body)
            return
        await writer.write(body)
        if self.job.assemble_with == "Line" and body and not body.endswith(b"\n"):
            await writer.write(b"\n")

    async def _joined(self, writer: ObjectWriter, held: Pending, body: bytearray) -> None:
        """One written record per record sent: its answer joined and filtered."""
        answers = bytes(body).split(b"\n")
        if answers and not answers[-1].strip():
            answers.pop()
        if len(answers) != len(held.originals):
            raise RecordFailed(
                f"the container answered {len(answers)} lines for records {held.first}-"
                f"{held.first + len(held.originals) - 1}: DataProcessing needs one per record"
            )
        end = b"\n" if self.job.assemble_with == "Line" else b""
        for number, (record, answer) in enumerate(
            zip(held.originals, answers, strict=True), held.first
        ):
            await writer.write(self.processing.output_line(record, answer, number) + end)

    async def _streamed(self, source: S3Uri, output: S3Uri) -> ObjectResult:
        """The object as one request whose body is streamed from S3 (re-read for each try) and
        whose answer is streamed into the output: neither is ever held whole."""
        limit = self.resolved.max_payload_bytes
        headers = self.client.headers()
        if not self.gzip:  # the size is known before a byte is read: check it first
            head = await self.s3.head_object(Bucket=source.bucket, Key=source.key)
            size = int(head["ContentLength"])
            if limit and size > limit:
                raise JobFailed(
                    f"ClientError: an object of {size} bytes is over MaxPayloadInMB "
                    f"({limit // MB} MB)"
                )
            if limit:  # sent with its length; MaxPayloadInMB=0 is sent chunked, as on AWS
                headers["Content-Length"] = str(size)
        result = ObjectResult(str(source), str(output), mini_batches=1)

        async def once() -> ObjectWriter:
            body = StreamedBody(object_chunks(self.s3, source, self.gzip), limit)
            writer = ObjectWriter(self.s3, output, self.job.accept)
            try:
                await self.client.stream(body, headers, writer)
                await writer.close()
            except BaseException as exc:
                await writer.abort()
                if body.over is not None:
                    raise JobFailed(f"ClientError: {body.over}") from exc
                raise
            result.records = 1 if self.job.split_type == "None" else body.records
            return writer

        await self.client.slots.acquire()
        try:
            result.bytes_out = (await self.client.retried(once)).bytes
        finally:
            self.client.slots.release()
        return result
