"""Scoring labeled items serially against a backend, one record per item (latency included)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from arbiter.schema import DecisionRequest
from evaluation.backends import Backend
from evaluation.tasks import EvalItem


def _record(
    item: EvalItem, result: dict[str, Any] | None, error: Any, elapsed: float
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": item.id,
        "file": item.file,
        "tier": item.tier,
        "family": item.family,
        "split": item.split,
        "question_type": item.question_type,
        "label": item.label,
        "label_index": item.label_index,
        "latency_s": elapsed,
        "choice": None,
        "correct": False,
        "probabilities": None,
        "option_logits": None,
        "error": error,
    }
    if result is None:
        return record
    ids = [o.id for o in item.request.options]
    if list(result.get("option_ids", [])) != ids:
        record["error"] = {
            "type": "api_error",
            "code": "bad_response",
            "message": "option ids differ",
        }
        return record
    record.update(
        choice=result["choice"],
        correct=result["choice"] == item.label,
        probabilities=[float(p) for p in result["probabilities"]],
        option_logits=[float(x) for x in result["option_logits"]],
        allowed_mass=result.get("allowed_mass"),
        prompt_version=(result.get("prompt") or {}).get("version"),
        probability_status=result.get("probability_status"),
        model=result.get("model"),
    )
    return record


def run(
    items: Sequence[EvalItem],
    backend: Backend,
    order_samples: int | None = None,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Score every item serially. With ``order_samples`` > 1, also the plain order (baseline)."""
    from tqdm import tqdm

    k = order_samples if order_samples and order_samples > 1 else None
    records: list[dict[str, Any]] = []
    baseline: list[dict[str, Any]] | None = [] if k else None
    total = len(items) * (2 if k else 1)
    with tqdm(total=total, unit="decision", file=sys.stderr, disable=not progress) as bar:
        for item in items:
            plain = item.request.model_copy(update={"order_samples": None})
            if baseline is not None:
                baseline.append(_timed(item, plain, backend))
                bar.update(1)
            request = item.request.model_copy(update={"order_samples": k}) if k else plain
            records.append(_timed(item, request, backend))
            bar.update(1)
    return records, baseline


def _timed(item: EvalItem, request: DecisionRequest, backend: Backend) -> dict[str, Any]:
    started = time.perf_counter()
    result, error = backend.decide(request)
    return _record(item, result, error, time.perf_counter() - started)
