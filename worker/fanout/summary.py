"""A split job's summary: the single path's shape, added up from the shards' outcomes, plus what the
shards did. Its counts are a function of the outcomes alone, which are the same for every merger,
so two merges write equal counts and the summary always agrees with the results (both are made of
the same outcomes)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from worker.fanout.outcome import Outcome
from worker.fanout.plan import Manifest
from worker.jobs import OutputKeys


def prefix_reuse(manifest: Manifest, outcomes: list[Outcome]) -> dict[str, Any]:
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


def models(outcomes: list[Outcome]) -> list[dict[str, Any]]:
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
    manifest: Manifest, keys: OutputKeys, outcomes: list[Outcome], stats: dict[str, Any]
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
