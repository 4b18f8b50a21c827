"""The plan of the merge's multipart upload: which bytes of which shard output go in which part.

S3 refuses a part under 5 MiB unless it is the last (UploadPart and UploadPartCopy alike; moto too,
``EntityTooSmall``). A shard output of at least 5 MiB is copied inside S3 (``UploadPartCopy``, with a
byte range when its head tops up the part before it); smaller ones are downloaded and joined into
parts of about ``ARBITER_PART_SIZE_MB``. The plan is a function of the outputs' sizes alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MiB = 1024 * 1024
S3_MIN_PART = 5 * MiB  # every part but the last (UploadPart and UploadPartCopy alike)
S3_MAX_COPY = 5 * 1024 * MiB  # the largest part UploadPartCopy takes
S3_MAX_PARTS = 10_000


@dataclass(frozen=True)
class Piece:
    segment: int
    start: int
    end: int


@dataclass(frozen=True)
class Part:
    """One part of the upload: a copy of one range of an S3 object, or bytes joined here."""

    pieces: tuple[Piece, ...]
    copy: bool

    @property
    def size(self) -> int:
        return sum(p.end - p.start for p in self.pieces)


def plan_parts(
    sizes: Sequence[int], copyable: Sequence[bool], target: int, min_part: int = S3_MIN_PART
) -> list[Part]:
    """The parts that write ``sizes`` (segments in order) as one object: a copyable segment of at
    least ``min_part`` is copied (after its head tops up a short buffer of joined bytes to
    ``min_part``, when what remains is still ``min_part``); the rest is joined into parts of about
    ``target``. Every part but the last is at least ``min_part``."""
    if target < min_part:
        raise ValueError(f"part target {target} is below the minimum part {min_part}")
    parts: list[Part] = []
    buf: list[Piece] = []
    buffered = 0

    def flush() -> None:
        nonlocal buffered
        parts.append(Part(tuple(buf), copy=False))
        buf.clear()
        buffered = 0

    for seg, (size, can_copy) in enumerate(zip(sizes, copyable, strict=True)):
        pos = 0
        if can_copy and min_part <= size <= S3_MAX_COPY:
            need = max(0, min_part - buffered) if buffered else 0
            if size - need >= min_part:
                if need:
                    buf.append(Piece(seg, 0, need))
                    pos = need
                if buf:
                    flush()
                parts.append(Part((Piece(seg, pos, size),), copy=True))
                continue
        while pos < size:
            take = min(size - pos, target - buffered)
            buf.append(Piece(seg, pos, pos + take))
            buffered += take
            pos += take
            if buffered >= target:
                flush()
    if buf:
        flush()
    return parts


def plan_upload(sizes: Sequence[int], copyable: Sequence[bool], target: int) -> list[Part]:
    """:func:`plan_parts` within S3's 10,000 parts: past that (tens of GB of results), bigger
    joined parts."""
    plan = plan_parts(sizes, copyable, target)
    while len(plan) > S3_MAX_PARTS:
        target *= 2
        plan = plan_parts(sizes, [False] * len(sizes), target)
    return plan
