"""Scoring labeled items serially against a backend, one record per item (latency included), and
each item again with its options reversed (what the flip rate compares)."""

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
    got = list(result.get("option_ids", []))
    if sorted(got) != sorted(ids):
        record["error"] = {
            "type": "api_error",
            "code": "bad_response",
            "message": "option ids differ",
        }
        return record
    # In the item's own option order, whatever order the request listed them in.
    by_id = dict(zip(got, result["probabilities"], strict=True))
    logits = dict(zip(got, result["option_logits"], strict=True))
    record.update(
        choice=result["choice"],
        correct=result["choice"] == item.label,
        probabilities=[float(by_id[i]) for i in ids],
        option_logits=[float(logits[i]) for i in ids],
        allowed_mass=result.get("allowed_mass"),
        orders_read=result.get("orders_read", 1),
        abstained=result.get("abstained", False),
        prompt_version=(result.get("prompt") or {}).get("version"),
        input_tokens=(result.get("prompt") or {}).get("input_tokens"),
        probability_status=result.get("probability_status"),
        model=result.get("model"),
    )
    return record


def run(
    items: Sequence[EvalItem],
    backend: Backend,
    order_samples: int | None = None,
    reversed_order: bool = True,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Score every item serially (with ``order_samples`` when set) and, with
    ``reversed_order``, every item again with its options listed in reverse."""
    from tqdm import tqdm

    records: list[dict[str, Any]] = []
    flipped: list[dict[str, Any]] | None = [] if reversed_order else None
    total = len(items) * (2 if reversed_order else 1)
    with tqdm(total=total, unit="decision", file=sys.stderr, disable=not progress) as bar:
        for item in items:
            request = item.request
            if order_samples is not None:
                request = request.model_copy(update={"order_samples": order_samples})
            records.append(_timed(item, request, backend))
            bar.update(1)
            if flipped is not None:
                reverse = request.model_copy(update={"options": request.options[::-1]})
                flipped.append(_timed(item, reverse, backend))
                bar.update(1)
    return records, flipped


def _timed(item: EvalItem, request: DecisionRequest, backend: Backend) -> dict[str, Any]:
    started = time.perf_counter()
    result, error = backend.decide(request)
    return _record(item, result, error, time.perf_counter() - started)
