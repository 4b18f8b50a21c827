"""What arrives on the queue: S3 event notifications, S3's test event, a direct ``{bucket, key}``,
one shard of a job that a worker split, or the merge of a split job (:mod:`worker.fanout`).

The fan-out's own messages carry their protocol version in their first field (``arbiter_shard``,
``arbiter_merge``) and ignore fields they do not know, so a rolling deploy that adds a field never
dead-letters a message on a worker of the release before. A version adds fields only; a layout that
old workers could not read would get a new first field. Shard messages of the first fan-out (version
1, before job folders were named by a hash) are dead-lettered with that reason: their job is re-sent
after the upgrade.

AWS models keep AWS field names (``Records``, ``eTag``); the domain model :class:`JobRef` is frozen.
S3 URL-encodes object keys in notifications (a space becomes ``+``; moto also encodes ``/``), so keys
are decoded with ``unquote_plus``. Events are at-least-once and unordered: the job a key names is
identified by its ETag, and the output key is derived from both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote_plus

from pydantic import BaseModel, ConfigDict, Field, ValidationError

JOB_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


class S3Object(BaseModel):
    model_config = ConfigDict(extra="ignore")

    key: str
    size: int | None = None
    eTag: str | None = None
    versionId: str | None = None
    sequencer: str | None = None


class S3Bucket(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arn: str | None = None


class S3Entity(BaseModel):
    model_config = ConfigDict(extra="ignore")

    bucket: S3Bucket
    object: S3Object


class S3EventRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    eventSource: str = "aws:s3"
    eventName: str = ""
    s3: S3Entity


class S3EventNotification(BaseModel):
    model_config = ConfigDict(extra="ignore")

    Records: list[S3EventRecord] = Field(min_length=1)


class S3TestEvent(BaseModel):
    model_config = ConfigDict(extra="ignore")

    Service: str
    Event: Literal["s3:TestEvent"]


class DirectMessage(BaseModel):
    """``{"bucket": ..., "key": ...}`` sent by hand; the key is taken literally (not URL-encoded)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket: str = Field(min_length=1)
    key: str = Field(min_length=1)
    etag: str | None = None
    version_id: str | None = None


PROTOCOL = 2  # the fan-out's message version this worker writes (and reads, with any later one)
PLAN_ID = r"^[0-9a-f]{16,64}$"


class ShardMessage(BaseModel):
    """One shard of a split job, sent by the worker that split it (the key is taken literally)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    arbiter_shard: int = Field(ge=PROTOCOL)
    bucket: str = Field(min_length=1)
    key: str = Field(min_length=1)
    etag: str = Field(min_length=1, max_length=128)
    plan: str = Field(pattern=PLAN_ID)
    index: int = Field(ge=0)
    count: int = Field(ge=1)


class MergeMessage(BaseModel):
    """Every shard of a split job has its outcome: merge them (sent by whoever saw that)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    arbiter_merge: int = Field(ge=PROTOCOL)
    bucket: str = Field(min_length=1)
    key: str = Field(min_length=1)
    etag: str = Field(min_length=1, max_length=128)
    plan: str = Field(pattern=PLAN_ID)


@dataclass(frozen=True)
class ShardRef:
    """Shard ``index`` of ``count`` of the job (bucket, key, etag), as cut by plan ``plan``."""

    bucket: str
    key: str
    etag: str
    plan: str
    index: int
    count: int


@dataclass(frozen=True)
class MergeRef:
    """The merge of the job (bucket, key, etag), split by plan ``plan``."""

    bucket: str
    key: str
    etag: str
    plan: str


@dataclass(frozen=True)
class JobRef:
    """One input object to process. ``etag`` is unquoted; None means "look it up"."""

    bucket: str
    key: str
    etag: str | None = None
    version_id: str | None = None
    size: int | None = None


@dataclass(frozen=True)
class Ignored:
    """A message with nothing to do (acknowledged and deleted)."""

    reason: str


