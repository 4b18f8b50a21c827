"""The GPU check's results as Markdown: the CPU vs GPU table, parallel branches, agreement, stages."""

from __future__ import annotations

from typing import Any

# The seed's headline (JevBench, docs/gpu-check.md): GPU faster than CPU by these factors.
SEED_P50, SEED_P95 = 4.9, 32.2
# Parallel branches are worth making the default with offloaded layers only for a clear win.
PARALLEL_WIN = 1.10

ROWS = (
    ("single decision, ~150 tokens", "single_150", "engine_p50_ms"),
    ("single decision, ~600 tokens", "single_600", "engine_p50_ms"),
    ("single decision, long prompt", "single_long", "engine_p50_ms"),
    ("8 questions on one state, sequential branches", "shared_8x400", "grouped_ms"),
    ("8 questions on one state, parallel branches", "shared_8x400_parallel", "grouped_ms"),
)


def _value(bench: dict[str, Any] | None, key: str, field: str) -> float | None:
    if not bench or key not in bench:
        return None
    return float(bench[key][field])


def _tokens(bench: dict[str, Any] | None, key: str) -> str:
    if bench and key in bench and "prompt_tokens" in bench[key]:
        return f" ({bench[key]['prompt_tokens']} tokens)"
    if bench and key in bench and "prefix_tokens" in bench[key]:
        return f" ({bench[key]['prefix_tokens']}-token state)"
    return ""


def table(cpu: dict[str, Any] | None, gpu: dict[str, Any] | None) -> list[str]:
    """p50 per row, CPU and GPU from the same machine and run, and their ratio."""
    lines = [
        "| measure (p50) | CPU ms | GPU ms | CPU / GPU |",
        "|---|---|---|---|",
    ]
    for name, key, field in ROWS:
        c, g = _value(cpu, key, field), _value(gpu, key, field)
        if c is None and g is None:
            continue
        ratio = f"{c / g:.2f}x" if c is not None and g else "—"
        lines.append(
            f"| {name}{_tokens(cpu or gpu, key)} | {'—' if c is None else f'{c:.1f}'} | "
            f"{'—' if g is None else f'{g:.1f}'} | {ratio} |"
        )
    lines.append(f"| seed's JevBench (for comparison) | | | p50 {SEED_P50}x, p95 {SEED_P95}x |")
    return lines


def parallel_verdict(bench: dict[str, Any] | None) -> dict[str, Any] | None:
    """Sequential vs parallel branches for 8 questions on one state, on one device."""
    if not bench or "shared_8x400_parallel" not in bench:
        return None
    seq = float(bench["shared_8x400"]["grouped_ms"])
    par = float(bench["shared_8x400_parallel"]["grouped_ms"])
    return {
        "sequential_ms": seq,
        "parallel_ms": par,
        "parallel_speedup": seq / par,
        "parallel_wins": seq / par >= PARALLEL_WIN,
    }


def markdown(results: dict[str, Any]) -> str:
    machine = results.get("machine", {})
    bench = results.get("bench", {})
    cpu, gpu = bench.get("cpu"), bench.get("gpu")
    out = [
        f"# Arbiter GPU check ({results['mode']})",
        "",
        f"- machine: {machine.get('gpu', 'no GPU')}; {machine.get('cpu_count', '?')} CPU cores; "
        f"python {machine.get('python', '?')}; nvcc {machine.get('nvcc', '—')}",
    ]
    model = results.get("model")
    if model:
        out.append(
            f"- model: generated from the skeleton of {model.get('source', 'the default model')}: "
            f"{model.get('tensors')} tensors, {model.get('types')}, {model.get('bytes')} bytes, "
            f"same tensor table as the real file: {model.get('matches_real_tensor_table')}"
        )
    if results["mode"] == "rehearsal":
        out.append(
            "- rehearsal: a CPU build of the trimmed tree; the GPU column stays empty until the "
            "device runs `scripts/gpu-check --device`"
        )
    out += ["", "## CPU vs GPU (`arbiter bench engine`, same machine)", "", *table(cpu, gpu), ""]
    for leg, data in (("GPU", gpu), ("CPU", cpu)):
        verdict = parallel_verdict(data)
        if verdict:
            out.append(
                f"- parallel branches on the {leg}: {verdict['parallel_ms']:.1f} ms vs sequential "
                f"{verdict['sequential_ms']:.1f} ms ({verdict['parallel_speedup']:.2f}x)"
                + (" — a clear win" if verdict["parallel_wins"] else " — no clear win")
            )
    agreement = results.get("agreement")
    if agreement:
        out += [
            "",
            f"## Agreement ({agreement.get('legs', 'GPU vs CPU')})",
            "",
            f"- option logits: max |diff| {agreement['max_abs_option_logit']:.4f} over "
            f"{agreement['decisions']} decisions (tolerance {agreement['tolerance']}); "
            f"probabilities: max |diff| {agreement['max_abs_probability']:.4f}; "
            f"same choice: {agreement['same_choice']:.0%}",
            f"- full-vocabulary logits of a plain prefill: max |diff| "
            f"{agreement['max_abs_vocab_logit']:.4f}, mean {agreement['mean_abs_vocab_logit']:.5f}, "
            f"same top token: {agreement['same_top_token']:.0%} (prompts of "
            f"{agreement['prompt_tokens']} tokens)",
        ]
    tests = results.get("tests")
    if tests:
        out += ["", "## Engine tests", "", f"- {tests.get('summary', '?')} ({tests.get('where')})"]
    out += ["", "## Stages", "", "| stage | status | seconds | note |", "|---|---|---|---|"]
    for stage in results.get("stages", []):
        note = str(stage.get("note", "")).replace("|", "/").replace("\n", " ")[:160]
        out.append(f"| {stage['name']} | {stage['status']} | {stage['seconds']:.1f} | {note} |")
    return "\n".join(out) + "\n"
