"""Raw reads of labeled items in several option orders: what `arbiter calibrate` fits on.

Each item is read, on one prefill of its state, in every order a study or a fit needs: its ``n``
cyclic rotations (for the position prior, ``rotation.fit_prior``) and the orders adaptive rotation
would read for the item and for the item with its options reversed (for the flip rate). The reads
are raw: one order each (``order_samples: 1``), at T = 1, with no calibration applied, so a fitted
prior or temperature applies to what the model said, not to an earlier correction. An endpoint
that serves a calibration is refused (serve it with ``ARBITER_SHIPPED_CALIBRATION=false``).

A record keeps, per order (``"2,0,1"``: the variant lists given options 2, 0, 1), the label logits
as read in the variant's positions and the label mass there; ``policy`` replays any read policy on
them exactly as the engine runs it. It also keeps the prompt's tokens and how many of them are the
state's prefix, prefilled once whatever the orders read (``policy.cost_ratio``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from arbiter.engine.rotation import Order, canonical, cyclic_orders, rounds
from arbiter.schema import DecisionRequest
from evaluation.backends import Backend
from evaluation.tasks import EvalItem

MAX_ROTATED = 10  # items with more options are read in the adaptive orders only


def key(order: Order) -> str:
    return ",".join(str(i) for i in order)


def parse_key(text: str) -> Order:
    return tuple(int(i) for i in text.split(","))


def in_terms_of(start: Order, order: Order) -> Order:
    """``order`` of a request whose options are the given ones in ``start``, as an order of the
    given options."""
    return tuple(start[i] for i in order)


def start_of(option_ids: Sequence[str], base: Order, adaptive: bool) -> Order:
    """The first order a request whose options are the given ones in ``base`` is read in, as an
    order of the given options: its canonical order when read adaptively, else ``base`` itself."""
    if not adaptive:
        return base
    return in_terms_of(base, canonical([option_ids[i] for i in base]))


def orders_for(option_ids: Sequence[str], rotations: bool = True) -> list[Order]:
    """Every order a fit or a study reads: the given order and the reversed one (one read each,
    as the single-order policy reads them), the adaptive rounds from the canonical order, and
    (``rotations``) the given order's cyclic rotations, for the position prior."""
    n = len(option_ids)
    identity = tuple(range(n))
    start = start_of(option_ids, identity, adaptive=True)
    wanted: list[Order] = [identity, identity[::-1]]
    for round_ in rounds(n):
        wanted += [in_terms_of(start, order) for order in round_]
    if rotations and n <= MAX_ROTATED:
        wanted += cyclic_orders(n)
    return list(dict.fromkeys(wanted))


def variant(request: DecisionRequest, order: Order) -> DecisionRequest:
    return request.model_copy(
        update={
            "id": f"{request.id}#read{key(order)}",
            "options": [request.options[i] for i in order],
            "order_samples": 1,
            "temperature": 1.0,
            "max_error": None,
            "min_confidence": None,
        }
    )


def _read(result: dict[str, Any]) -> dict[str, Any]:
    if result.get("probability_status") != "raw":
        raise RuntimeError(
            "the backend returned calibrated reads: calibrate against raw reads (an endpoint "
            "served with ARBITER_SHIPPED_CALIBRATION=false and no ARBITER_CALIBRATION)"
        )
    return {"logits": [float(x) for x in result["option_logits"]], "mass": result["allowed_mass"]}


def collect(
    items: Sequence[EvalItem],
    backend: Backend,
    rotated: Callable[[EvalItem], bool] = lambda item: True,
    progress: bool = True,
    done: dict[tuple[str, str], dict[str, Any]] | None = None,
    sink: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One record per item with its reads (or its error). ``rotated``: whether an item is also
    read in its cyclic rotations (the items a prior is fitted on; held-out items need not be).
    ``done``: records read before (by file and id): only the orders they lack are read. Each
    record goes to ``sink`` as soon as it is complete, so a long run can be resumed."""
    from tqdm import tqdm

    records = []
    with tqdm(total=len(items), unit="item", file=sys.stderr, disable=not progress) as bar:
        for item in items:
            ids = [o.id for o in item.request.options]
            record = _record(item, (done or {}).get((item.file, item.id)))
            have = {parse_key(k) for k in record["reads"]}
            orders = [o for o in orders_for(ids, rotated(item)) if o not in have]
            outcomes = (
                backend.decide_many([variant(item.request, o) for o in orders]) if orders else []
            )
            for order, (result, error) in zip(orders, outcomes, strict=True):
                if result is None:
                    record["error"] = error
                    record["reads"] = {}
                    break
                record["reads"][key(order)] = _read(result)
                if order == tuple(range(len(ids))):
                    prompt = result.get("prompt") or {}
                    record["tokens"] = prompt.get("input_tokens")
                    record["prefix_tokens"] = prompt.get("prefix_tokens")
                    record["model"] = result.get("model")
            records.append(record)
            if sink is not None and orders:  # one resumed whole is already where sink wrote it
                sink(record)
            bar.update(1)
    return records


def _record(item: EvalItem, earlier: dict[str, Any] | None) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": item.id,
        "file": item.file,
        "tier": item.tier,
        "family": item.family,
        "split": item.split,
        "question_type": item.question_type,
        "label": item.label,
        "label_index": item.label_index,
        "option_ids": [o.id for o in item.request.options],
        "n": len(item.request.options),
        "tokens": None,
        "prefix_tokens": None,
        "reads": {},
        "error": None,
    }
    if earlier is not None and not earlier.get("error"):
        record.update(
            reads=dict(earlier["reads"]),
            tokens=earlier.get("tokens"),
            prefix_tokens=earlier.get("prefix_tokens"),
            model=earlier.get("model"),
        )
    return record


def reads_of(record: dict[str, Any]) -> dict[Order, tuple[np.ndarray, float]]:
    """A record's reads by order: logits as read and the label mass."""
    return {
        parse_key(k): (np.asarray(v["logits"], dtype=np.float64), float(v["mass"]))
        for k, v in record["reads"].items()
    }
