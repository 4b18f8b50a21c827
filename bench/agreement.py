"""GPU vs CPU agreement: the same decisions scored by two engines, in two processes, compared.

``dump`` scores a fixed set of decisions (one prompt each at ~150, ~600 and ~4,000 tokens, and the
bench's 8 questions on one ~400-token state) with an engine configured from the environment
(``ARBITER_N_GPU_LAYERS``; ``CUDA_VISIBLE_DEVICES=`` hides the GPU from the CPU run, which
otherwise may still hand big matrix products to it), and saves the option logits of each decision
and the full-vocabulary logits of a plain prefill of each prompt. ``compare`` reads two dumps.
Weights are random (the generated model), so what is compared is numerics, not answers; the
engine's own agreement rules (grouped = single = cache to 1e-3) are the tests' business. The GPU
check's agreement stage (gpucheck/pipeline.py) runs ``python -m bench.agreement`` in each process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

# The tests' bound for two different kernel paths over the same prompt (tests/arbiter/test_engine.py).
TOLERANCE = 0.5


def _decisions(engine: Any, long_prompt: int, questions: int) -> list[Any]:
    from bench.common import QUESTIONS, case_decision, sized_state

    sizes = [n for n in (150, 600, long_prompt) if n]
    singles = [case_decision(i, sized_state(engine, 31_000 + n, n)) for i, n in enumerate(sizes)]
    state = sized_state(engine, 77_000, 400, whole_prompt=False)
    shared = [case_decision(100 + i, state, q) for i, q in enumerate(QUESTIONS[:questions])]
    return singles + shared


def dump(out: Path, model: Path, long_prompt: int, questions: int = 8) -> dict[str, Any]:
    from arbiter.engine import open_engine
    from arbiter.schema import DecisionResult
    from bench.floor import plain_pass

    engine = open_engine(model=model)
    try:
        decisions = _decisions(engine, long_prompt, questions)
        outcomes = engine.score(decisions)
        option_logits, full, tokens = [], [], []
        for request, outcome in zip(decisions, outcomes, strict=True):
            if not isinstance(outcome, DecisionResult):
                raise RuntimeError(f"{request.id} was not scored: {outcome}")
            option_logits.append(outcome.option_logits)
            prompt = engine.prompt_tokens(request)
            tokens.append(len(prompt))
            logits, _ = plain_pass(engine, prompt)
            full.append(logits.astype(np.float32))
        np.savez(
            out,
            option_logits=np.array(option_logits, dtype=np.float64),
            full=np.stack(full),
            tokens=np.array(tokens),
        )
        return {
            "decisions": len(decisions),
            "prompt_tokens": tokens,
            "n_gpu_layers": engine.settings.n_gpu_layers,
        }
    finally:
        engine.close()


def compare(a: Path, b: Path) -> dict[str, Any]:
    """How far run ``b`` is from run ``a`` (``a`` is the reference, the CPU)."""
    x, y = np.load(a), np.load(b)
    if not np.array_equal(x["tokens"], y["tokens"]):
        raise RuntimeError("the two runs scored different prompts")
    opt = np.abs(x["option_logits"] - y["option_logits"])
    px = np.exp(x["option_logits"] - x["option_logits"].max(axis=1, keepdims=True))
    py = np.exp(y["option_logits"] - y["option_logits"].max(axis=1, keepdims=True))
    px, py = px / px.sum(axis=1, keepdims=True), py / py.sum(axis=1, keepdims=True)
    full = np.abs(x["full"].astype(np.float64) - y["full"].astype(np.float64))
    per_prompt = full.max(axis=1)
    top_same = (x["full"].argmax(axis=1) == y["full"].argmax(axis=1)).mean()
    return {
        "decisions": len(opt),
        "prompt_tokens": x["tokens"].tolist(),
        "max_abs_option_logit": float(opt.max()),
        "max_abs_probability": float(np.abs(px - py).max()),
        "same_choice": float((px.argmax(axis=1) == py.argmax(axis=1)).mean()),
        "max_abs_vocab_logit": float(full.max()),
        "max_abs_vocab_logit_per_prompt": [round(float(v), 4) for v in per_prompt],
        "mean_abs_vocab_logit": float(full.mean()),
        "same_top_token": float(top_same),
        "tolerance": TOLERANCE,
        "within_tolerance": bool(opt.max() <= TOLERANCE),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agreement", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="score the fixed decisions, save logits (.npz)")
    d.add_argument("out", type=Path)
    d.add_argument("--model", type=Path, required=True)
    d.add_argument("--long-prompt", type=int, default=4000)
    d.add_argument("--questions", type=int, default=8, help="questions on the shared state")
    c = sub.add_parser("compare", help="compare two dumps (reference first)")
    c.add_argument("reference", type=Path)
    c.add_argument("other", type=Path)
    args = parser.parse_args(argv)
    if args.command == "dump":
        print(json.dumps(dump(args.out, args.model, args.long_prompt, args.questions)))
    else:
        print(json.dumps(compare(args.reference, args.other)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
