"""One job: stream an input object from S3, score it in chunks, write results and summary back.

The input is read in pieces (gzip decompressed incrementally) and never held whole; lines are parsed
and scored ``chunk_decisions`` at a time through :meth:`Engine.score`, which groups each chunk's
decisions by state so every state is prefilled once (and its prefix cache carries a state across
chunks). Results are spooled to a temporary file, one line per input line in input order, and
uploaded only when complete (one PutObject, or a completed multipart upload): a worker that dies
mid-job leaves nothing visible. The summary is written last; its existence marks the job done.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import socket
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any, Protocol

from botocore.exceptions import ClientError
from pydantic import ValidationError

from adapter.errors import ArbiterError, InvalidDecision, MalformedRequest
from adapter.lines import parse_decision_line, validation_error
from adapter.schema import DecisionRequest, DecisionResult, ModelInfo
from worker.events import JobRef, normalize_etag
from worker.settings import WorkerSettings

READ_BYTES = 1 << 20
MiB = 1024 * 1024


class Scorer(Protocol):
    """What a job needs from the engine (``adapter.engine.Engine``, or a fake in tests)."""

    model_info: ModelInfo

    def score(
        self, decisions: Sequence[DecisionRequest]
    ) -> list[DecisionResult | ArbiterError]: ...


class JobFailed(Exception):
    """The job cannot be completed now (S3 trouble, unreadable gzip...): retried with backoff."""


@dataclass(frozen=True)
class OutputKeys:
    results: str
    summary: str


def output_keys(settings: WorkerSettings, key: str, etag: str) -> OutputKeys:
    """``<output-prefix><key without input prefix>.<etag>.results.jsonl`` and ``...summary.json``:
    the same input version always maps to the same keys, which is what makes redelivery safe."""
    name = key.removeprefix(settings.input_prefix)
    base = f"{settings.output_prefix}{name}.{etag}"
    return OutputKeys(f"{base}.results.jsonl", f"{base}.summary.json")


@dataclass
class JobReport:
    """What happened to one job reference."""

    outcome: str  # ok | duplicate | superseded
    ref: JobRef
    keys: OutputKeys | None = None
    summary: dict[str, Any] | None = None


@dataclass
class _Tally:
    lines: int = 0
    ok: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    engine_s: float = 0.0
    codes: Counter[str] = field(default_factory=Counter)


# -- reading ---------------------------------------------------------------------------------------


async def _raw_chunks(body: Any) -> AsyncIterator[bytes]:
    while True:
        chunk = await body.read(READ_BYTES)
        if not chunk:
            return
        yield chunk


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Incremental gzip decoding, concatenated members included (``cat a.gz b.gz``)."""
    decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    in_member = False
    try:
        async for chunk in chunks:
            data = chunk
            while data:
                in_member = True
                out = decoder.decompress(data)
                if out:
                    yield out
                if decoder.eof:
                    in_member = False
                    data = decoder.unused_data
                    decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
                else:
                    data = b""
    except zlib.error as exc:
        raise JobFailed(f"the input is not valid gzip: {exc}") from exc
    if in_member:
        raise JobFailed("the gzip input is truncated")


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    """Physical lines, numbered from 1, without their line break."""
    number = 0
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            number += 1
            yield number, line
    if pending:
        yield number + 1, pending


Item = tuple[int, DecisionRequest | ArbiterError, Any]


def _raw_id(raw: Any) -> Any:
    return raw.get("id") if isinstance(raw, dict) else None


async def jsonl_items(chunks: AsyncIterator[bytes]) -> AsyncIterator[Item]:
    """One item per non-blank line: the decision, or the typed error that line earned."""
    async for number, data in _lines(chunks):
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield number, MalformedRequest(f"line is not valid UTF-8: {exc}"), None
            continue
        if not line.strip():
            continue
        try:
            yield number, parse_decision_line(line), None
        except ArbiterError as exc:
            try:
                raw_id = _raw_id(json.loads(line))
            except json.JSONDecodeError:
                raw_id = None
            yield number, exc, raw_id


