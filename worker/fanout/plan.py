"""The plan of a split job: its shards' line ranges, named by what determines them.

The cut is a function of the input version and the cutting settings alone (shard size, item size
limit, format), so the plan is named by a hash of those: two workers that split the same input with
the same settings write the same shard inputs to the same keys and the same plan. The manifest is
written once (``If-None-Match: *``) and never changed, so any worker may keep it in memory for as
long as it likes (:class:`ManifestCache`): a shard message names the plan it belongs to, and a plan
id never means two things.

A manifest write that meets a manifest is resolved by reading it: if it names this writer's own
attempt, it is this write's first copy (botocore resent it after a lost answer); if it is the same
plan from another splitter (a duplicate delivery), the shards are the same; if it is another plan (a
splitter with other settings got there first), that one counts and this splitter's inputs are
deleted. Either way the job goes on from the manifest that exists.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from worker.fanout.keys import JobFolder
from worker.s3io import get_json, put_new

# Bump when the cut itself changes (the boundary rule, the shard input format, MAX_SHARDS): a plan id
# must never name two different cuts.
CUT_VERSION = 2
MAX_SHARDS = 10_000  # see docs/batch-jobs.md, "Limits of one split job"
STRIPES = 32  # the most status stripes of one job (worker.fanout.status: counting, striped)


class ShardSpan(BaseModel):
    """One shard: items ``first``..``last`` (1-based line or element numbers), ``items`` of them;
    ``gaps``: the ranges inside that hold no item (blank lines), so a shard whose input is gone
    still gets one record per item."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    index: int = Field(ge=0)
    first: int = Field(ge=1)
    last: int = Field(ge=1)
    items: int = Field(ge=1)
    bytes: int = Field(ge=0)
    gaps: list[tuple[int, int]] = Field(default_factory=list)

    def numbers(self) -> list[int]:
        """The item numbers of the shard, in order."""
        skipped = {n for a, b in self.gaps for n in range(a, b + 1)}
        return [n for n in range(self.first, self.last + 1) if n not in skipped]


class Manifest(BaseModel):
    """The plan of one input version (see the module doc)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: Literal[2] = 2
    plan: str
    writer: str  # the splitting attempt: tells a resent write of one's own from another's
    input: dict[str, Any]
    kind: Literal["line", "element"]
    shard_lines: int
    items: int
    shards: list[ShardSpan]
    runs_kept_whole: int = 0  # boundaries moved on so a run of one state stays in one shard
    runs_cut: int = 0  # boundaries inside a run of one state longer than the allowed move
    created_at: str
    created_ts: float
    stripes: int | None = None  # status stripes (worker.fanout.status); None: min(count, STRIPES)

    @property
    def count(self) -> int:
        return len(self.shards)

    @property
    def stripe_count(self) -> int:
        """How many stripes count this job's shards (shard i in stripe i mod this)."""
        return self.stripes or max(1, min(self.count, STRIPES))


def plan_id(kind: str, shard_lines: int, max_line_bytes: int) -> str:
    """The name of the cut of an input by these settings (the folder already names the input)."""
    text = f"cut {CUT_VERSION} {kind} {shard_lines} {max_line_bytes} {MAX_SHARDS}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


async def read_manifest(s3: Any, bucket: str, folder: JobFolder) -> Manifest | None:
    got = await get_json(s3, bucket, folder.manifest)
    return None if got is None else Manifest.model_validate(got[0])


async def write_manifest(
    s3: Any, bucket: str, folder: JobFolder, manifest: Manifest
) -> tuple[Manifest, bool]:
    """Write the manifest once; the manifest that counts, and whether it is this attempt's own."""
    if await put_new(s3, bucket, folder.manifest, manifest.model_dump(mode="json")):
        return manifest, True
    existing = await read_manifest(s3, bucket, folder)
    if existing is None:  # the job finished and its folder went between the two calls
        return manifest, True
    return existing, existing.writer == manifest.writer


class ManifestCache:
    """Manifests by folder and plan: immutable, so never revalidated (the 64 last used)."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._by_plan: OrderedDict[tuple[str, str], Manifest] = OrderedDict()

    async def get(self, s3: Any, bucket: str, folder: JobFolder, plan: str) -> Manifest | None:
        """The manifest of ``plan``; None if the folder has none, or another plan's."""
        found = self._by_plan.get((folder.base, plan))
        if found is None:
            found = await read_manifest(s3, bucket, folder)
            if found is None or found.plan != plan:
                return None
            self._by_plan[(folder.base, plan)] = found
            if len(self._by_plan) > self.size:
                self._by_plan.popitem(last=False)
        self._by_plan.move_to_end((folder.base, plan))
        return found
