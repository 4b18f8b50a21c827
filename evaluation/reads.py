"""Raw reads of labeled items in several option orders: what `arbiter calibrate` fits on.

Each item is read, on one prefill of its state, in every order a study or a fit needs: its ``n``
cyclic rotations (for the position prior, ``rotation.fit_prior``) and the orders adaptive rotation
would read for the item and for the item with its options reversed (for the flip rate). The reads
are raw: one order each (``order_samples: 1``), at T = 1, with no calibration applied, so a fitted
prior or temperature applies to what the model said, not to an earlier correction. An endpoint
that serves a calibration is refused (serve it with ``ARBITER_SHIPPED_CALIBRATION=false``).

A record keeps, per order (``"2,0,1"``: the variant lists given options 2, 0, 1), the label logits
as read in the variant's positions and the label mass there; ``policy`` replays any read policy on
them exactly as the engine runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from arbiter.engine.rotation import Order, cyclic_orders, rounds
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


def orders_for(n: int, rotations: bool = True) -> list[Order]:
    """Every order a fit or a study reads for ``n`` options: the adaptive rounds of the given
    order and of the reversed one, and (``rotations``) the cyclic rotations."""
    identity = tuple(range(n))
    wanted: list[Order] = []
    for start in (identity, identity[::-1]):
        for round_ in rounds(n):
            for order in round_:
                wanted.append(in_terms_of(start, order))
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
) -> list[dict[str, Any]]:
    """One record per item with its reads (or its error). ``rotated``: whether an item is also
    read in its cyclic rotations (the items a prior is fitted on; held-out items need not be)."""
    from tqdm import tqdm

    records = []
    with tqdm(total=len(items), unit="item", file=sys.stderr, disable=not progress) as bar:
        for item in items:
            n = len(item.request.options)
            orders = orders_for(n, rotated(item))
            outcomes = backend.decide_many([variant(item.request, o) for o in orders])
            record: dict[str, Any] = {
                "id": item.id,
                "file": item.file,
                "tier": item.tier,
                "family": item.family,
                "split": item.split,
                "question_type": item.question_type,
                "label": item.label,
                "label_index": item.label_index,
                "n": n,
                "tokens": None,
                "reads": {},
                "error": None,
            }
            for order, (result, error) in zip(orders, outcomes, strict=True):
                if result is None:
                    record["error"] = error
                    record["reads"] = {}
                    break
                record["reads"][key(order)] = _read(result)
                if order == tuple(range(n)):
                    record["tokens"] = (result.get("prompt") or {}).get("input_tokens")
                    record["model"] = result.get("model")
            records.append(record)
            bar.update(1)
    return records


def reads_of(record: dict[str, Any]) -> dict[Order, tuple[np.ndarray, float]]:
    """A record's reads by order: logits as read and the label mass."""
    return {
        parse_key(k): (np.asarray(v["logits"], dtype=np.float64), float(v["mass"]))
        for k, v in record["reads"].items()
    }
