"""`arbiter bench all`: every benchmark in one run, as one Markdown report and one JSON file.

1. The suites other modules register under `arbiter bench` (engine, http, worker), each run as its
   own process (``arbiter bench <suite> --json``) so one suite's memory and threads never skew
   another's; their JSON is kept as printed and the last line (their summary) goes into the table.
2. Decision vs generation: the same labeled decisions answered by generating the answer letter
   (``Engine.generate``, greedy, ``max_tokens`` 2, the first A-Z letter parsed) vs the decision path:
   latency ratio and agreement. Only when the engine has ``generate``.
3. llama-cpp-python's own OpenAI-compatible server (``python -m llama_cpp.server`` on 127.0.0.1)
   used as a decision engine: ``/v1/completions`` on Arbiter's exact prompt text, ``max_tokens=1``,
   ``logprobs=20``; letters are read from the top log-probabilities (both spellings, "A" and " A",
   combined by log-sum-exp, missing letters count as -inf). Same model, same decisions, requests
   interleaved with Arbiter's: latency ratio (Arbiter in-process vs the server over loopback HTTP,
   so the server's figure includes its HTTP round trip) and agreement of the chosen option.
4. typed-gguf, when it is installed (``bench.typed_gguf_compare``): its ``/v1/decide`` server on
   127.0.0.1, per decision and 8 questions on one state: latency ratio and agreement.

``--n-gpu-layers`` is passed to every part (``ARBITER_N_GPU_LAYERS`` for the suites, the engine
settings, ``--n_gpu_layers`` for the llama-cpp-python server), so a GPU machine produces the same
report to set beside the CPU one.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from arbiter.engine.sampling import SamplingParams
from arbiter.prompt import LETTERS
from arbiter.schema import DecisionRequest
from bench import typed_gguf_compare
from bench.common import (
    LABELED,
    ONE_READ,
    ROOT,
    free_port,
    latency_pair,
    ok,
    shown,
    stop,
    wait_until_ready,
)
from bench.figures import Ratio, check

# `--smoke` (make bench-smoke): the smallest size that runs every row.
SMOKE: dict[str, Any] = {
    "limit": 3,
    "suites": "engine,http,worker",
    "readme": None,
    "out": str(ROOT / ".bench" / "smoke"),
}

SUITES = ("engine", "http", "worker")


# -- the registered suites ---------------------------------------------------------------------


def available_suites() -> list[str]:
    """Suites that have a module here (``bench/<suite>_bench.py``)."""
    return [s for s in SUITES if (ROOT / "bench" / f"{s}_bench.py").exists()]


def run_suite(
    suite: str, n_gpu_layers: int | None, timeout_s: float, smoke: bool = False
) -> dict[str, Any]:
    """``arbiter bench SUITE --json`` in its own process: its stdout kept, its stderr (progress,
    warnings) passed on as it comes and its tail kept for the report when it fails."""
    env = dict(os.environ)
    if n_gpu_layers is not None:
        env["ARBITER_N_GPU_LAYERS"] = str(n_gpu_layers)
    command = [sys.executable, "-m", "arbiter", "bench", suite, "--json", *(["--smoke"] * smoke)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    tail: list[str] = []
    stdout: list[str] = []

    def relay() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            tail[:] = [*tail[-40:], line]
            if not line.startswith("{"):  # the suite's progress and warnings, not its JSON logs
                print(f"  {suite}: {line}", end="", file=sys.stderr, flush=True)

    def keep() -> None:
        assert proc.stdout is not None
        stdout.extend(proc.stdout)

    readers = [threading.Thread(target=f, daemon=True) for f in (relay, keep)]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"suite": suite, "ok": False, "error": f"timed out after {timeout_s:.0f} s"}
    for reader in readers:
        reader.join(timeout=10)
    parsed = []
    for line in stdout:
        with contextlib.suppress(json.JSONDecodeError):
            parsed.append(json.loads(line))
    out: dict[str, Any] = {
        "suite": suite,
        "ok": proc.returncode == 0 and bool(parsed),
        "seconds": time.perf_counter() - started,
        "json": parsed,
        "summary": parsed[-1] if parsed and isinstance(parsed[-1], dict) else None,
    }
    if not out["ok"]:
        out["error"] = ("".join(tail) or "".join(stdout))[-2000:]
    return out


# -- labeled decisions -------------------------------------------------------------------------


def load_decisions(path: Path, limit: int | None) -> tuple[list[DecisionRequest], list[str]]:
    from evaluation.tasks import load

    items = load([path])[: limit or None]
    return [i.request for i in items], [i.label for i in items]


def parse_letter(text: str, n_options: int) -> int | None:
    """The first A..(n-th letter) in generated text, as an option index."""
    for ch in text.strip():
        if ch in LETTERS[:n_options]:
            return LETTERS.index(ch)
        if ch.isalnum():
            return None
    return None


def decision_vs_generation(engine: Any, requests: list[DecisionRequest]) -> dict[str, Any]:
    """The decision path vs generating the letter on the same prompt tokens."""
    if not hasattr(engine, "generate"):
        return {"skipped": "the engine has no generate method"}
    ours, theirs, agree, parsed = [], [], 0, 0
    engine.score(requests[:1])
    for request in requests:
        engine.cache.clear()
        started = time.perf_counter()
        result = ok(engine.score([request])[0])
        ours.append(time.perf_counter() - started)
        tokens = engine.prompt_tokens(request)
        started = time.perf_counter()
        generation = engine.generate(tokens, max_tokens=2, sampling=SamplingParams(temperature=0))
        theirs.append(time.perf_counter() - started)
        index = parse_letter(generation.text, len(request.options))
        if index is not None:
            parsed += 1
            agree += request.options[index].id == result.choice
    return {
        "decisions": len(requests),
        "parsed": parsed,
        "agreement": agree / len(requests),
        **latency_pair(ours, theirs),
    }


# -- llama-cpp-python's server -----------------------------------------------------------------


@contextlib.contextmanager
def lcp_server(
    model: Path, threads: int, n_ctx: int, n_gpu_layers: int, log: Path
) -> Iterator[str]:
    """``python -m llama_cpp.server`` on loopback; stopped by its own pid on exit."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_gpu_layers",
        str(n_gpu_layers),
    ]
    with log.open("w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(proc, f"{url}/v1/models", "llama_cpp.server", log, 120, 0.5)
        yield url
    finally:
        stop(proc)


def letters_from_top_logprobs(top: dict[str, float], n_options: int) -> list[float]:
    """Per option letter, log-sum-exp of its spellings ("A", " A") among the top log-probs."""
    out = []
    for letter in LETTERS[:n_options]:
        found = [v for k, v in top.items() if k.strip() == letter and k in (letter, " " + letter)]
        out.append(float(np.logaddexp.reduce(found)) if found else -math.inf)
    return out


def lcp_decide(url: str, prompt: str, n_options: int) -> list[float]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": 20}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as response:
        raw = json.loads(response.read())
    top = raw["choices"][0]["logprobs"]["top_logprobs"][0] or {}
    return letters_from_top_logprobs(top, n_options)


def compare_lcp(
    engine: Any, requests: list[DecisionRequest], n_gpu_layers: int, log: Path
) -> dict[str, Any]:
    if importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("fastapi") is None:
        return {
            "skipped": "llama_cpp.server needs fastapi and uvicorn (pip install fastapi uvicorn "
            "sse-starlette starlette-context)"
        }
    settings = engine.settings
    with lcp_server(
        engine.resolved.path, settings.n_threads, min(engine.n_ctx, 4096), n_gpu_layers, log
    ) as url:
        prompts = [engine.render_text(r) for r in requests]
        lcp_decide(url, prompts[0], len(requests[0].options))  # warm-up
        engine.score(requests[:1])
        ours, theirs, agree, missing = [], [], 0, 0
        for request, prompt in zip(requests, prompts, strict=True):
            engine.cache.clear()
            started = time.perf_counter()
            result = ok(engine.score([request])[0])
            ours.append(time.perf_counter() - started)
            started = time.perf_counter()
            letters = lcp_decide(url, prompt, len(request.options))
            theirs.append(time.perf_counter() - started)
            if all(math.isinf(v) for v in letters):
                missing += 1
                continue
            agree += request.options[int(np.argmax(letters))].id == result.choice
    return {
        "decisions": len(requests),
        "no_letter_in_top20": missing,
        "agreement": agree / len(requests),
        "url_mode": "/v1/completions, max_tokens=1, logprobs=20, Arbiter's prompt text",
        **latency_pair(ours, theirs),
    }


# -- report ------------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    lines = [
        f"`arbiter bench all` on {report['machine']} (n_gpu_layers={report['n_gpu_layers']}, "
        f"model {report.get('model', '?')}, {report['decisions']} decisions from {report['file']})",
        "",
        "| suite | ok | seconds | summary |",
        "|---|---|---|---|",
    ]
    for s in report["suites"]:
        summary = (
            ", ".join(f"{k}={v}" for k, v in (s.get("summary") or {}).items())
            if s.get("summary")
            else "".join((s.get("error") or "").strip().splitlines()[-1:]).replace("|", "/")
        )
        lines.append(
            f"| {s['suite']} | {'yes' if s['ok'] else 'no'} | {s.get('seconds', 0):.0f} | {summary} |"
        )
    lines += [
        "",
        "| comparison | Arbiter p50 / p95 ms | other p50 / p95 ms | p50 ratio | p95 ratio "
        "| agreement |",
        "|---|---|---|---|---|---|",
    ]
    for name, key in (
        ("decision vs generating the letter", "generation"),
        ("llama-cpp-python server (logprobs)", "llama_cpp_server"),
    ):
        c = report.get(key) or {}
        if "skipped" in c or "error" in c:
            lines.append(f"| {name} | – | – | – | – | {c.get('skipped') or c.get('error')} |")
            continue
        lines.append(
            f"| {name} | {c['arbiter_p50_ms']:.0f} / {c['arbiter_p95_ms']:.0f} "
            f"| {c['other_p50_ms']:.0f} / {c['other_p95_ms']:.0f} | {c['p50_ratio']:.2f}x "
            f"| {c['p95_ratio']:.2f}x | {c['agreement']:.2f} |"
        )
    lines += typed_gguf_compare.rows(report["typed_gguf"])
    if report.get("warnings"):
        lines += ["", "Warnings (figures this run cannot vouch for):", ""]
        lines += [f"- {line}" for line in report["warnings"]]
    return "\n".join(lines)


