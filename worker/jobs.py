"""One job: stream an input object from S3, score it in chunks, write results and summary back.

A job is located once (:func:`locate`: one HeadObject of its input, and its summary looked for)
and read once: from S3 (:func:`s3_items`), or, for a job the splitter read to cut and found within
one shard, from the spool the splitter wrote (:class:`worker.fanout.split.Whole`).

The input is read in bounded pieces by :mod:`worker.formats` and never held whole; items are scored
``chunk_decisions`` at a time (or fewer, once a chunk holds ``chunk_mb`` of input) through
:meth:`Engine.score`, which groups each chunk's decisions by state so every state is prefilled once
(and its prefix cache carries a state across chunks). Results are spooled to a temporary file, one
line per input line in input order, and uploaded only when complete (one PutObject, or a completed
multipart upload), with ``If-None-Match: *``: a worker that dies mid-job leaves nothing visible, and
the results object is written once however often the job is redone. The summary is written last
(``If-None-Match: *`` too); its existence marks the job done. A job redone after its results but
before its summary (a kill, a lost answer) reads its tally back from the results it finds instead
of scoring again, so the summary always describes the results that exist.

Whatever goes wrong with one line, in parsing or in the engine, becomes that line's error record.
A job fails (and is retried) only for trouble no line causes: S3, or an engine that fails on every
decision it is given. A job no retry can fix (its input is gone) is rejected.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import socket
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

from botocore.exceptions import ClientError

from arbiter.errors import ArbiterError, EngineFailure
from arbiter.lines import Item, encode_record
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.scorer import Scorer
from arbiter.settings import MB as MiB
from worker.events import JobRef, Ref, normalize_etag
from worker.faults import Fault
from worker.formats import PIECE, items_for
from worker.outputs import OutputKeys, output_keys
from worker.progress import Progress
from worker.s3io import (
    abort_uploads,
    exists,
    gone,
    is_object_denied,
    put_json,
    put_new,
    upload_spool,
)
from worker.settings import WorkerSettings

# Runs a blocking engine call off the event loop: ``await run(fn, *args)`` (``thread_offload``).
Offload = Callable[..., Awaitable[Any]]
# Opens a job's items for one read, and closes what it opened at the end.
Source = Callable[[], AbstractAsyncContextManager[AsyncIterator[Item]]]


class JobFailed(Exception):
    """The job cannot be completed now (S3 trouble, a broken engine): retried with backoff."""


class JobRejected(Exception):
    """No retry can complete the job (its input object is gone, or needs too many shards):
    dead-lettered at once. ``keys``: the job's outputs, where known; its rejection record is
    written beside them (:func:`write_rejection`), so whoever waits for the summary is told."""

    def __init__(self, reason: str, keys: OutputKeys | None = None) -> None:
        super().__init__(reason)
        self.keys = keys


class InputDenied(JobFailed):
    """The job's input is there (a listing shows it) but its read is refused for the object's own
    sake (:func:`worker.s3io.is_object_denied`: a 403, a KMS key the role may not use or that is
    disabled): the job's fault, not the store's. It counts as a try, and on the last one the job is
    rejected with its record (:class:`JobRejected`), within minutes; an error on the whole store
    (its listing refused too, a write denied) stays an outage."""

    fault = Fault.WORK

    def __init__(self, reason: str, keys: OutputKeys | None = None) -> None:
        super().__init__(reason)
        self.keys = keys


class OutOfTries(Exception):
    """A job message back after its last try died with its worker: dead-lettered, not run again
    (a split job's is still a repair: it only re-sends what is unfinished)."""


class LastTryMayRun(Exception):
    """A shard message received once past its tries, without an outcome: its last try may still be
    running (SQS shows a message again while it is in flight), so the message is left to it and
    looked at again later (:mod:`worker.tries`)."""


@dataclass
class JobReport:
    """What happened to one job reference."""

    outcome: str  # ok | duplicate | superseded; split | repaired | merged | shard (worker.fanout)
    ref: JobRef
    keys: OutputKeys | None = None
    summary: dict[str, Any] | None = None
    etag: str | None = None  # the input version found


@dataclass
class _Tally:
    lines: int = 0
    ok: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    engine_s: float = 0.0
    engine_ok: int = 0  # decisions the engine answered (a result or a typed error)
    engine_raised: int = 0  # decisions on which engine.score raised, alone
    abstained: int = 0  # results under their error budget or minimum confidence
    codes: Counter[str] = field(default_factory=Counter)


async def raw_chunks(body: Any) -> AsyncIterator[bytes]:
    while chunk := await body.read(PIECE):
        yield chunk


# -- scoring ---------------------------------------------------------------------------------------


def thread_offload(executor: Executor) -> Offload:
    """Engine calls on ``executor``, log context kept. With one thread, calls queue behind one
    another, so a chunk abandoned mid-computation (its job cancelled) ends before the next starts."""

    async def run(fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, contextvars.copy_context().run, fn, *args)

    return run


async def _score_isolated(
    engine: Scorer, requests: list[DecisionRequest], run: Offload, tally: _Tally
) -> list[DecisionResult | ArbiterError]:
    """``engine.score``; if it raises, the batch is split in halves until the decisions that make it
    raise stand alone, and each of those gets an ``engine_failure`` error."""
    try:
        outcomes = list(await run(engine.score, requests))
        if len(outcomes) != len(requests):
            raise RuntimeError(f"{len(outcomes)} outcomes for {len(requests)} decisions")
    except Exception as exc:
        if len(requests) == 1:
            tally.engine_raised += 1
            message = f"scoring this decision failed: {type(exc).__name__}: {exc}"
            return [EngineFailure(message[:2000])]
        half = len(requests) // 2
        first = await _score_isolated(engine, requests[:half], run, tally)
        return first + await _score_isolated(engine, requests[half:], run, tally)
    tally.engine_ok += len(requests)
    return outcomes


async def _score_chunk(
    engine: Scorer,
    chunk: list[Item],
    out: IO[bytes],
    tally: _Tally,
    metrics: Any,
    run: Offload,
    judge_engine: bool = True,
) -> None:
    requests = [item.value for item in chunk if isinstance(item.value, DecisionRequest)]
    started = time.perf_counter()
    # The model stays off the event loop (heartbeats keep running).
    raised_before = tally.engine_raised
    outcomes = iter(await _score_isolated(engine, requests, run, tally) if requests else [])
    tally.engine_s += time.perf_counter() - started
    every_one_raised = tally.engine_raised - raised_before == len(requests)
    if judge_engine and requests and tally.engine_ok == 0 and every_one_raised:
        raise JobFailed(f"the engine failed on every decision so far ({tally.engine_raised})")
    failed = 0
    for item in chunk:
        outcome = next(outcomes) if isinstance(item.value, DecisionRequest) else item.value
        line, outcome = encode_record(item.line, item.id, outcome)
        out.write(line)
        tally.lines += 1
        if isinstance(outcome, ArbiterError):
            failed += 1
            tally.codes[outcome.code] += 1
        else:
            tally.prompt_tokens += outcome.prompt.input_tokens
            tally.abstained += int(outcome.abstained)
    tally.failed += failed
    tally.ok += len(chunk) - failed
    if metrics is not None:
        metrics.lines.labels("error").inc(failed)
        metrics.lines.labels("ok").inc(len(chunk) - failed)


async def write_records(
    engine: Scorer,
    items: AsyncIterator[Item],
    out: IO[bytes],
    settings: WorkerSettings,
    metrics: Any = None,
    run: Offload | None = None,
    judge_engine: bool = True,
    progress: Progress | None = None,
) -> _Tally:
    """Score ``items`` in chunks and write one record line per item to ``out``, in order.

    ``judge_engine``: raise :class:`JobFailed` while the engine has failed on every decision so far
    (a broken engine, retried elsewhere); False on a last try, where every line gets its record."""
    run = run or asyncio.to_thread
    tally = _Tally()
    chunk: list[Item] = []
    size = 0
    limit = settings.chunk_mb * MiB
    async for item in items:
        chunk.append(item)
        size += item.size
        if len(chunk) >= settings.chunk_decisions or size >= limit:
            await _score_chunk(engine, chunk, out, tally, metrics, run, judge_engine)
            chunk, size = [], 0
            if progress is not None:
                await progress(tally.lines, tally.failed)
    if chunk:
        await _score_chunk(engine, chunk, out, tally, metrics, run, judge_engine)
    return tally


# -- S3 --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Located:
    """A job's input version (HeadObject's answer) and its output keys."""

    ref: JobRef
    head_kw: dict[str, Any]
    head: dict[str, Any]
    etag: str
    keys: OutputKeys


async def locate(s3: Any, ref: JobRef, settings: WorkerSettings) -> Located | JobReport:
    """The input version a job reference names, or the report that there is nothing to do: the key
    was overwritten since (superseded) or this version's summary exists (duplicate). Raises
    :class:`JobRejected` when the input is gone."""
    where = f"s3://{ref.bucket}/{ref.key}"
    # The current version, checked against the event's ETag (and read with If-Match on it), never
    # a read by VersionId: that needs s3:GetObjectVersion, which the worker's role has not got (on
    # AWS every job of a versioned bucket was dead-lettered), and it would run an overwritten
    # version that an unversioned bucket calls superseded. The job is (key, ETag) throughout: its
    # outputs and its folder are named by the ETag.
    head_kw: dict[str, Any] = {"Bucket": ref.bucket, "Key": ref.key}
    try:
        head = await s3.head_object(**head_kw)
    except ClientError as exc:
        keys = output_keys(settings, ref.key, ref.etag) if ref.etag else None
        if await gone(s3, ref.bucket, ref.key, exc):
            raise JobRejected(f"the input {where} no longer exists", keys) from exc
        if is_object_denied(exc):
            raise InputDenied(f"the input {where} cannot be read: {exc}", keys) from exc
        raise JobFailed(f"cannot read {where}: {exc}") from exc
    etag = normalize_etag(head["ETag"]) or ""
    if ref.etag and ref.etag != etag:
        # The key was overwritten after this event; the newer version has its own event.
        return JobReport("superseded", ref)
    keys = output_keys(settings, ref.key, etag)
    if await exists(s3, settings.bucket, keys.summary):
        return JobReport("duplicate", ref, keys, etag=etag)
    return Located(ref, head_kw, head, etag, keys)


async def open_input(s3: Any, found: Located) -> Any:
    """GetObject of exactly the version located (``If-Match`` on its ETag)."""
    ref = found.ref
    try:
        return await s3.get_object(**found.head_kw, IfMatch=f'"{found.etag}"')
    except ClientError as exc:
        where = f"s3://{ref.bucket}/{ref.key}"
        if await gone(s3, ref.bucket, ref.key, exc):
            raise JobRejected(f"the input {where} no longer exists", found.keys) from exc
        if is_object_denied(exc):
            raise InputDenied(f"the input {where} cannot be read: {exc}", found.keys) from exc
        raise


def s3_items(s3: Any, found: Located, settings: WorkerSettings) -> Source:
    """The job's items read from S3: one GetObject of the version located, streamed."""

    @contextlib.asynccontextmanager
    async def read() -> AsyncIterator[AsyncIterator[Item]]:
        response = await open_input(s3, found)
        async with response["Body"] as body:
            yield items_for(found.ref.key, raw_chunks(body), settings.max_line_bytes)

    return read


async def write_rejection(s3: Any, bucket: str, ref: Ref, rejected: JobRejected) -> None:
    """The record of a job refused for good, at ``keys.rejected``: before it, `arbiter submit` (and
    anyone polling for the summary) waited out its timeout for a summary that never comes. A
    re-run that succeeds (the input re-sent, a larger shard size) writes its summary as usual;
    submit reads a rejection only if it is newer than its own upload."""
    if rejected.keys is None:
        return
    record = {
        "input": {"bucket": ref.bucket, "key": ref.key, "etag": ref.etag},
        "rejected": str(rejected),
        "summary_key": rejected.keys.summary,
        "worker": {"host": socket.gethostname(), "pid": os.getpid()},
        "finished_at": datetime.now(UTC).isoformat(),
    }
    await put_json(s3, bucket, rejected.keys.rejected, record)


async def tally_results(s3: Any, bucket: str, key: str) -> tuple[_Tally, Any]:
    """The tally of a results object that exists (written by an earlier attempt of the job, or by
    this one whose answer was lost), and the model of its first result."""
    tally = _Tally()
    model = None
    got = await s3.get_object(Bucket=bucket, Key=key)
    buf = b""
    async with got["Body"] as body:
        async for chunk in raw_chunks(body):
            buf += chunk
            *whole, buf = buf.split(b"\n")
            for line in whole:
                if line:
                    model = _count_record(tally, json.loads(line)) or model
    if buf.strip():
        model = _count_record(tally, json.loads(buf)) or model
    return tally, model


def _count_record(tally: _Tally, record: dict[str, Any]) -> Any:
    tally.lines += 1
    if "error" in record:
        tally.failed += 1
        tally.codes[record["error"].get("code", "unknown")] += 1
        return None
    tally.ok += 1
    result = record.get("result", {})
    tally.prompt_tokens += int(result.get("prompt", {}).get("input_tokens", 0))
    tally.abstained += int(bool(result.get("abstained")))
    return result.get("model")


async def run_job(
    s3: Any,
    engine: Scorer,
    ref: JobRef,
    settings: WorkerSettings,
    metrics: Any = None,
    run: Offload | None = None,
) -> JobReport:
    """Locate one input object and run it whole, read from S3 (:func:`run_located`)."""
    found = await locate(s3, ref, settings)
    if isinstance(found, JobReport):
        return found
    return await run_located(
        s3, engine, found, s3_items(s3, found, settings), settings, metrics, run
    )


async def run_located(
    s3: Any,
    engine: Scorer,
    found: Located,
    source: Source,
    settings: WorkerSettings,
    metrics: Any = None,
    run: Offload | None = None,
) -> JobReport:
    """Run the job located as ``found`` whole, its items read once from ``source``; idempotent
    per (key, ETag). Raises :class:`JobFailed` (or a botocore error) when it should be retried,
    :class:`JobRejected` when no retry can help. ``run`` runs engine calls off the event loop
    (default: ``asyncio.to_thread``)."""
    started = time.perf_counter()
    ref, head, etag, keys = found.ref, found.head, found.etag, found.keys
    model: Any = engine.model_info.model_dump(mode="json")
    written = False
    if not await exists(s3, settings.bucket, keys.results):
        async with source() as items:  # opened first: a read refused writes nothing
            progress = Progress(s3, settings.bucket, keys.status)
            try:
                await progress(0, 0)
                with tempfile.TemporaryFile(dir=settings.tmp_dir) as spool:
                    tally = await write_records(
                        engine, items, spool, settings, metrics, run, progress=progress
                    )
                    written = await upload_spool(s3, settings, keys.results, spool, exclusive=True)
            finally:
                await asyncio.shield(progress.clear())
    if not written:  # results of an earlier attempt (or ours, answer lost): describe those
        tally, found_model = await tally_results(s3, settings.bucket, keys.results)
        model = found_model or model
    seconds = time.perf_counter() - started
    summary = {
        "input": {
            "bucket": ref.bucket,
            "key": ref.key,
            "etag": etag,
            "version_id": ref.version_id or head.get("VersionId"),
            "bytes": head.get("ContentLength"),
        },
        "results_key": keys.results,
        "lines": tally.lines,
        "ok": tally.ok,
        "failed": tally.failed,
        "errors_by_code": dict(sorted(tally.codes.items())),
        "abstained": tally.abstained,
        "tokens": {"prompt": tally.prompt_tokens},
        "seconds": {"total": round(seconds, 4), "engine": round(tally.engine_s, 4)},
        "decisions_per_s": round(tally.lines / seconds, 3) if seconds > 0 else None,
        "model": model,
        "worker": {"host": socket.gethostname(), "pid": os.getpid()},
        "finished_at": datetime.now(UTC).isoformat(),
    }
    # False: an equivalent summary (of these same results) was written by another attempt.
    await put_new(s3, settings.bucket, keys.summary, summary)
    await abort_uploads(s3, settings.bucket, keys.results, exact=True)
    if metrics is not None:
        metrics.decisions_per_s.set(tally.lines / seconds if seconds > 0 else 0)
    return JobReport("ok", ref, keys, summary)