class _TextStream:
    """A window of decoded text over the byte stream, for the incremental JSON reader."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.eof = False

    async def more(self) -> bool:
        if self.eof:
            return False
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            self.eof = True
            self.buf = self.buf[self.pos :] + self._decoder.decode(b"", final=True)
            self.pos = 0
            return False
        self.buf = self.buf[self.pos :] + self._decoder.decode(chunk)
        self.pos = 0
        return True

    async def skip_ws(self) -> str:
        """The next non-blank character (not consumed); '' at the end."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not await self.more():
                return ""

    async def expect(self, chars: str) -> str:
        found = await self.skip_ws()
        if not found or found not in chars:
            raise MalformedRequest(f"expected one of {chars!r} at this point, found {found!r}")
        self.pos += 1
        return found

    async def value(self) -> Any:
        """The next complete JSON value. A value must be followed by at least one character (or
        the end of the stream) so that a number cut at a chunk boundary is never taken whole."""
        await self.skip_ws()
        decoder = json.JSONDecoder()
        while True:
            try:
                value, end = decoder.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:
                    self.pos = end
                    return value
            except json.JSONDecodeError as exc:
                if self.eof:
                    raise MalformedRequest(f"the document is not valid JSON: {exc}") from exc
            await self.more()


async def json_items(chunks: AsyncIterator[bytes]) -> AsyncIterator[Item]:
    """``{"decisions": [...]}`` read element by element; ``line`` is the 1-based element index.

    A broken element inside the array ends the document: it becomes one error item and reading
    stops (what follows cannot be located reliably).
    """
    stream = _TextStream(chunks)
    index = 0  # elements started; an error ends the document at the next line number
    emitted = 0
    try:
        await stream.expect("{")
        while True:
            key = await stream.value()
            await stream.expect(":")
            if key != "decisions":
                await stream.value()
            else:
                await stream.expect("[")
                if await stream.skip_ws() == "]":
                    stream.pos += 1
                else:
                    while True:
                        index += 1
                        raw = await stream.value()
                        emitted += 1
                        yield index, _validate(raw), _raw_id(raw)
                        if await stream.expect(",]") == "]":
                            break
            if await stream.expect(",}") == "}":
                return
    except (MalformedRequest, UnicodeDecodeError) as exc:
        error = exc if isinstance(exc, ArbiterError) else MalformedRequest(str(exc))
        yield emitted + 1, error, None


def _validate(raw: Any) -> DecisionRequest | ArbiterError:
    if not isinstance(raw, dict):
        return InvalidDecision("a decision must be a JSON object", code="invalid_type")
    try:
        return DecisionRequest.model_validate(raw)
    except ValidationError as exc:
        return validation_error(exc)


def items_for(key: str, chunks: AsyncIterator[bytes]) -> AsyncIterator[Item]:
    if key.endswith(".gz"):
        chunks = _gunzip(chunks)
        key = key.removesuffix(".gz")
    return json_items(chunks) if key.endswith(".json") else jsonl_items(chunks)


# -- running ---------------------------------------------------------------------------------------


def _record(number: int, raw_id: Any, outcome: DecisionResult | ArbiterError) -> dict[str, Any]:
    if isinstance(outcome, ArbiterError):
        return {"line": number, "id": raw_id, "error": outcome.to_dict()}
    return {"line": number, "id": outcome.id, "result": outcome.model_dump(mode="json")}


async def _score_chunk(
    engine: Scorer, chunk: list[Item], out: IO[bytes], tally: _Tally, metrics: Any
) -> None:
    requests = [item for _, item, _ in chunk if isinstance(item, DecisionRequest)]
    started = time.perf_counter()
    # The model stays off the event loop (heartbeats keep running); to_thread keeps log context.
    outcomes_list = await asyncio.to_thread(engine.score, requests) if requests else []
    outcomes = iter(outcomes_list)
    tally.engine_s += time.perf_counter() - started
    for number, item, raw_id in chunk:
        outcome = next(outcomes) if isinstance(item, DecisionRequest) else item
        if isinstance(item, DecisionRequest):
            raw_id = item.id
        tally.lines += 1
        if isinstance(outcome, ArbiterError):
            tally.failed += 1
            tally.codes[outcome.code] += 1
        else:
            tally.ok += 1
            tally.prompt_tokens += outcome.prompt.input_tokens
        out.write(json.dumps(_record(number, raw_id, outcome)).encode() + b"\n")
    if metrics is not None:
        failed = sum(1 for _, item, _ in chunk if isinstance(item, ArbiterError))
        failed += sum(1 for o in outcomes_list if isinstance(o, ArbiterError))
        metrics.lines.labels("error").inc(failed)
        metrics.lines.labels("ok").inc(len(chunk) - failed)


