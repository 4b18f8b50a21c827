"""`arbiter bench engine`: engine latency against the raw llama_decode floor, in one run.

Every figure is a ratio against a baseline measured in the same process on the same machine, with
the two interleaved, because these machines are noisy:
1. single decision (cold: a state never seen before) vs the floor, a plain prefill of the same
   prompt tokens with logits at the last position only, at ~150 and ~600 prompt tokens (and, with
   ``--long-prompt N``, at ~N: the GPU check asks for ~4,000);
2. 8 questions on one ~400-token state: grouped vs 8 independent decisions, and grouped vs
   floor(prefix) + the floors of the 8 suffixes;
3. peak RSS vs GGUF size + KV cache + 400 MB;
4. many options (``bench.many_options``): 26 options (letters) and 60 (codes) on one state, each
   vs the floor of its own prompt tokens, and the label decode's share of it; one 255-option row;
5. with ``--lora SPEC`` (or ``--lora random``: a seeded rank-8 adapter on every block's attention
   projections): a single decision with the adapter vs the same engine with it off (scale 0, the
   base model's numbers), and vs the floor of the same prompt with the adapter applied.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from arbiter.engine import Engine, open_engine
from arbiter.errors import UnsupportedSetting
from bench.common import ONE_READ, QUESTIONS, case_decision, sized_state
from bench.figures import Progress, Ratio, check
from bench.floor import floor_shared, one_read, plain_pass
from bench.many_options import bench_many_options, render_rows

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {"repeats": 1, "long_prompt": 0, "lora": None, "adapter_only": False}


def bench_single(
    engine: Engine, target: int, repeats: int, progress: Progress | None = None
) -> dict[str, Any]:
    ours, floors, n_tokens = [], [], 0
    for r in range(repeats + 1):
        if progress:
            progress(f"single decision, ~{target} tokens: {r} of {repeats + 1}")
        request = case_decision(r, sized_state(engine, 1000 * target + r, target))
        tokens = engine.prompt_tokens(request)
        n_tokens = len(tokens)
        _, floor_s = plain_pass(engine, tokens)
        started = time.perf_counter()
        outcome = engine.score([request])[0]
        elapsed = time.perf_counter() - started
        one_read(outcome)
        if r:  # the first pair warms up
            ours.append(elapsed)
            floors.append(floor_s)
    ours_p50, floor_p50 = statistics.median(ours), statistics.median(floors)
    return {
        "prompt_tokens": n_tokens,
        "engine_p50_ms": 1000 * ours_p50,
        "floor_p50_ms": 1000 * floor_p50,
        "ratio": ours_p50 / floor_p50,
        "pairs": [o / f for o, f in zip(ours, floors, strict=True)],
    }


def _timed_single(engine: Engine, seed: int, target: int) -> tuple[float, float, int]:
    """One cold decision and the floor of its prompt: (engine_s, floor_s, prompt tokens)."""
    request = case_decision(seed, sized_state(engine, seed, target))
    tokens = engine.prompt_tokens(request)
    _, floor_s = plain_pass(engine, tokens)
    started = time.perf_counter()
    outcome = engine.score([request])[0]
    elapsed = time.perf_counter() - started
    one_read(outcome)
    return elapsed, floor_s, len(tokens)


def bench_adapter(engine: Engine, target: int, repeats: int) -> dict[str, Any]:
    """The adapters' cost: on and off (scale 0) interleaved on one engine, each against the floor
    measured in the same state (so "floor on" has the adapter applied too)."""
    scales = [a.scale for a in engine.adapters]
    if not any(scales):
        raise ValueError("the adapter rows need an engine with an adapter at a non-zero scale")
    runs: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    n_tokens = 0
    try:
        for r in range(repeats + 1):
            for on in (True, False):
                with engine.session() as llama:
                    llama.set_adapter_scales(scales if on else [0.0] * len(scales))
                engine.cache.clear()  # states are keyed by the engine's adapters, not the toggle
                ours, floor_s, n_tokens = _timed_single(engine, 5_000_000 + 10 * r + on, target)
                if r:  # the first round warms up
                    runs[on][0].append(ours)
                    runs[on][1].append(floor_s)
    finally:
        with engine.session() as llama:
            llama.set_adapter_scales(scales)
        engine.cache.clear()
    on_ms, on_floor_ms = (1000 * statistics.median(v) for v in runs[True])
    off_ms, off_floor_ms = (1000 * statistics.median(v) for v in runs[False])
    return {
        "prompt_tokens": n_tokens,
        "adapters": [a.path.name for a in engine.adapters],
        "with_ms": on_ms,
        "without_ms": off_ms,
        "floor_with_ms": on_floor_ms,
        "floor_without_ms": off_floor_ms,
        "with_vs_without": on_ms / off_ms,
        "with_vs_floor_with": on_ms / on_floor_ms,
        "with_vs_without_pairs": [
            a / b for a, b in zip(runs[True][0], runs[False][0], strict=True)
        ],
        "with_vs_floor_with_pairs": [a / b for a, b in zip(*runs[True], strict=True)],
    }


def bench_shared(engine: Engine, repeats: int, progress: Progress | None = None) -> dict[str, Any]:
    grouped, independent, floors = [], [], []
    for r in range(repeats + 1):
        if progress:
            progress(f"8 questions on one state: {r} of {repeats + 1}")
        state = sized_state(engine, 77_000 + r, 400, whole_prompt=False)
        requests = [case_decision(i, state, q) for i, q in enumerate(QUESTIONS)]
        engine.cache.clear()
        started = time.perf_counter()
        results = [one_read(o) for o in engine.score(requests)]
        grouped_s = time.perf_counter() - started
        prefix_len = results[0].prompt.prefix_tokens
        started = time.perf_counter()
        for request in requests:
            engine.cache.clear()
            engine.score([request])
        independent_s = time.perf_counter() - started
        tokens = [engine.prompt_tokens(q) for q in requests]
        prefix_s, suffix_s = floor_shared(
            engine, tokens[0][:prefix_len], [t[prefix_len:] for t in tokens]
        )
        if r:
            grouped.append(grouped_s)
            independent.append(independent_s)
            floors.append(prefix_s + suffix_s)
    engine.cache.clear()
    g, i, f = statistics.median(grouped), statistics.median(independent), statistics.median(floors)
    return {
        "prefix_tokens": prefix_len,
        "grouped_ms": 1000 * g,
        "independent_ms": 1000 * i,
        "floor_ms": 1000 * f,
        "speedup_vs_independent": i / g,
        "ratio_vs_floor": g / f,
        "speedup_pairs": [a / b for a, b in zip(independent, grouped, strict=True)],
        "vs_floor_pairs": [a / b for a, b in zip(grouped, floors, strict=True)],
    }


def bench_memory(engine: Engine) -> dict[str, Any]:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    budget = engine.model_info.bytes + engine.llama.kv_cache_bytes() + 400 * 1024 * 1024
    return {
        "peak_rss_mb": peak / 2**20,
        "gguf_mb": engine.model_info.bytes / 2**20,
        "kv_cache_mb": engine.llama.kv_cache_bytes() / 2**20,
        "budget_mb": budget / 2**20,
        "ratio": peak / budget,
    }


def run(engine: Engine, repeats: int, long_prompt: int = 0) -> dict[str, Any]:
    progress = Progress("engine")
    report: dict[str, Any] = {"model": engine.model_info.model_dump()}
    report["single_150"] = bench_single(engine, 150, repeats, progress)
    report["single_600"] = bench_single(engine, 600, repeats, progress)
    if long_prompt:
        report["single_long"] = bench_single(engine, long_prompt, repeats, progress)
    report["shared_8x400"] = bench_shared(engine, max(1, repeats // 2), progress)
    if any(a.scale for a in engine.adapters):
        progress("the adapter rows", always=True)
        report["adapter_150"] = bench_adapter(engine, 150, repeats)
        report["adapter_600"] = bench_adapter(engine, 600, repeats)
    report["memory"] = bench_memory(engine)
    progress("many options (26, 60 and 255)", always=True)
    report["many_options"] = bench_many_options(
        engine,
        max(2, repeats // 2),
        lambda seed: sized_state(engine, seed, 200, whole_prompt=False),
    )
    # Opt-in: all questions of the state in one llama_decode (see docs/decisions.md, Numerics).
    engine.settings = engine.settings.model_copy(update={"parallel_branches": True})
    try:
        report["shared_8x400_parallel"] = bench_shared(engine, max(1, repeats // 2), progress)
    finally:
        engine.settings = engine.settings.model_copy(update={"parallel_branches": False})
    return report


def ratios(report: dict[str, Any]) -> list[Ratio]:
    """Every ratio the report prints, with what it can physically be: the engine does at least
    the floor's work (a decision's prefill; the prefix once and each suffix), and an adapter only
    adds work, so none of these can be below 1."""
    out = []
    for key in ("single_150", "single_600", "single_long"):
        if key in report:
            row = report[key]
            out.append(Ratio(f"{key}_vs_floor", row["ratio"], tuple(row["pairs"]), floor=1.0))
    for key in ("shared_8x400", "shared_8x400_parallel"):
        row = report[key]
        out.append(
            Ratio(f"{key}_vs_floor", row["ratio_vs_floor"], tuple(row["vs_floor_pairs"]), 1.0)
        )
        out.append(
            Ratio(f"{key}_speedup", row["speedup_vs_independent"], tuple(row["speedup_pairs"]))
        )
    for n in (26, 60):
        row = report["many_options"][f"options_{n}"]
        out.append(Ratio(f"options_{n}_vs_floor", row["ratio"], tuple(row["pairs"]), floor=1.0))
    for key in ("adapter_150", "adapter_600"):
        if key in report:
            out += _adapter_ratios(key, report[key])
    return out


def _adapter_ratios(key: str, row: dict[str, Any]) -> list[Ratio]:
    return [
        Ratio(
            f"{key}_with_vs_without",
            row["with_vs_without"],
            tuple(row["with_vs_without_pairs"]),
            1.0,
        ),
        Ratio(
            f"{key}_vs_floor_with",
            row["with_vs_floor_with"],
            tuple(row["with_vs_floor_with_pairs"]),
            1.0,
        ),
    ]


def render(report: dict[str, Any]) -> str:
    m = report["model"]
    s150, s600, sh, mem = (
        report[k] for k in ("single_150", "single_600", "shared_8x400", "memory")
    )
    par = report["shared_8x400_parallel"]
    long_rows = []
    if "single_long" in report:
        sl = report["single_long"]
        long_rows.append(
            f"| single decision, {sl['prompt_tokens']} tokens | {sl['engine_p50_ms']:.1f} ms | "
            f"floor {sl['floor_p50_ms']:.1f} ms | {sl['ratio']:.3f} | <= 1.10 |"
        )
    return "\n".join(
        [
            f"model: {m['file']} ({m['quantization']}), threads={m['threads']}, "
            f"n_ctx={m['context_tokens']}",
            "",
            "| measure | Arbiter | baseline (same run) | ratio | target |",
            "|---|---|---|---|---|",
            f"| single decision, {s150['prompt_tokens']} tokens | {s150['engine_p50_ms']:.1f} ms | "
            f"floor {s150['floor_p50_ms']:.1f} ms | {s150['ratio']:.3f} | <= 1.10 |",
            f"| single decision, {s600['prompt_tokens']} tokens | {s600['engine_p50_ms']:.1f} ms | "
            f"floor {s600['floor_p50_ms']:.1f} ms | {s600['ratio']:.3f} | <= 1.10 |",
            *long_rows,
            f"| 8 questions, one {sh['prefix_tokens']}-token state | {sh['grouped_ms']:.0f} ms | "
            f"8 independent {sh['independent_ms']:.0f} ms | {sh['speedup_vs_independent']:.2f}x "
            "faster | >= 4x |",
            f"| 8 questions, one state | {sh['grouped_ms']:.0f} ms | floor(prefix) + 8 suffix "
            f"floors {sh['floor_ms']:.0f} ms | {sh['ratio_vs_floor']:.3f} | <= 1.3 |",
            f"| same, ARBITER_PARALLEL_BRANCHES=true | {par['grouped_ms']:.0f} ms | "
            f"8 independent {par['independent_ms']:.0f} ms | "
            f"{par['speedup_vs_independent']:.2f}x faster | (opt-in) |",
            f"| peak RSS | {mem['peak_rss_mb']:.0f} MB | GGUF {mem['gguf_mb']:.0f} + KV "
            f"{mem['kv_cache_mb']:.0f} + 400 MB | {mem['ratio']:.3f} | < 1.0 |",
            *render_rows(report["many_options"]),
            *_adapter_rows(report),
        ]
    )


def _adapter_rows(report: dict[str, Any]) -> list[str]:
    rows = []
    for key in ("adapter_150", "adapter_600"):
        if key in report:
            a = report[key]
            rows += [
                f"| single decision, {a['prompt_tokens']} tokens, LoRA on | {a['with_ms']:.1f} ms "
                f"| LoRA off (scale 0) {a['without_ms']:.1f} ms | {a['with_vs_without']:.3f} "
                "| (the adapter's cost) |",
                f"| single decision, {a['prompt_tokens']} tokens, LoRA on | {a['with_ms']:.1f} ms "
                f"| floor, LoRA on {a['floor_with_ms']:.1f} ms | {a['with_vs_floor_with']:.3f} "
                "| <= 1.10 |",
            ]
    return rows


def _adapter_only(engine: Engine, args: argparse.Namespace) -> int:
    """Only the adapter rows (``--adapter-only``): more repeats of them in the same time."""
    report = {key: bench_adapter(engine, n, args.repeats) for key, n in _ADAPTER_ROWS}
    summary: dict[str, Any] = {
        f"{key}_{name}": round(report[key][name], 4)
        for key, _ in _ADAPTER_ROWS
        for name in ("with_vs_without", "with_vs_floor_with")
    }
    warnings = check(r for key, _ in _ADAPTER_ROWS for r in _adapter_ratios(key, report[key]))
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(_adapter_rows(report)))
    print(json.dumps({**summary, "warnings": warnings}))
    return 0


_ADAPTER_ROWS = (("adapter_150", 150), ("adapter_600", 600))


def _lora_setting(value: str | None, model: Path, directory: Path) -> str | None:
    """``--lora``: an ARBITER_LORA value, or ``random`` (a seeded rank-8 adapter for ``model``)."""
    if value != "random":
        return value
    try:
        from bench.lora_adapter import write_lora
    except ModuleNotFoundError as exc:
        if exc.name != "gguf":
            raise
        # `make run` installs the package and its local extra only; gguf comes with `make setup`.
        raise UnsupportedSetting(
            "--lora random writes its adapter with llama.cpp's gguf package, which `make run` "
            "does not install: .venv/bin/pip install -c constraints.txt -e '.[bench]' "
            "(make setup installs it too), or pass --lora an adapter file"
        ) from None

    return str(write_lora(model, directory / "random-lora.gguf", rank=8, alpha=8.0, seed=0))


def main(args: argparse.Namespace) -> int:
    import tempfile

    from arbiter.models import resolve_model
    from arbiter.settings import EngineSettings

    settings = EngineSettings().model_copy(update={"order_policy": ONE_READ})
    if args.model is not None:
        settings = settings.model_copy(update={"model": args.model})
    with tempfile.TemporaryDirectory(prefix="arbiter-bench-lora-") as directory:
        lora = getattr(args, "lora", None)
        if lora is not None:
            model = resolve_model(settings.model, settings.model_dir).path
            settings = settings.model_copy(
                update={"lora": _lora_setting(lora, model, Path(directory))}
            )
        engine = open_engine(settings)
        return _main(engine, args)


def _main(engine: Engine, args: argparse.Namespace) -> int:
    try:
        if getattr(args, "adapter_only", False):
            return _adapter_only(engine, args)
        report = run(engine, args.repeats, getattr(args, "long_prompt", 0))
    finally:
        engine.close()
    summary: dict[str, Any] = {
        "single_150_vs_floor": round(report["single_150"]["ratio"], 4),
        "single_600_vs_floor": round(report["single_600"]["ratio"], 4),
        "shared_speedup_vs_independent": round(report["shared_8x400"]["speedup_vs_independent"], 3),
        "shared_vs_floor": round(report["shared_8x400"]["ratio_vs_floor"], 4),
        "peak_rss_vs_budget": round(report["memory"]["ratio"], 4),
        "options_60_vs_floor": round(report["many_options"]["options_60"]["ratio"], 4),
        "options_60_read_share": round(
            report["many_options"]["options_60"]["readout_share_of_floor"], 4
        ),
    }
    for key in ("adapter_150", "adapter_600"):
        if key in report:
            summary[f"{key}_with_vs_without"] = round(report[key]["with_vs_without"], 4)
            summary[f"{key}_vs_floor_with"] = round(report[key]["with_vs_floor_with"], 4)
    summary["warnings"] = check(ratios(report))
    if args.json:
        print(json.dumps(report))
    else:
        print(render(report))
        print()
    print(json.dumps(summary))
    return 0
