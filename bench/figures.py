"""Figures that cannot lie quietly, and progress that says a long run is alive.

A ratio a benchmark prints is checked before it is shown, as pytest-benchmark and hyperfine warn
on outliers and noise:

- **below its floor** (or above its ceiling): a run that does at least the baseline's work cannot
  take less time than the baseline (the engine against the ``llama_decode`` floor, HTTP against the
  engine alone, greedy decoding against the decode floor). Such a figure measured the machine's
  load, not the code: a loaded machine printed 0.59x the floor and "end to end 4.9x faster than
  the engine alone" without a word.
- **a spread wider than the effect**: the paired ratios' interquartile range (their whole range
  below 4 pairs) is wider than the ratio's distance from 1, so the run cannot tell which side is
  faster (`bench all` reversed a headline at n=2).
- **fewer than 3 pairs**: no spread can be measured at all.

Each warning is printed on stderr as it is found (``warning: ...``) and returned, so a bench puts
it in its JSON too and `arbiter bench all` shows it in its table.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TextIO

import numpy as np

MIN_PAIRS = 3


@dataclass(frozen=True)
class Ratio:
    """One printed ratio (``value``), the per-pair ratios it came from, and what it can be."""

    name: str
    value: float
    pairs: tuple[float, ...] = ()
    floor: float | None = None
    ceiling: float | None = None

    def spread(self) -> tuple[float, float] | None:
        """The pairs' interquartile range (their range below 4 pairs); None below 2 pairs."""
        if len(self.pairs) < 2:
            return None
        if len(self.pairs) < 4:
            return min(self.pairs), max(self.pairs)
        low, high = np.percentile(self.pairs, [25, 75])
        return float(low), float(high)

    def warnings(self) -> list[str]:
        out = []
        if self.floor is not None and self.value < self.floor:
            out.append(
                f"{self.name} = {self.value:.3f} is below its floor {self.floor:g} (it does at "
                "least the baseline's work): the machine's load moved the baseline, not the code"
            )
        if self.ceiling is not None and self.value > self.ceiling:
            out.append(
                f"{self.name} = {self.value:.3f} is above its ceiling {self.ceiling:g}, which "
                "it cannot physically pass: the machine's load moved the baseline, not the code"
            )
        spread = self.spread()
        if len(self.pairs) < MIN_PAIRS:
            out.append(f"{self.name}: {len(self.pairs)} pair(s), too few to measure a spread")
        elif spread is not None and spread[1] - spread[0] > abs(self.value - 1.0):
            out.append(
                f"{self.name} = {self.value:.3f}: the spread of its {len(self.pairs)} pairs "
                f"({spread[0]:.3f}-{spread[1]:.3f}) is wider than its effect "
                f"({abs(self.value - 1.0):.3f} from 1): this run cannot tell"
            )
        return out


def paired(
    name: str,
    ours: Sequence[float],
    theirs: Sequence[float],
    *,
    floor: float | None = None,
    ceiling: float | None = None,
) -> Ratio:
    """median(ours) / median(theirs), with each pair's own ratio for its spread."""
    pairs = tuple(o / t for o, t in zip(ours, theirs, strict=True) if t > 0)
    value = statistics.median(ours) / statistics.median(theirs)
    return Ratio(name, value, pairs, floor, ceiling)


def check(ratios: Iterable[Ratio], stream: TextIO | None = None) -> list[str]:
    """Every warning of ``ratios``, each printed as ``warning: ...`` on stderr (or ``stream``)."""
    found = [line for ratio in ratios for line in ratio.warnings()]
    for line in found:
        print(f"warning: {line}", file=stream or sys.stderr, flush=True)
    return found


class Progress:
    """``[bench NAME 41 s] what`` on stderr: what a long run is doing and for how long, at most one
    line every ``every_s`` seconds (``always=True`` prints regardless)."""

    def __init__(self, label: str, every_s: float = 5.0, stream: TextIO | None = None) -> None:
        self.label = label
        self.every_s = every_s
        self.stream = stream
        self.started = time.monotonic()
        self.last = -float("inf")

    def __call__(self, what: str, *, always: bool = False) -> None:
        now = time.monotonic()
        if always or now - self.last >= self.every_s:
            self.last = now
            print(
                f"[bench {self.label} {now - self.started:.0f} s] {what}",
                file=self.stream or sys.stderr,
                flush=True,
            )


def verdict(passes: dict[str, bool], targets: set[str], smoke: bool) -> int:
    """A bench's exit status: 1 when a check of the server's behaviour failed (a status, a freed
    slot, an unchanged probe), or a performance target was missed outside a smoke run, whose sizes
    are too small to judge one (its misses are printed, not counted)."""
    failed = [name for name, ok in passes.items() if not ok]
    judged = [name for name in failed if name not in targets or not smoke]
    for name in failed:
        if name not in judged:
            print(f"target missed, not judged at the smoke size: {name}", file=sys.stderr)
    return 1 if judged else 0
