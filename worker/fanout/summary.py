"""A split job's summary: the single path's shape, added up from the shards' outcomes, plus what the
shards did. Its counts are a function of the outcomes alone, which are the same for every merger,
so two merges write equal counts and the summary agrees with the results made of those outcomes.

A results object found before the merge wrote one (a redo after a lost summary) is reused only if
it was made of the same outcomes (the digest of the outcomes is in its metadata,
:func:`outcomes_digest`); one made of other outcomes (a re-send after the summary alone was lost:
the re-run's shards scored again) is described as it is, record by record (:class:`ResultsTally`),
so the summary always says what the results hold.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import socket
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from worker.fanout.outcome import ShardOutcome
from worker.fanout.plan import Manifest
from worker.outputs import OutputKeys


def prefix_reuse(manifest: Manifest, outcomes: list[ShardOutcome]) -> dict[str, Any]:
    """How much of the single path's state reuse the shard cut kept: a run of lines sharing a state
    is prefilled once by one worker; each shard boundary inside such a run costs one more."""
    done = {o.index: o for o in outcomes if o.state == "done"}
    decisions = sum(o.decisions for o in done.values())
    runs = sum(o.runs for o in done.values())
    cut = 0
    for span in manifest.shards[1:]:
        before, after = done.get(span.index - 1), done.get(span.index)
        if before and after and before.last_state and before.last_state == after.first_state:
            cut += 1
    single_reuse = decisions - (runs - cut)  # decisions that reuse a prefill on one worker
    kept = (decisions - runs) / single_reuse if single_reuse > 0 else 1.0
    return {
        "decisions": decisions,
        "state_runs": runs - cut,
        "runs_cut_by_shards": cut,
        "boundaries_moved_to_keep_runs": manifest.runs_kept_whole,
        "kept": round(kept, 4),
    }


def models(outcomes: list[ShardOutcome]) -> list[dict[str, Any]]:
    """Every model that scored a shard (a rolling update can straddle a job), by SHA-256, with the
    shards it scored, most shards first."""
    by_sha: dict[str, dict[str, Any]] = {}
    shards: Counter[str] = Counter()
    for outcome in outcomes:
        if outcome.model is not None:
            sha = str(outcome.model.get("sha256"))
            by_sha.setdefault(sha, outcome.model)
            shards[sha] += 1
    return [{**by_sha[sha], "shards": n} for sha, n in shards.most_common()]


def build_summary(
    manifest: Manifest, keys: OutputKeys, outcomes: list[ShardOutcome], stats: dict[str, Any]
) -> dict[str, Any]:
    """The job's summary, in the single path's shape, plus what the shards did."""
    codes: Counter[str] = Counter()
    for outcome in outcomes:
        codes.update(outcome.errors_by_code)
    lines = sum(o.lines for o in outcomes)
    ok = sum(o.ok for o in outcomes)
    failed = [o for o in outcomes if o.state == "failed"]
    spans = {s.index: s for s in manifest.shards}
    total_s = max(1e-6, time.time() - manifest.created_ts)
    scored_by = models(outcomes)
    return {
        "input": manifest.input,
        "results_key": keys.results,
        "lines": lines,
        "ok": ok,
        "failed": lines - ok,
        "errors_by_code": dict(sorted(codes.items())),
        "abstained": sum(o.abstained for o in outcomes),
        "tokens": {"prompt": sum(o.prompt_tokens for o in outcomes)},
        "seconds": {
            "total": round(total_s, 4),
            "engine": round(sum(o.engine_s for o in outcomes), 4),
            "merge": stats.get("seconds"),
        },
        "decisions_per_s": round(lines / total_s, 3),
        "model": {k: v for k, v in scored_by[0].items() if k != "shards"} if scored_by else None,
        "models": scored_by,
        "worker": {"host": socket.gethostname(), "pid": os.getpid()},
        "started_at": manifest.created_at,
        "finished_at": datetime.now(UTC).isoformat(),
        "shards": {
            "count": manifest.count,
            "shard_lines": manifest.shard_lines,
            "plan": manifest.plan,
            "done": manifest.count - len(failed),
            "failed": [
                {
                    "index": o.index,
                    "first_line": spans[o.index].first,
                    "last_line": spans[o.index].last,
                    "lines": o.lines,
                    "error": o.error,
                    "receives": o.receives,
                }
                for o in failed
            ],
            "workers": len(
                {json.dumps(o.worker, sort_keys=True) for o in outcomes if o.state == "done"}
            ),
            "merge": stats,
            "prefix_reuse": prefix_reuse(manifest, outcomes),
        },
    }


def outcomes_digest(outcomes: list[ShardOutcome]) -> str:
    """What a results object was made of: each shard's outcome attempt and size."""
    text = "\n".join(
        f"{o.index} {o.attempt} {o.bytes}" for o in sorted(outcomes, key=lambda o: o.index)
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ResultsTally:
    """A results object's counts, record by record, and the shards whose every line is
    ``shard_failed`` in it (see the module doc)."""

    def __init__(self, manifest: Manifest) -> None:
        self.spans = manifest.shards
        self.starts = [s.first for s in self.spans]
        self.lines = self.ok = self.tokens = self.abstained = 0
        self.codes: Counter[str] = Counter()
        self.lost: Counter[int] = Counter()  # shard_failed lines by shard
        self.errors: dict[int, str] = {}
        self.models: dict[int, dict[str, Any]] = {}  # the model of each shard's first result

    def add(self, record: dict[str, Any]) -> None:
        self.lines += 1
        shard = max(0, bisect.bisect_right(self.starts, int(record.get("line", 0))) - 1)
        error = record.get("error")
        if error is not None:
            self.codes[error.get("code", "unknown")] += 1
            if error.get("code") == "shard_failed":
                self.lost[shard] += 1
                self.errors.setdefault(shard, str(error.get("message", "")))
            return
        self.ok += 1
        result = record.get("result", {})
        self.tokens += int(result.get("prompt", {}).get("input_tokens", 0))
        self.abstained += int(bool(result.get("abstained")))
        if isinstance(result.get("model"), dict):
            self.models.setdefault(shard, result["model"])

    def apply(self, summary: dict[str, Any]) -> dict[str, Any]:
        """``summary`` with the counts, models and failed shards of these results."""
        failed = [
            {
                "index": span.index,
                "first_line": span.first,
                "last_line": span.last,
                "lines": span.items,
                "error": self.errors.get(span.index),
                "receives": None,
            }
            for span in self.spans
            if self.lost[span.index] == span.items
        ]
        by_sha: dict[str, dict[str, Any]] = {}
        shards: Counter[str] = Counter()
        for model in self.models.values():
            sha = str(model.get("sha256"))
            by_sha.setdefault(sha, model)
            shards[sha] += 1
        scored_by = [{**by_sha[sha], "shards": n} for sha, n in shards.most_common()]
        merge = {**summary["shards"]["merge"], "results_match_outcomes": False}
        return {
            **summary,
            "lines": self.lines,
            "ok": self.ok,
            "failed": self.lines - self.ok,
            "errors_by_code": dict(sorted(self.codes.items())),
            "abstained": self.abstained,
            "tokens": {"prompt": self.tokens},
            "model": {k: v for k, v in scored_by[0].items() if k != "shards"}
            if scored_by
            else None,
            "models": scored_by,
            "shards": {
                **summary["shards"],
                "done": len(self.spans) - len(failed),
                "failed": failed,
                "merge": merge,
            },
        }
