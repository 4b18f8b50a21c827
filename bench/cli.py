"""`arbiter bench SUITE`: every benchmark's subcommand, registered here and nowhere else.

Each suite is a module of its own (``bench/<suite>_bench.py``, with ``main(args)``), imported only
when it runs. Every figure a suite prints is a ratio against a baseline measured in the same run,
flagged when it cannot be true (``bench.figures``). ``--smoke`` runs a suite at its smallest size:
the module's ``SMOKE`` arguments replace the command line's (`make bench-smoke`, ``bench.smoke``).
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path
from typing import Any

from bench.common import DECISIONS, LABELED

SUITES = (
    "engine",
    "models",
    "http",
    "worker",
    "faults",
    "generation",
    "abuse",
    "soak",
    "peers",
    "transform",
    "orders",
    "all",
)
MODULES = {"soak": "bench.soak"}  # the others are bench/<suite>_bench.py


def module_of(suite: str) -> Any:
    return importlib.import_module(MODULES.get(suite, f"bench.{suite}_bench"))


def _run(args: argparse.Namespace) -> int:
    module = module_of(args.suite)
    if args.smoke:
        for name, value in module.SMOKE.items():
            setattr(args, name, value)
    return int(module.main(args))


def register(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (ratios against a baseline of the same run)")
    suites = bench.add_subparsers(dest="suite", required=True)

    engine = suites.add_parser("engine", help="engine latency vs the llama_decode floor")
    engine.add_argument("--model", type=Path, default=None)
    engine.add_argument("--json", action="store_true", help="print JSON (last line: the ratios)")
    engine.add_argument("--repeats", type=int, default=5)
    engine.add_argument(
        "--long-prompt", type=int, default=0, metavar="N", help="add a ~N-token single-decision row"
    )
    engine.add_argument(
        "--lora",
        default=None,
        metavar="SPEC",
        help="add the adapter rows: an ARBITER_LORA value (path[:scale],...) or 'random'",
    )
    engine.add_argument(
        "--adapter-only", action="store_true", help="with --lora: only the adapter rows"
    )

    models = suites.add_parser("models", help="compare the bundled candidate models")
    models.add_argument("--file", default="examples/labeled.jsonl", help="labeled decisions")
    models.add_argument("--limit", type=int, default=0, help="the first N decisions (0: all)")
    models.add_argument("--json", action="store_true")

    http = suites.add_parser("http", help="HTTP overhead vs the engine, and an overload soak")
    http.add_argument("--model", type=Path, default=None)
    http.add_argument("--repeats", type=int, default=20, help="single-decision samples")
    http.add_argument("--overload-s", type=float, default=20.0)
    http.add_argument("--clients", type=int, default=32)
    http.add_argument("--json", action="store_true", help="print JSON (last line: the summary)")

    worker = suites.add_parser(
        "worker", help="end-to-end job throughput vs the engine alone, grouped vs ungrouped"
    )
    worker.add_argument("--decisions", type=int, default=1000, help="job size (10 per state)")
    worker.add_argument(
        "--ungrouped", type=int, default=100, help="sampled decisions scored one by one, uncached"
    )
    worker.add_argument("--state-tokens", type=int, default=400, help="tokens per state")
    worker.add_argument(
        "--segments", type=int, default=5, help="turns the paths take (noise sharing)"
    )
    worker.add_argument(
        "--fanout",
        type=int,
        default=0,
        metavar="N",
        help="instead: job wall time whole on 1 process vs split on 1 and on N processes",
    )
    worker.add_argument(
        "--shard-lines", type=int, default=0, help="with --fanout (0: decisions / 4N)"
    )
    worker.add_argument("--repeats", type=int, default=2, help="with --fanout: rounds")
    worker.add_argument("--model", type=Path, default=None)
    worker.add_argument("--json", action="store_true", help="print JSON")

    faults = suites.add_parser(
        "faults", help="JSON Lines throughput by body size, and Batch Transform's payload sizing"
    )
    faults.add_argument("--lines", type=int, default=60)
    faults.add_argument("--questions", type=int, default=10)

    transform = suites.add_parser(
        "transform", help="arbiter transform's peak memory over one large object, streamed"
    )
    transform.add_argument("--mb", type=int, default=200, help="the large object's size, MiB")

    generation = suites.add_parser(
        "generation",
        help="chat generation per token: sampler chain, logprobs, JSON grammar, n choices vs greedy",
    )
    generation.add_argument("--model", type=Path, default=None, help="else both bundled models")
    generation.add_argument("--tokens", type=int, default=48, help="tokens per generation")
    generation.add_argument("--repeats", type=int, default=3)
    generation.add_argument("--threads", type=int, default=None, help="else ARBITER_N_THREADS")
    generation.add_argument("--json", action="store_true", help="print JSON")

    abuse = suites.add_parser(
        "abuse", help="what 5 MB chats, 5 MB states and abandoned requests cost the others"
    )
    abuse.add_argument("--model", type=Path, default=None)
    abuse.add_argument("--repeats", type=int, default=15, help="decisions per latency sample")
    abuse.add_argument("--chats", type=int, default=5, help="clients posting 5 MB chat messages")
    abuse.add_argument("--disconnect-after-s", type=float, default=3.0)
    abuse.add_argument("--json", action="store_true", help="print JSON")

    soak = suites.add_parser(
        "soak", help="mixed and hostile traffic for minutes: RSS, fds, latency, every status"
    )
    soak.add_argument(
        "--model", type=Path, default=None, help="a .gguf (default: the bundled model)"
    )
    soak.add_argument("--minutes", type=float, default=2.0)
    soak.add_argument("--clients", type=int, default=4)
    soak.add_argument("--states", type=int, default=300, help="distinct states (the cache churns)")
    soak.add_argument("--prefix-cache-mb", type=float, default=32.0)
    soak.add_argument("--sample-s", type=float, default=3.0, help="RSS and fd sampling period")
    soak.add_argument(
        "--max-growth-mb-per-1k",
        type=float,
        default=8.0,
        help="fail when RSS grows more than this per 1,000 requests after warm-up",
    )
    soak.add_argument(
        "--max-growth-mb", type=float, default=16.0, help="the growth always allowed (short runs)"
    )
    soak.add_argument("--max-fd-growth", type=int, default=8)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", action="store_true", help="print JSON (last line: the summary)")

    peers = suites.add_parser(
        "peers",
        help="Arbiter vs llama.cpp's own C++ server (built here), paired on the same tokens",
    )
    peers.add_argument("--model", type=Path, default=None)
    peers.add_argument("--decisions", type=int, default=20, help="cold single decisions")
    peers.add_argument("--states", type=int, default=4, help="states of the interleaved row")
    peers.add_argument("--repeats", type=int, default=3, help="rounds of the shared-state row")
    peers.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    peers.add_argument("--n-ctx", type=int, default=8192)
    peers.add_argument(
        "--chat-model", type=Path, default=None, help="the chat row's model (else SmolLM2)"
    )
    peers.add_argument("--no-chat", action="store_true", help="leave out the chat row")
    peers.add_argument("--no-study", action="store_true", help="leave out the in-process study")
    peers.add_argument("--study-repeats", type=int, default=3, help="rounds of the study")
    peers.add_argument(
        "--only-study", action="store_true", help="the in-process study alone (no servers)"
    )
    peers.add_argument("--json", action="store_true", help="print JSON (last line: the report)")

    orders = suites.add_parser(
        "orders", help="order robustness's cost: the defaults vs one read in the given order"
    )
    orders.add_argument(
        "--file",
        default=str(DECISIONS),
        help="labeled decisions (a file, or a folder of them; default: the project's own)",
    )
    orders.add_argument("--split", default="heldout", help='items whose "split" is this ("" all)')
    orders.add_argument("--limit", type=int, default=0, help="N decisions spread over the files")
    orders.add_argument("--model", type=Path, default=None)
    orders.add_argument("--json", action="store_true", help="print JSON")

    every = suites.add_parser("all", help="every benchmark, plus the peer comparisons")
    every.add_argument("--file", default=str(LABELED), help="labeled decisions for the comparisons")
    every.add_argument("--limit", type=int, default=12, help="decisions used by the comparisons")
    every.add_argument(
        "--suites", default=None, help="comma list among engine,http,worker (default: all)"
    )
    every.add_argument("--suite-timeout", type=float, default=1800.0, help="seconds per suite")
    every.add_argument("--n-gpu-layers", type=int, default=None, help="layers to offload (-1: all)")
    every.add_argument("--model", type=Path, default=None, help="a .gguf (else the default model)")
    every.add_argument("--no-lcp", action="store_true", help="skip the llama-cpp-python server")
    every.add_argument("--out", default="bench-out", help="directory for the report files")
    every.add_argument(
        "--readme",
        default=None,
        help="the page whose generated bench section to rewrite (docs/performance.md)",
    )

    for parser in suites.choices.values():
        parser.add_argument(
            "--smoke",
            action="store_true",
            help="the smallest size (make bench-smoke): figures flagged, targets not judged",
        )
        parser.set_defaults(func=_run)