async def _exists(s3: Any, bucket: str, key: str) -> bool:
    try:
        await s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}:
            return False
        raise
    return True


async def _upload(s3: Any, settings: WorkerSettings, key: str, spool: IO[bytes]) -> None:
    """Publish the spooled results whole: one PutObject, or parts completed in one call."""
    size = spool.seek(0, os.SEEK_END)
    spool.seek(0)
    content_type = "application/x-ndjson"
    if size <= settings.multipart_threshold_mb * MiB:
        await s3.put_object(
            Bucket=settings.bucket, Key=key, Body=spool.read(), ContentType=content_type
        )
        return
    part_size = int(settings.part_size_mb * MiB)
    upload = await s3.create_multipart_upload(
        Bucket=settings.bucket, Key=key, ContentType=content_type
    )
    upload_id = upload["UploadId"]
    try:
        parts = []
        number = 1
        while data := spool.read(part_size):
            part = await s3.upload_part(
                Bucket=settings.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
            )
            parts.append({"PartNumber": number, "ETag": part["ETag"]})
            number += 1
        await s3.complete_multipart_upload(
            Bucket=settings.bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
    except BaseException:
        await asyncio.shield(
            s3.abort_multipart_upload(Bucket=settings.bucket, Key=key, UploadId=upload_id)
        )
        raise


async def run_job(
    s3: Any, engine: Scorer, ref: JobRef, settings: WorkerSettings, metrics: Any = None
) -> JobReport:
    """Process one input object; idempotent per (key, ETag). Raises :class:`JobFailed` (or a
    botocore error) when it should be retried."""
    started = time.perf_counter()
    head_kw: dict[str, Any] = {"Bucket": ref.bucket, "Key": ref.key}
    if ref.version_id:
        head_kw["VersionId"] = ref.version_id
    try:
        head = await s3.head_object(**head_kw)
    except ClientError as exc:
        raise JobFailed(f"cannot read s3://{ref.bucket}/{ref.key}: {exc}") from exc
    etag = normalize_etag(head["ETag"]) or ""
    if ref.etag and ref.etag != etag:
        # The key was overwritten after this event; the newer version has its own event.
        return JobReport("superseded", ref)
    keys = output_keys(settings, ref.key, etag)
    if await _exists(s3, settings.bucket, keys.summary):
        return JobReport("duplicate", ref, keys)

    get_kw = {**head_kw, "IfMatch": f'"{etag}"'}
    response = await s3.get_object(**get_kw)
    tally = _Tally()
    with tempfile.TemporaryFile(dir=settings.tmp_dir) as spool:
        async with response["Body"] as body:
            chunk: list[Item] = []
            async for item in items_for(ref.key, _raw_chunks(body)):
                chunk.append(item)
                if len(chunk) >= settings.chunk_decisions:
                    await _score_chunk(engine, chunk, spool, tally, metrics)
                    chunk = []
            if chunk:
                await _score_chunk(engine, chunk, spool, tally, metrics)
        await _upload(s3, settings, keys.results, spool)
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
        "tokens": {"prompt": tally.prompt_tokens},
        "seconds": {"total": round(seconds, 4), "engine": round(tally.engine_s, 4)},
        "decisions_per_s": round(tally.lines / seconds, 3) if seconds > 0 else None,
        "model": engine.model_info.model_dump(mode="json"),
        "worker": {"host": socket.gethostname(), "pid": os.getpid()},
        "finished_at": datetime.now(UTC).isoformat(),
    }
    await s3.put_object(
        Bucket=settings.bucket,
        Key=keys.summary,
        Body=json.dumps(summary, indent=2).encode(),
        ContentType="application/json",
    )
    if metrics is not None:
        metrics.decisions_per_s.set(tally.lines / seconds if seconds > 0 else 0)
    return JobReport("ok", ref, keys, summary)
