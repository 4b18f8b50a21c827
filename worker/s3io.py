"""The S3 calls every worker step shares, each safe to repeat and safe under a prefix-scoped role.

**Missing or denied.** S3 answers a GET or HEAD of a missing key with 404 only to a caller that may
``s3:ListBucket`` the bucket; to others it answers 403, and whether a ``ListBucket`` grant limited by
an ``s3:prefix`` condition counts is not documented. So :func:`exists` is a listing
(``ListObjectsV2`` with ``Prefix=key``, ``MaxKeys=1``), which a prefix-scoped ``ListBucket`` allows
by construction, and a 403 on a read is resolved by that listing: missing (as a 404 would say) or
really denied (raised). S3's listings are strongly consistent: an object whose write returned
before the listing started is in it.

**Conditional writes.** ``If-None-Match: *`` creates an object only if there is none
(:func:`put_new`); a 412 is :class:`PreconditionFailed`. A write whose answer was lost is sent again
by botocore and then meets its own first copy: callers decide from what they find whether it is
theirs (an equal object, or one that names their own attempt), never from the 412 alone. A 409
``ConditionalRequestConflict`` (a conditional write to the key was in progress at once, and this
one was not applied) is neither: :class:`WriteConflict`, retried where a 412 is retried (a
compare-and-swap reads again, a create-once write is sent again), and otherwise a store fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from typing import IO, Any

import structlog
from botocore.exceptions import ClientError

from arbiter.settings import MB as MiB
from worker.faults import Transient
from worker.settings import WorkerSettings

log = structlog.get_logger("arbiter.worker")

_MISSING = {"404", "NoSuchKey", "NotFound", "NoSuchVersion"}
_DENIED = {"403", "AccessDenied", "Forbidden"}


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""


class WriteConflict(Transient):
    """S3's 409 ``ConditionalRequestConflict``: another conditional write to the key was in flight;
    this one was not applied and may be sent again."""


CONFLICT_TRIES = 8  # create-once writes sent again after a 409, with a short random pause


def is_conflict(exc: ClientError) -> bool:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return _code(exc) == "ConditionalRequestConflict" or status == 409


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def is_missing(exc: ClientError) -> bool:
    return _code(exc) in _MISSING


def is_denied(exc: ClientError) -> bool:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return _code(exc) in _DENIED or status == 403


# KMS answers, passed on by S3, that name a passing condition (the others name the object's key).
_KMS_PASSING = {
    "KMS.ThrottlingException",
    "KMS.LimitExceededException",
    "KMS.KMSInternalException",
    "KMS.DependencyTimeoutException",
}


def is_object_denied(exc: ClientError) -> bool:
    """A read refused for the object's own sake: a 403 (its ACL, a policy on its key or tags, a
    KMS key the role may not use), or KMS refusing its key (``KMS.DisabledException``,
    ``KMS.AccessDeniedException``, ``KMS.NotFoundException``...)."""
    code = _code(exc)
    return is_denied(exc) or (code.startswith("KMS.") and code not in _KMS_PASSING)


def is_precondition_failed(exc: ClientError) -> bool:
    """412: the condition was checked and is false. Not S3's 409 ``ConditionalRequestConflict`` (a
    concurrent write was in progress, outcome unknown): that one is retried as any S3 error is."""
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return _code(exc) == "PreconditionFailed" or status == 412


async def exists(s3: Any, bucket: str, key: str) -> bool:
    """Whether ``key`` exists, by a listing a prefix-scoped ``s3:ListBucket`` allows (the key is
    the shortest name with itself as prefix, so it is the listing's first entry if it exists)."""
    got = await s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
    return any(obj["Key"] == key for obj in got.get("Contents", []))


async def gone(s3: Any, bucket: str, key: str, exc: ClientError) -> bool:
    """Whether a failed read of ``key`` means it does not exist (a 404, or a 403 to a role without
    ``ListBucket`` that a listing confirms); False for any other failure."""
    if is_missing(exc):
        return True
    return is_denied(exc) and not await exists(s3, bucket, key)


async def get_bytes(s3: Any, bucket: str, key: str) -> tuple[bytes, str] | None:
    """An object's bytes and ETag; None if there is no such key."""
    try:
        got = await s3.get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if await gone(s3, bucket, key, exc):
            return None
        raise
    async with got["Body"] as body:
        data: bytes = await body.read()
    return data, str(got["ETag"])


async def get_json(s3: Any, bucket: str, key: str) -> tuple[Any, str] | None:
    """A JSON object and its ETag; None if there is no such key."""
    got = await get_bytes(s3, bucket, key)
    return None if got is None else (json.loads(got[0]), got[1])


def _json(doc: Any) -> bytes:
    return json.dumps(doc, indent=1).encode()


async def put_json(s3: Any, bucket: str, key: str, doc: Any, **condition: str) -> str:
    """PutObject of a JSON document; ``IfNoneMatch="*"`` or ``IfMatch=<etag>`` make it conditional
    (:class:`PreconditionFailed` when it loses). Returns the new object's ETag."""
    try:
        put = await s3.put_object(
            Bucket=bucket, Key=key, Body=_json(doc), ContentType="application/json", **condition
        )
    except ClientError as exc:
        if is_precondition_failed(exc) or (condition.get("IfMatch") and is_missing(exc)):
            raise PreconditionFailed(key) from exc
        if condition and is_conflict(exc):
            raise WriteConflict(f"a concurrent conditional write to {key}") from exc
        raise
    return str(put["ETag"])


async def put_new(s3: Any, bucket: str, key: str, doc: Any) -> bool:
    """Create a JSON object unless ``key`` exists; True if this call (or its resend) created it,
    False if one was there: the caller reads it to tell whose it is. A 409 (a concurrent write
    whose outcome is not known yet) sends it again."""
    for attempt in range(CONFLICT_TRIES):
        try:
            await put_json(s3, bucket, key, doc, IfNoneMatch="*")
        except PreconditionFailed:
            return False
        except WriteConflict:
            if attempt == CONFLICT_TRIES - 1:
                raise
            await asyncio.sleep(random.uniform(0.01, 0.1) * 2**attempt)
            continue
        return True
    raise AssertionError("unreachable")  # pragma: no cover


async def delete_quietly(s3: Any, bucket: str, key: str) -> None:
    with contextlib.suppress(Exception):
        await s3.delete_object(Bucket=bucket, Key=key)


async def delete_prefix(s3: Any, bucket: str, prefix: str) -> int:
    """Delete every object under ``prefix`` (1,000 per call); how many were deleted. Raises when S3
    refuses one, so the step that asked is retried."""
    deleted = 0
    paginator = s3.get_paginator("list_objects_v2")
    async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        objects = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if objects:
            answer = await s3.delete_objects(
                Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
            )
            errors = answer.get("Errors", [])
            if errors:
                raise RuntimeError(f"S3 kept {len(errors)} objects under {prefix}: {errors[0]}")
            deleted += len(objects)
    return deleted


async def abort_uploads(s3: Any, bucket: str, prefix: str, exact: bool = False) -> int:
    """Abort every multipart upload under ``prefix`` (only those of key ``prefix`` itself when
    ``exact``): what a worker killed between ``CreateMultipartUpload`` and its last step leaves.
    How many were aborted."""
    aborted = 0
    paginator = s3.get_paginator("list_multipart_uploads")
    async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        for upload in page.get("Uploads", []):
            if exact and upload["Key"] != prefix:
                continue
            try:
                await s3.abort_multipart_upload(
                    Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
            except ClientError as exc:
                if _code(exc) != "NoSuchUpload":  # aborted or completed meanwhile
                    raise
            aborted += 1
    if aborted:
        log.info("uploads.aborted", prefix=prefix, uploads=aborted)
    return aborted


# -- whole objects from a spool ------------------------------------------------------------------


async def upload_spool(
    s3: Any,
    settings: WorkerSettings,
    key: str,
    spool: IO[bytes],
    content_type: str = "application/x-ndjson",
    exclusive: bool = False,
) -> bool:
    """Publish a spooled file whole: one PutObject, or parts completed in one call. ``exclusive``:
    only if ``key`` does not exist (``If-None-Match: *``); False then if it did (another attempt's
    copy, or this call's own whose answer was lost: the caller reads it back)."""
    size = spool.seek(0, os.SEEK_END)
    spool.seek(0)
    condition = {"IfNoneMatch": "*"} if exclusive else {}
    if size <= settings.multipart_threshold_mb * MiB:
        try:
            await s3.put_object(
                Bucket=settings.bucket,
                Key=key,
                Body=spool.read(),
                ContentType=content_type,
                **condition,
            )
        except ClientError as exc:
            if exclusive and is_precondition_failed(exc):
                return False
            raise
        return True
    part_size = int(settings.part_size_mb * MiB)
    upload = await s3.create_multipart_upload(
        Bucket=settings.bucket, Key=key, ContentType=content_type
    )
    upload_id = upload["UploadId"]
    completed = False
    try:
        parts = []
        number = 1
        while data := spool.read(part_size):
            part = await s3.upload_part(
                Bucket=settings.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
            )
            parts.append({"PartNumber": number, "ETag": part["ETag"]})
            number += 1
        completed = await complete_upload(s3, settings.bucket, key, upload_id, parts, condition)
        return completed
    finally:
        if not completed:
            with contextlib.suppress(Exception):  # a leftover is aborted once the job is done
                await asyncio.shield(
                    s3.abort_multipart_upload(Bucket=settings.bucket, Key=key, UploadId=upload_id)
                )


async def complete_upload(
    s3: Any,
    bucket: str,
    key: str,
    upload_id: str,
    parts: list[dict[str, Any]],
    condition: dict[str, str],
) -> bool:
    """CompleteMultipartUpload; False if, under ``If-None-Match``, the object exists (a 412, or the
    NoSuchUpload that a resend meets once its first copy completed)."""
    try:
        await s3.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
            **condition,
        )
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        lost = is_precondition_failed(exc) or code == "NoSuchUpload"
        if condition and lost and await exists(s3, bucket, key):
            return False
        raise
    return True