class UnreadableMessage(ValueError):
    """A message body that is none of the shapes above: a poison pill, not a retryable failure."""


def normalize_etag(etag: str | None) -> str | None:
    """Events carry ETags bare, HeadObject quoted: compare them bare."""
    return etag.strip('"') if etag else None


Ref = JobRef | ShardRef | MergeRef


def ignored(bucket: str, key: str, job_bucket: str, input_prefix: str) -> str | None:
    """Why the worker ignores an object (None: it is a job). `arbiter submit` asks the same
    before it uploads, so a file the worker would ignore is refused at once, not waited on."""
    if bucket != job_bucket:
        return f"bucket {bucket!r} is not the job bucket {job_bucket!r}"
    if not key.startswith(input_prefix):
        return f"key {key!r} is outside the input prefix {input_prefix!r}"
    if not key.endswith(JOB_SUFFIXES):
        return f"key {key!r} is not a job file ({', '.join(JOB_SUFFIXES)})"
    return None


def _accept(ref: Ref, bucket: str, input_prefix: str) -> Ref | Ignored:
    why = ignored(ref.bucket, ref.key, bucket, input_prefix)
    return ref if why is None else Ignored(why)


def _records(event: S3EventNotification, bucket: str, input_prefix: str) -> list[Ref | Ignored]:
    out: list[Ref | Ignored] = []
    for record in event.Records:
        if not record.eventName.startswith("ObjectCreated"):
            out.append(Ignored(f"event {record.eventName!r} is not an object creation"))
            continue
        obj = record.s3.object
        ref = JobRef(
            bucket=record.s3.bucket.name,
            key=unquote_plus(obj.key),
            etag=normalize_etag(obj.eTag),
            version_id=obj.versionId,
            size=obj.size,
        )
        out.append(_accept(ref, bucket, input_prefix))
    return out


def _fanout_ref(raw: dict[str, Any]) -> ShardRef | MergeRef:
    if raw.get("arbiter_shard") == 1:
        raise UnreadableMessage(
            "a shard message of the fan-out before version 2 (its job folders were named "
            "differently): re-send the job's notification to run it on this release"
        )
    if "arbiter_merge" in raw:
        merge = MergeMessage.model_validate(raw)
        return MergeRef(**merge.model_dump(include={"bucket", "key", "etag", "plan"}))
    shard = ShardMessage.model_validate(raw)
    if shard.index >= shard.count:
        raise ValueError(f"shard index {shard.index} is not below count {shard.count}")
    return ShardRef(**shard.model_dump(include={"bucket", "key", "etag", "plan", "index", "count"}))


def parse_message(body: str, *, bucket: str, input_prefix: str) -> list[Ref | Ignored]:
    """The jobs (and ignored entries) a message announces, one per record.

    Raises :class:`UnreadableMessage` for a body that is not one of the accepted shapes.
    """
    try:
        raw: Any = json.loads(body)
    except RecursionError as exc:
        raise UnreadableMessage("message body is nested too deeply to read") from exc
    except ValueError as exc:  # not JSON, or an integer too long to convert
        raise UnreadableMessage(f"message body is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise UnreadableMessage("message body is not a JSON object")
    try:
        if raw.get("Event") == "s3:TestEvent":
            S3TestEvent.model_validate(raw)
            return [Ignored("s3:TestEvent")]
        if "Records" in raw:
            return _records(S3EventNotification.model_validate(raw), bucket, input_prefix)
        if "arbiter_shard" in raw or "arbiter_merge" in raw:
            return [_accept(_fanout_ref(raw), bucket, input_prefix)]
        direct = DirectMessage.model_validate(raw)
    except UnreadableMessage:
        raise
    except (ValidationError, RecursionError, ValueError) as exc:
        raise UnreadableMessage(f"message is not an S3 event or {{bucket, key}}: {exc}") from exc
    job = JobRef(direct.bucket, direct.key, normalize_etag(direct.etag), direct.version_id)
    return [_accept(job, bucket, input_prefix)]
