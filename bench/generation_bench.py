"""`arbiter bench generation`: what the chat path's controls cost per generated token, in one run.

Every row is a ratio against greedy generation of the same prompt on the same model, measured in
the same process with the variants interleaved round by round (these machines are noisy); greedy
itself against the decode floor (llama_decode of one token and numpy's argmax, nothing else):
1. the full sampler chain (temperature, top_k, top_p, min_p, the three penalties, a seed);
2. ``logprobs`` with ``top_logprobs`` 20 (one log-softmax and one partial sort per token);
3. a JSON schema's grammar as generation runs it (the sampled token checked first, the whole
   vocabulary masked only when it is refused), and, for scale, the grammar applied to the whole
   vocabulary once (what every token would cost without the check), against a greedy token;
4. ``n`` 4 choices from one prefill, batched, against 4 requests of one choice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from arbiter.engine import Engine, Generation, SamplingParams, open_engine
from arbiter.engine.grammar import schema_grammar
from arbiter.engine.sampler import Candidates, Grammar
from arbiter.models import bundled_model, smollm2_path
from arbiter.prompt import render_chat
from arbiter.settings import EngineSettings
from bench.figures import Progress, Ratio, check, paired

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {"tokens": 4, "repeats": 1}

REQUIRED = ["name", "age", "city", "pets"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": REQUIRED,
    "additionalProperties": False,
}
CHAIN = SamplingParams(
    temperature=0.8,
    top_k=40,
    top_p=0.95,
    min_p=0.05,
    seed=1,
    presence_penalty=0.2,
    frequency_penalty=0.2,
    repeat_penalty=1.1,
)


def per_token_ms(generations: list[Generation]) -> float:
    """Median decode milliseconds per generated token (prefill excluded)."""
    return statistics.median(1000 * g.decode_s / max(1, g.completion_tokens) for g in generations)


def bench_model(
    path: Path, tokens: int, repeats: int, threads: int | None = None
) -> dict[str, Any]:
    settings = EngineSettings(model=path, n_ctx=2048)
    if threads:
        settings = settings.model_copy(update={"n_threads": threads})
    engine = open_engine(settings)
    try:
        segments = render_chat(
            [("user", "Describe a person as JSON: name, age, city and pets.")],
            engine.chat_template,
            engine.bos_text,
            engine.eos_text,
        )
        prompt = engine.encode_segments(segments)
        grammar = schema_grammar(SCHEMA, "bench")
        variants: dict[str, dict[str, Any]] = {
            "greedy": {"sampling": SamplingParams(temperature=0)},
            "chain": {"sampling": CHAIN},
            "logprobs20": {"sampling": SamplingParams(temperature=0), "top_logprobs": 20},
            "grammar": {"sampling": SamplingParams(temperature=0, grammar=grammar)},
        }
        runs: dict[str, list[Generation]] = {name: [] for name in variants}
        wall: dict[str, list[float]] = {"n4": [], "four": []}
        progress = Progress("generation")
        for r in range(repeats + 1):
            progress(f"{path.name}: round {r} of {repeats + 1} (a warm-up first)")
            for name, kw in variants.items():
                out = engine.generate(prompt, max_tokens=tokens, **kw)
                if r:
                    runs[name].append(out)
            started = time.perf_counter()
            engine.generate(prompt, max_tokens=tokens, sampling=CHAIN, n=4)
            n4 = time.perf_counter() - started
            started = time.perf_counter()
            for i in range(4):
                engine.generate(prompt, max_tokens=tokens, sampling=SamplingParams(seed=i))
            if r:
                wall["n4"].append(n4)
                wall["four"].append(time.perf_counter() - started)
        floors = _decode_floor_ms(engine, prompt, tokens, repeats)
        floor = statistics.median(floors)
        base = per_token_ms(runs["greedy"])
        rows = {name: per_token_ms(gens) for name, gens in runs.items()}
        full_mask = _full_mask_ms(engine, grammar, prompt, repeats)
        grammar_out = runs["grammar"][0].text
        return {
            "model": path.name,
            "vocabulary": engine.n_vocab,
            "prompt_tokens": len(prompt),
            "decode_floor_ms_per_token": floor,
            "greedy_ms_per_token": base,
            "greedy_vs_floor": base / floor,
            "ratios": {name: ms / base for name, ms in rows.items()},
            "ms_per_token": rows,
            "grammar_tokens": runs["grammar"][0].completion_tokens,
            "grammar_output_valid_json": _valid(grammar_out),
            "grammar_whole_vocabulary_mask_ms": full_mask,
            "grammar_whole_vocabulary_mask_vs_greedy_token": full_mask / base,
            "n4_s": statistics.median(wall["n4"]),
            "four_requests_s": statistics.median(wall["four"]),
            "n4_speedup": statistics.median(wall["four"]) / statistics.median(wall["n4"]),
            "warnings": check(_ratios(path.name, runs, floors, wall)),
        }
    finally:
        engine.close()


def _ratios(
    model: str, runs: dict[str, list[Generation]], floors: list[float], wall: dict[str, list[float]]
) -> list[Ratio]:
    """Greedy generation does the decode floor's work and more, and log-probabilities add to the
    same greedy tokens; four choices from one prefill save at most three prefills of four."""
    per = {
        name: [1000 * g.decode_s / max(1, g.completion_tokens) for g in gens]
        for name, gens in runs.items()
    }
    greedy = per["greedy"]
    out = [paired(f"{model} greedy_vs_floor", greedy, floors, floor=1.0)]
    out.append(paired(f"{model} logprobs20_vs_greedy", per["logprobs20"], greedy, floor=1.0))
    out += [paired(f"{model} {name}_vs_greedy", per[name], greedy) for name in ("chain", "grammar")]
    out.append(paired(f"{model} n4_speedup", wall["four"], wall["n4"], ceiling=4.0))
    return out


def _decode_floor_ms(engine: Engine, prompt: Any, tokens: int, repeats: int) -> list[float]:
    """Greedy decoding with nothing else: numpy's argmax of a row, llama_decode of its token;
    milliseconds per token, one figure per repeat. As in a generation, the first token comes from
    the prefill's row and the last is not decoded: ``tokens`` tokens take ``tokens - 1`` decodes
    (the floor made one more, and greedy decoding measured 0.75x it at 4 tokens)."""
    runs = []
    for _ in range(repeats):
        with engine.session() as llama:
            row = llama.last_logits(prompt, 0)
            started = time.perf_counter()
            token = int(row.argmax())
            for i in range(tokens - 1):
                row = llama.last_logits(np.array([token], dtype=np.int32), len(prompt) + i)
                token = int(row.argmax())
            runs.append(1000 * (time.perf_counter() - started) / tokens)
    return runs


def _full_mask_ms(engine: Engine, grammar_text: str, prompt: Any, repeats: int) -> float:
    """One whole-vocabulary grammar mask on the prompt's real row of logits, median of runs."""
    with engine.session() as llama:
        row = llama.last_logits(prompt, 0)
        with llama.vocab.vocabulary() as vocab:
            grammar = Grammar(vocab, grammar_text)
        try:
            candidates = Candidates(llama.n_vocab)
            times = []
            for _ in range(max(5, 5 * repeats)):
                candidates.fill(row)
                started = time.perf_counter()
                grammar.mask(candidates)
                times.append(time.perf_counter() - started)
        finally:
            grammar.close()
    return 1000 * statistics.median(times)


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == set(REQUIRED)


def render(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model (vocabulary) | decode floor ms/token | greedy | chain | logprobs 20 | JSON grammar "
        "| grammar on the whole vocabulary, once | n=4 vs 4 requests |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratios = r["ratios"]
        lines.append(
            f"| {r['model']} ({r['vocabulary']:,}) | {r['decode_floor_ms_per_token']:.1f} | "
            f"{r['greedy_ms_per_token']:.1f} ms ({r['greedy_vs_floor']:.3f}) | "
            f"{ratios['chain']:.3f} | {ratios['logprobs20']:.3f} | {ratios['grammar']:.3f} | "
            f"{r['grammar_whole_vocabulary_mask_ms']:.1f} ms "
            f"({r['grammar_whole_vocabulary_mask_vs_greedy_token']:.2f}x a greedy token) | "
            f"{r['n4_speedup']:.2f}x faster |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    paths = [args.model] if args.model else [bundled_model().path, smollm2_path()]
    results = []
    for path in paths:
        if path is None:
            continue
        results.append(bench_model(path, args.tokens, args.repeats, args.threads))
        if not args.json:  # a row as soon as its model is measured (a long run shows progress)
            print(
                render(results).splitlines()[-1] if len(results) > 1 else render(results),
                flush=True,
            )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
