"""`arbiter bench models`: the bundled models and the installed instruct models side by side.

For each model (Gemma 3 270M, SmolLM2 135M, and the Qwen2.5 Coder models `arbiter models install`
put in the store, each skipped with a note when not installed): probability mass on the option
labels (median, min), accuracy on the labeled examples, how often the first option wins (position
bias), the engine's median time per decision, and that time against the floor on the same model
and tokens (a plain prefill with logits at the last position, measured right after each decision),
and what the read check at load measured and cost (against one decision), all in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from arbiter import model_store
from arbiter.engine import open_engine
from arbiter.models import bundled_model, smollm2_path
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.settings import EngineSettings
from bench.common import LABELED, ONE_READ
from bench.figures import Ratio, check
from bench.floor import plain_pass

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {"file": str(LABELED), "limit": 2}


def _load(path: Path) -> tuple[list[DecisionRequest], list[str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    requests = [
        DecisionRequest.model_validate({k: v for k, v in r.items() if k != "label"}) for r in rows
    ]
    return requests, [r["label"] for r in rows]


def measure(model: Path, requests: list[DecisionRequest], labels: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    settings = EngineSettings(
        model=model, prefix_cache_mb=0, read_check="warn", order_policy=ONE_READ
    )
    engine = open_engine(settings)
    load_s = time.perf_counter() - started  # the read check included
    read = engine.read_check
    assert read is not None  # open_engine ran it
    try:
        engine.score(requests[:1])  # warm-up
        results: list[DecisionResult] = []
        per_decision, floor_rates, vs_floor = [], [], []
        for request in requests:
            started = time.perf_counter()
            outcome = engine.score([request])[0]
            per_decision.append(time.perf_counter() - started)
            assert isinstance(outcome, DecisionResult), outcome
            results.append(outcome)
            tokens = engine.prompt_tokens(request)
            _, floor_s = plain_pass(engine, tokens)
            floor_rates.append(len(tokens) / floor_s)
            vs_floor.append(per_decision[-1] / floor_s)
        masses = [r.allowed_mass for r in results]
        return {
            "model": engine.model_info.file,
            "quantization": engine.model_info.quantization,
            "chat_template": engine.model_info.chat_template,
            "mb": round(engine.model_info.bytes / 2**20, 1),
            "decisions": len(results),
            "accuracy": sum(r.choice == y for r, y in zip(results, labels, strict=True))
            / len(results),
            "first_option_share": sum(r.choice == r.option_ids[0] for r in results) / len(results),
            "label_mass_median": statistics.median(masses),
            "label_mass_min": min(masses),
            "ms_per_decision_p50": 1000 * statistics.median(per_decision),
            "vs_floor_p50": statistics.median(vs_floor),
            # A decision does at least the floor's prefill of its own tokens.
            "warnings": check(
                [
                    Ratio(
                        f"{engine.model_info.file} vs_floor",
                        statistics.median(vs_floor),
                        tuple(vs_floor),
                        1.0,
                    )
                ]
            ),
            "load_s": load_s,
            "read_check_mass": read.allowed_mass,
            "read_check_s": read.seconds,
            "prefill_tokens_per_s": statistics.median(floor_rates),
            "prompt_tokens_mean": statistics.mean(r.prompt.input_tokens for r in results),
        }
    finally:
        engine.close()


def main(args: argparse.Namespace) -> int:
    requests, labels = _load(Path(args.file))
    if args.limit:
        requests, labels = requests[: args.limit], labels[: args.limit]
    candidates = [bundled_model().path]
    smol = smollm2_path()
    if smol is not None:
        candidates.append(smol)
    for entry in model_store.CATALOG:
        path = model_store.installed(entry.name)
        if path is None:
            print(f"({entry.name} is not installed: `arbiter models install {entry.name}`)")
        else:
            candidates.append(path)
    rows = []
    for i, path in enumerate(candidates):
        print(f"[bench models] {path.name}: model {i + 1} of {len(candidates)}", file=sys.stderr)
        rows.append(measure(path, requests, labels))
    if args.json:
        print(json.dumps(rows))
        return 0
    base = rows[0]["ms_per_decision_p50"]
    print(
        "| model | quant | chat template | MB | accuracy | first option wins | label mass p50 (min) "
        "| ms/decision p50 | vs floor | vs default | prefill tok/s | read check at load "
        "(mass; s, vs a decision) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['quantization']} | {'yes' if r['chat_template'] else 'no'} "
            f"| {r['mb']} | {r['accuracy']:.2f} | {r['first_option_share']:.2f} "
            f"| {r['label_mass_median']:.2f} ({r['label_mass_min']:.2f}) "
            f"| {r['ms_per_decision_p50']:.0f} | {r['vs_floor_p50']:.2f}x "
            f"| {r['ms_per_decision_p50'] / base:.2f}x "
            f"| {r['prefill_tokens_per_s']:.0f} "
            f"| {r['read_check_mass']:.3f}; {r['read_check_s']:.2f} s, "
            f"{1000 * r['read_check_s'] / r['ms_per_decision_p50']:.1f}x |"
        )
    return 0
