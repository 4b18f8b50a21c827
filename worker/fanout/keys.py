"""Where a split job lives while it runs: one folder per input version, named by a hash.

``<shard_prefix><sha256(bucket, key, etag)[:32]>/``: every folder name has the same length and no
``/`` inside, so no job's folder is a prefix of another's (a key that contains ``<name>.<etag>/``
cannot reach into a neighbour's shards), and a 1,024-byte key still gives a short folder::

    manifest.json              the plan: each shard's line range (written once, never changed)
    <plan>/in/<i>              shard i's input, framed (:mod:`worker.fanout.frames`); the same bytes
                               whoever cuts it, so a second splitter overwrites equal with equal
    out/<i>.<attempt>.jsonl    shard i's records as one attempt wrote them
    outcome/<i>.json           shard i's one outcome (If-None-Match: *): done or failed, the output
                               that counts and its tally
    count/<k>.json             status stripe k: the shards i mod K = k counted, and their sums
                               (worker.fanout.status)
    merge-claim.json           the count that sends the merge message (If-None-Match: *)

Everything here is deleted once the summary exists; a lifecycle rule expires what an abandoned job
leaves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from worker.settings import WorkerSettings

FOLDER_HEX = 32  # 128 bits of SHA-256: no two input versions share a folder


@dataclass(frozen=True)
class JobFolder:
    """The keys of one split job (see the module doc)."""

    base: str

    @property
    def manifest(self) -> str:
        return f"{self.base}manifest.json"

    def plan_prefix(self, plan: str) -> str:
        return f"{self.base}{plan}/"

    def input(self, plan: str, index: int) -> str:
        return f"{self.base}{plan}/in/{index:05d}"

    def output(self, index: int, attempt: str) -> str:
        return f"{self.base}out/{index:05d}.{attempt}.jsonl"

    @property
    def outcome_prefix(self) -> str:
        return f"{self.base}outcome/"

    def outcome(self, index: int) -> str:
        return f"{self.outcome_prefix}{index:05d}.json"

    def stripe(self, k: int) -> str:
        return f"{self.base}count/{k:03d}.json"

    @property
    def merge_claim(self) -> str:
        return f"{self.base}merge-claim.json"


def job_folder(settings: WorkerSettings, bucket: str, key: str, etag: str) -> JobFolder:
    name = "\0".join((bucket, key, etag)).encode()
    return JobFolder(f"{settings.shard_prefix}{hashlib.sha256(name).hexdigest()[:FOLDER_HEX]}/")


def outcome_index(key: str) -> int | None:
    """The shard index in an ``outcome/<i>.json`` key."""
    stem = key.rsplit("/", 1)[-1].removesuffix(".json")
    return int(stem) if stem.isdigit() else None
