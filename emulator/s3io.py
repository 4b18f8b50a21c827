"""S3 as SageMaker uses it here: ``s3://`` URIs, objects read as a stream of chunks, and outputs
written in one ``PutObject`` or, once past a part, as a multipart upload (so a large output never
sits whole in memory; a failed one is aborted, never left half-written)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

PART_BYTES = 8 * 1024 * 1024  # over S3's 5 MiB minimum part
READ_BYTES = 1024 * 1024


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def join(self, *parts: str) -> S3Uri:
        key = self.key
        for part in parts:
            if part:
                key = (key.rstrip("/") + "/" if key else "") + part.strip("/")
        return S3Uri(self.bucket, key)


def parse_uri(uri: str) -> S3Uri:
    """``s3://bucket/key``; ValueError otherwise."""
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r} is not an s3:// URI")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} names no bucket")
    return S3Uri(bucket, key)


async def read_chunks(s3: Any, uri: S3Uri) -> AsyncIterator[bytes]:
    got = await s3.get_object(Bucket=uri.bucket, Key=uri.key)
    async with got["Body"] as body:
        while chunk := await body.read(READ_BYTES):
            yield chunk


class ObjectWriter:
    """Bytes appended in order become one object when :meth:`close` is called."""

    def __init__(self, s3: Any, uri: S3Uri, content_type: str | None = None) -> None:
        self.s3 = s3
        self.uri = uri
        self.extra = {"ContentType": content_type} if content_type else {}
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.bytes = 0

    async def write(self, data: bytes | bytearray) -> None:
        """Buffered to a part; a large ``data`` goes out a part at a time, never copied whole."""
        self.bytes += len(data)
        view = memoryview(data)
        while len(self.buffer) + len(view) >= PART_BYTES:
            take = PART_BYTES - len(self.buffer)
            self.buffer += view[:take]
            view = view[take:]
            await self._part(bytes(self.buffer))
            self.buffer.clear()
        self.buffer += view

    async def _part(self, data: bytes) -> None:
        if self.upload_id is None:
            made = await self.s3.create_multipart_upload(
                Bucket=self.uri.bucket, Key=self.uri.key, **self.extra
            )
            self.upload_id = made["UploadId"]
        number = len(self.parts) + 1
        sent = await self.s3.upload_part(
            Bucket=self.uri.bucket,
            Key=self.uri.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=data,
        )
        self.parts.append({"ETag": sent["ETag"], "PartNumber": number})

    async def close(self) -> None:
        if self.upload_id is None:
            await self.s3.put_object(
                Bucket=self.uri.bucket, Key=self.uri.key, Body=bytes(self.buffer), **self.extra
            )
            return
        if self.buffer:
            await self._part(bytes(self.buffer))
        await self.s3.complete_multipart_upload(
            Bucket=self.uri.bucket,
            Key=self.uri.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": self.parts},
        )

    async def abort(self) -> None:
        if self.upload_id is not None:
            await self.s3.abort_multipart_upload(
                Bucket=self.uri.bucket, Key=self.uri.key, UploadId=self.upload_id
            )
