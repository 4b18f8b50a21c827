"""Where a job's outputs go: its results, summary, rejection and status keys, named from its input
key and ETag, so the same input version always maps to the same keys (what makes redelivery safe)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from worker.settings import WorkerSettings

MAX_KEY_BYTES = 1024  # S3's limit on an object key


@dataclass(frozen=True)
class OutputKeys:
    results: str
    summary: str

    @property
    def rejected(self) -> str:
        """``....<etag>.rejected.json``: why the job was refused (never beside a summary)."""
        return self.summary.removesuffix(".summary.json") + ".rejected.json"

    @property
    def status(self) -> str:
        """``....<etag>.status.json``: the job's progress (worker.progress, worker.fanout.status)."""
        return self.summary.removesuffix("summary.json") + "status.json"


def output_keys(settings: WorkerSettings, key: str, etag: str) -> OutputKeys:
    """``<output-prefix><key without input prefix>.<etag>.results.jsonl`` and ``...summary.json``:
    the same input version always maps to the same keys, which is what makes redelivery safe.

    A name too long for S3's 1,024-byte keys is cut (at a character boundary) and ends in ``~`` and
    16 hex digits of its SHA-256, so distinct long names keep distinct outputs.
    """
    name = key.removeprefix(settings.input_prefix)
    fixed = len(f"{settings.output_prefix}.{etag}.results.jsonl".encode())
    base = f"{settings.output_prefix}{fit_name(name, MAX_KEY_BYTES - fixed)}.{etag}"
    return OutputKeys(f"{base}.results.jsonl", f"{base}.summary.json")


def fit_name(name: str, room: int) -> str:
    """``name`` if it fits in ``room`` bytes; else cut at a character boundary, ending in ``~`` and
    16 hex digits of its SHA-256 (distinct long names stay distinct)."""
    encoded = name.encode()
    if len(encoded) <= room:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    head = encoded[: max(0, room - len(digest) - 1)].decode("utf-8", "ignore")
    return f"{head}~{digest}"
