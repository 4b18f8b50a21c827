"""A transform job's calls to the container, as SageMaker's agent makes them: the job's
``ContentType`` and ``Accept``, at most ``MaxConcurrentTransforms`` in flight (the slots), the
job's ``InvocationsTimeoutInSeconds``, and every request retried as its ``ModelClientConfig`` says
(a 5xx, a timeout or a broken connection tried again, a 4xx not).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

from emulator.container import INVENTED
from emulator.s3io import READ_BYTES, ObjectWriter
from emulator.splits import StreamedBody, slices
from infra.transform import TransformJob

T = TypeVar("T")


class JobFailed(Exception):
    """The transform job failed; the message is its FailureReason."""


class _Refused(Exception):
    """One attempt failed; ``retry`` says whether another may succeed (a 4xx would be refused
    again)."""

    def __init__(self, reason: str, retry: bool) -> None:
        super().__init__(reason)
        self.retry = retry


class TransformClient:
    """One job's connection to the container: its slots, its timeout, its retries."""

    def __init__(
        self, job: TransformJob, http: aiohttp.ClientSession, url: str, max_concurrent: int
    ) -> None:
        self.job = job
        self.http = http
        self.url = url.rstrip("/") + "/invocations"
        self.slots = asyncio.Semaphore(max_concurrent)
        self.timeout = aiohttp.ClientTimeout(total=job.invocations_timeout_s)

    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.job.content_type, "Accept": self.job.accept}

    async def retried(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt`` as the job's ModelClientConfig says: a 5xx, a timeout or a broken
        connection tried again ``InvocationsMaxRetries`` times, a 4xx not."""
        retries = self.job.invocations_max_retries
        last = ""
        for number in range(retries + 1):
            try:
                return await attempt()
            except (TimeoutError, aiohttp.ClientError) as exc:
                last = f"the container did not answer ({type(exc).__name__}: {exc})"
            except _Refused as refused:
                last = str(refused)
                if not refused.retry:
                    break
            if number < retries:
                await asyncio.sleep(min(2.0**number * 0.1, 2.0))
        raise JobFailed(f"ClientError: {last}")

    @staticmethod
    def _refused(status: int, body: bytes) -> _Refused:
        return _Refused(f"Received {status} from the container: {body[:300]!r}", status >= 500)

    async def invoke(self, payload: bytes | bytearray) -> bytearray:
        """One mini-batch, held (a retry sends it again), retried; its slot, taken by the
        caller, released after."""
        headers = {**self.headers(), "Content-Length": str(len(payload))}

        async def once() -> bytearray:
            # Sent in slices (flow-controlled: a 100 MB write would be copied into the
            # transport's buffer), the answer gathered into one buffer (read() joins a copy).
            async with self.http.post(
                self.url,
                data=slices(payload),
                headers=headers,
                timeout=self.timeout,
                skip_auto_headers=INVENTED,  # the job's own Accept only
            ) as response:
                body = bytearray()
                async for chunk in response.content.iter_chunked(READ_BYTES):
                    body += chunk
            if response.status >= 400:
                raise self._refused(response.status, bytes(body))
            return body

        try:
            return await self.retried(once)
        finally:
            self.slots.release()

    async def stream(
        self, body: StreamedBody, headers: dict[str, str], writer: ObjectWriter
    ) -> None:
        """One attempt of a request whose body is streamed and whose answer is copied into
        ``writer`` as it arrives (the caller retries, with a fresh body and writer)."""
        async with self.http.post(
            self.url, data=body, headers=headers, timeout=self.timeout, skip_auto_headers=INVENTED
        ) as response:
            if response.status >= 400:
                raise self._refused(response.status, await response.content.read(300))
            last = b""
            async for chunk in response.content.iter_chunked(READ_BYTES):
                await writer.write(chunk)
                last = chunk[-1:]
        if self.job.assemble_with == "Line" and writer.bytes and last != b"\n":
            await writer.write(b"\n")
