"""Receives that met a queue fault, recorded in the job's folder so that they never count as a try.

SQS adds one to a message's ``ApproximateReceiveCount`` whenever it shows the message again, and
it shows it again whenever its visibility runs out: a lease it could not renew while it was down, a
copy it could not take (a release), a delete it did not answer. None of those receives was a try
of the work, yet each one counted, and a receive past the tries fails a shard without running it
(with one try, SQS down 12 s would leave 8 of 12 good lines ``shard_failed``). Holding the message
until SQS answers cannot fix it, since SQS shows it again on its own clock once the visibility is
out; so the worker writes down, in S3 (which an SQS outage leaves up), each receive that met a
queue fault, at the moment it knows: ``<folder>uncounted/<message id>.<receive>``. A receive's
number is then SQS's count less those records (:meth:`Uncounted.counted`), read only when the
count reaches the tries (nothing is listed on the healthy path, and nothing is written).

A direct ``{bucket, key}`` message names no ETag and so no folder: it is never recorded. Records
go with the folder at a split job's end; a job message that may have some (received before, a
copy, or its lease lost) clears them once its job is done, if it was run whole (no manifest: no end
deletes that folder); the lifecycle rule on the shard prefix is the backstop for a job that never
ends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import structlog

from worker.events import JobRef, Ref
from worker.fanout.keys import JobFolder, job_folder
from worker.faults import describe
from worker.outputs import output_keys
from worker.s3io import delete_prefix, delete_quietly, exists, put_json
from worker.settings import WorkerSettings
from worker.tries import Receive, Tries

log = structlog.get_logger("arbiter.worker")


def _ref(receive: Receive) -> Ref | None:
    """The message's first job, shard or merge; None if it names none with a folder."""
    refs = receive.refs
    if not refs or (isinstance(refs[0], JobRef) and not refs[0].etag):
        return None
    return refs[0]


class Uncounted:
    """Records and reads the uncounted receives of messages (see the module doc), each message
    as its :class:`~worker.tries.Receive` read it."""

    def __init__(self, s3: Any, settings: WorkerSettings) -> None:
        self.s3, self.settings = s3, settings

    def folder(self, receive: Receive) -> JobFolder | None:
        """The folder of the message's first job, where its records go; None if it names none."""
        ref = _ref(receive)
        if ref is None:
            return None
        return job_folder(self.settings, ref.bucket, ref.key, ref.etag or "")

    def _key(self, receive: Receive) -> str | None:
        folder = self.folder(receive)
        if folder is None or not receive.message_id:
            return None
        return f"{folder.base}uncounted/{receive.message_id}.{receive.raw}"

    async def record(self, receive: Receive, why: str) -> None:
        """This receive met a queue fault and is not a try (S3 errors are logged: the receive
        then counts, as before)."""
        if (key := self._key(receive)) is None:
            return
        try:
            record = {"receive": receive.raw, "why": why}
            await put_json(self.s3, self.settings.bucket, key, record)
            if await self._ended(receive):  # its end may have deleted the folder already
                await delete_quietly(self.s3, self.settings.bucket, key)
        except Exception as exc:
            log.warning("receive.uncounted_unrecorded", why=why, error=describe(exc))
            return
        log.warning("receive.uncounted", why=why, receive=receive.raw)

    async def _ended(self, receive: Receive) -> bool:
        """Whether the message's job has its summary (its end deletes the folder: a record
        written after that would be left behind; one written before goes with the folder)."""
        ref = _ref(receive)
        if ref is None or not ref.etag:
            return False
        summary = output_keys(self.settings, ref.key, ref.etag).summary
        return await exists(self.s3, self.settings.bucket, summary)

    async def forget(self, receive: Receive) -> None:
        """This receive is a try after all: its lease was lost to the queue, but its work then
        failed on its own (else a poison input whose every receive lost its lease would never
        spend a try: the campaign's sealed job, on a loaded machine)."""
        if (key := self._key(receive)) is not None:
            await delete_quietly(self.s3, self.settings.bucket, key)

    async def clear(self, receive: Receive, lease_lost: bool = False) -> None:
        """After a job message's last answer: its job's records, unless the job was split (its
        shards may still need theirs, and its end deletes the folder). Only a receive that may
        have left some looks: its lease lost to the queue, or not its message's first."""
        if not lease_lost and receive.raw <= 1 and receive.count <= receive.raw:
            return
        ref = _ref(receive)
        if not isinstance(ref, JobRef):
            return  # no folder, or a shard or merge message: the job's end deletes them
        folder = job_folder(self.settings, ref.bucket, ref.key, ref.etag or "")
        try:
            if not await exists(self.s3, self.settings.bucket, folder.manifest):
                await delete_prefix(self.s3, self.settings.bucket, f"{folder.base}uncounted/")
        except Exception as exc:
            log.warning("receive.uncounted_left", error=describe(exc))

    async def counted(self, receive: Receive, tries: Tries) -> Receive:
        """This receive as the tries count it: SQS's count less its message's uncounted receives,
        listed only when the count reaches the tries."""
        folder = self.folder(receive)
        if not tries.last(receive.count) or folder is None or not receive.message_id:
            return receive
        prefix = f"{folder.base}uncounted/{receive.message_id}."
        found = 0
        paginator = self.s3.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=self.settings.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                number = obj["Key"].removeprefix(prefix)
                found += number.isdigit() and int(number) < receive.raw
        if not found:
            return receive
        log.info("receive.uncounted_found", receives=found, count=receive.count - found)
        return dataclasses.replace(receive, count=max(1, receive.count - found))
