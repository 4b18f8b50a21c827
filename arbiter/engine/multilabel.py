"""Multi-label questions: several options may hold, so each option is a yes/no question of its own.

A decision with ``question_type: "multi_label"`` becomes one yes/no decision per option over the
same state (so the state is prefilled once and each option is a short branch of it), each read and
calibrated as a ``noul`` question. The merged result lists, in the request's option order, the
probability that each option holds (they need not sum to one), ``choices`` (the options at 0.5 or
more), ``choice`` (the likeliest), and abstains when any of its options abstains.

Pure functions: the engine calls ``expand`` first and ``merge`` last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from arbiter.errors import ArbiterError
from arbiter.schema import DecisionRequest, DecisionResult, Option, Timing
from arbiter.scorer import Outcome

_MARK = "#holds"
YES_NO = (Option(id="true", description="Yes"), Option(id="false", description="No"))


def question(request: DecisionRequest, option: Option) -> str:
    return f"{request.question}\nConsider only this option: {option.description}\nDoes it apply?"


@dataclass(frozen=True)
class Plan:
    slots: list[list[int]]  # per input decision: its decisions in the expanded list
    multi: list[bool]


def expand(decisions: Sequence[DecisionRequest]) -> tuple[list[DecisionRequest], Plan | None]:
    if not any(d.question_type == "multi_label" for d in decisions):
        return list(decisions), None
    expanded: list[DecisionRequest] = []
    slots: list[list[int]] = []
    multi: list[bool] = []
    for request in decisions:
        if request.question_type != "multi_label":
            slots.append([len(expanded)])
            expanded.append(request)
            multi.append(False)
            continue
        slot = []
        for j, option in enumerate(request.options):
            slot.append(len(expanded))
            expanded.append(
                request.model_copy(
                    update={
                        "id": f"{request.id}{_MARK}{j}",
                        "question": question(request, option),
                        "question_type": "noul",
                        "options": list(YES_NO),
                    }
                )
            )
        slots.append(slot)
        multi.append(True)
    return expanded, Plan(slots, multi)


def merge(
    decisions: Sequence[DecisionRequest], outcomes: Sequence[Outcome], plan: Plan | None
) -> list[Outcome]:
    if plan is None:
        return list(outcomes)
    merged: list[Outcome] = []
    for request, slot, multi in zip(decisions, plan.slots, plan.multi, strict=True):
        parts = [outcomes[i] for i in slot]
        if not multi:
            merged.append(parts[0])
            continue
        error = next((p for p in parts if isinstance(p, ArbiterError)), None)
        if error is not None:
            merged.append(error)
            continue
        merged.append(merge_one(request, [p for p in parts if isinstance(p, DecisionResult)]))
    return merged


def merge_one(request: DecisionRequest, parts: Sequence[DecisionResult]) -> DecisionResult:
    """One result from the yes/no results of each option (in the request's option order)."""
    holds = [dict(zip(p.option_ids, p.probabilities, strict=True))["true"] for p in parts]
    ids = [o.id for o in request.options]
    log_odds = [math.log(max(p, 1e-300)) - math.log(max(1.0 - p, 1e-300)) for p in holds]
    first = parts[0]
    abstaining = [p for p in parts if p.abstained]
    return first.model_copy(
        update={
            "id": request.id,
            "option_ids": ids,
            "probabilities": holds,
            "option_logits": log_odds,
            "choice": ids[max(range(len(ids)), key=lambda i: holds[i])],
            "choices": [i for i, p in zip(ids, holds, strict=True) if p >= 0.5],
            "allowed_mass": sum(p.allowed_mass for p in parts) / len(parts),
            "orders_read": sum(p.orders_read for p in parts),
            "abstained": bool(abstaining),
            "abstention": (abstaining[0] if abstaining else first).abstention,
            "prompt": first.prompt.model_copy(
                update={
                    "version": f"{first.prompt.version}+multi-label",
                    "input_tokens": first.prompt.prefix_tokens
                    + sum(p.prompt.input_tokens - p.prompt.prefix_tokens for p in parts),
                }
            ),
            "timing": Timing(
                tokenize_s=sum(p.timing.tokenize_s for p in parts),
                prefill_s=max(p.timing.prefill_s for p in parts),
                readout_s=sum(p.timing.readout_s for p in parts),
                total_s=sum(p.timing.tokenize_s + p.timing.readout_s for p in parts)
                + max(p.timing.prefill_s for p in parts),
            ),
        }
    )