def _suite_warnings(suite: dict[str, Any]) -> list[str]:
    warnings = (suite.get("summary") or {}).get("warnings") or []
    return [str(w) for w in warnings]


def comparison_ratios(report: dict[str, Any]) -> list[Ratio]:
    """The comparisons' p50 ratios (the other's time over Arbiter's) with their pairs. Generating
    the letter prefills the same prompt and then decodes: it cannot be faster than the decision.
    The other servers are other code: no floor, only their spread."""
    found = [
        (name, report.get(key))
        for name, key in (
            ("decision vs generating the letter", "generation"),
            ("llama-cpp-python server", "llama_cpp_server"),
        )
    ]
    typed = report.get("typed_gguf")
    if isinstance(typed, dict):
        found += [("typed-gguf per decision", typed.get("per_decision"))]
        found += [("typed-gguf, 8 questions on one state", typed.get("shared_8"))]
    out = []
    for name, row in found:
        if isinstance(row, dict) and "pairs" in row:
            floor = 1.0 if name.startswith("decision vs generating") else None
            out.append(Ratio(name, row["p50_ratio"], tuple(row["pairs"]), floor=floor))
    return out


def main(args: argparse.Namespace) -> int:
    from arbiter.engine import open_engine
    from arbiter.settings import EngineSettings

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_gpu = args.n_gpu_layers
    report: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs",
        "n_gpu_layers": n_gpu if n_gpu is not None else 0,
        "file": shown(args.file),
        "suites": [],
    }
    wanted = [s for s in available_suites() if not args.suites or s in args.suites.split(",")]
    for suite in wanted:
        print(f"bench {suite} ...", file=sys.stderr)
        smoke = getattr(args, "smoke", False)
        report["suites"].append(run_suite(suite, n_gpu, args.suite_timeout, smoke))
    requests, _ = load_decisions(Path(args.file), args.limit)
    report["decisions"] = len(requests)
    overrides: dict[str, Any] = {"prefix_cache_mb": 0, "order_policy": ONE_READ}
    if n_gpu is not None:
        overrides["n_gpu_layers"] = n_gpu
    if args.model is not None:
        overrides["model"] = args.model
    engine = open_engine(EngineSettings(**overrides))
    report["model"] = engine.model_info.file
    try:
        print("decision vs generation ...", file=sys.stderr)
        report["generation"] = decision_vs_generation(engine, requests)
        if args.no_lcp:
            report["llama_cpp_server"] = {"skipped": "--no-lcp"}
        else:
            print("llama-cpp-python server ...", file=sys.stderr)
            try:
                report["llama_cpp_server"] = compare_lcp(
                    engine, requests, n_gpu or 0, out / "llama_cpp_server.log"
                )
            except (RuntimeError, OSError) as exc:
                report["llama_cpp_server"] = {"error": str(exc)}
        if importlib.util.find_spec("typed_gguf") is None:
            report["typed_gguf"] = "not installed: skipped"
        else:
            print("typed-gguf server ...", file=sys.stderr)
            report["typed_gguf"] = typed_gguf_compare.compare(
                engine, requests, out / "typed_gguf_server.log"
            )
    finally:
        engine.close()
    report["warnings"] = [
        f"{s['suite']}: {line}" for s in report["suites"] for line in _suite_warnings(s)
    ] + check(comparison_ratios(report))
    markdown = render(report)
    (out / "bench-report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench-report.md").write_text(markdown + "\n")
    print(markdown)
    print(f"\nwrote {out / 'bench-report.md'} and {out / 'bench-report.json'}")
    if args.readme:
        command = _command(args)
        update_readme(Path(args.readme), markdown, command)
        print(f"updated the generated section of {args.readme}")
    return 0 if all(s["ok"] for s in report["suites"]) else 1


README_START = "<!-- generated by arbiter bench all: start -->"
README_END = "<!-- generated by arbiter bench all: end -->"


def _command(args: argparse.Namespace) -> str:
    """The command that produced the report, as docs/performance.md shows it: what was measured, with
    paths relative to the repository (the output directory is left out)."""
    parts = ["arbiter bench all", f"--limit {args.limit}"]
    if args.suites:
        parts.append(f"--suites {args.suites}")
    if args.n_gpu_layers is not None:
        parts.append(f"--n-gpu-layers {args.n_gpu_layers}")
    if Path(args.file).resolve() != LABELED:
        parts.append(f"--file {shown(args.file)}")
    if args.model is not None:
        parts.append(f"--model {shown(args.model)}")
    if args.no_lcp:
        parts.append("--no-lcp")
    parts.append(f"--readme {shown(args.readme)}")
    return " ".join(parts)


def update_readme(path: Path, markdown: str, command: str) -> None:
    """Replace the page's generated section (between the two markers) with this run's report."""
    text = path.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"{path} has no '{README_START}' ... '{README_END}' section to update")
    block = f"{README_START}\n```sh\n{command}\n```\n\n{markdown}\n"
    path.write_text(text[:start] + block + text[end:])
