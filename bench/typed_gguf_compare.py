"""typed-gguf (PyPI ``typed-gguf``, optional) as a peer decision server in ``arbiter bench all``.

Only run when ``typed_gguf`` is importable; it is never a dependency of this project. Set up the
way ``shared/reference/peer-servers-measured.md`` ran 0.3.0 on these machines:

* its runtime is llama-cpp-python's own ``lib/`` (``TYPED_GGUF_RUNTIME_DIR``): ``typed-gguf init``
  would download a pinned llama.cpp bundle, and nothing here may reach the network;
* a private ``TYPED_GGUF_HOME`` (a temporary directory, removed afterwards) whose ``registry.json``
  holds the GGUF under test, written through ``typed_gguf.registry.store`` (no CLI registers a
  local file);
* ``typed-gguf serve --host 127.0.0.1 --port <ephemeral> --keep-alive 60m``; the warm host it
  spawns is ended with ``typed-gguf keep stop`` and the server by its own pid, always;
* ``POST /v1/decide`` with ``model`` = the GGUF path, ``options.threads`` = Arbiter's threads and
  ``options.template="gemma"`` for a Gemma GGUF without a chat template.

Two measurements, Arbiter in-process vs typed-gguf over loopback HTTP, interleaved:

1. per decision: each labeled decision as one ``choice`` question (``criteria`` = option id ->
   description), Arbiter cold (cache cleared) vs one request; agreement = typed-gguf's most
   probable option equals Arbiter's choice;
2. 8 questions on one ~400-token state (``bench.engine_bench``'s state and questions, a new state
   per round): Arbiter's grouped ``score`` vs one typed-gguf request with 8 questions.

Each system renders its own prompt from the same decision. Any failure to start or answer
(including a download attempt, which fails fast offline) becomes ``{"skipped": reason}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from arbiter.schema import DecisionRequest
from bench.common import (
    QUESTIONS,
    case_decision,
    free_port,
    latency_pair,
    ok,
    sized_state,
    stop,
    wait_until_ready,
)

START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0
SHARED_ROUNDS = 3


def _bin() -> str:
    local = Path(sys.executable).parent / "typed-gguf"
    return str(local) if local.exists() else "typed-gguf"


def _env(home: Path) -> dict[str, str]:
    import llama_cpp

    env = dict(os.environ)
    env["TYPED_GGUF_HOME"] = str(home)
    env["TYPED_GGUF_RUNTIME_DIR"] = str(Path(llama_cpp.__file__).parent / "lib")
    # No network: offline flags, plus an unroutable proxy so any stray download fails fast.
    env["TYPED_GGUF_OFFLINE"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env[var] = "http://127.0.0.1:9"
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def _register(home: Path, model: Path) -> None:
    from typed_gguf.registry import store

    registry, _ = store.load_registry(store.registry_path(home))
    store.add_entry(registry, store.Entry(alias=model.name, path=str(model)))
    store.save_registry(registry, store.registry_path(home))


def template_for(model: Path) -> str | None:
    """``"gemma"`` for a Gemma GGUF without ``tokenizer.chat_template`` (typed-gguf 503s on it)."""
    from typed_gguf.registry.gguf import parse_gguf_metadata

    kv = parse_gguf_metadata(model)["kv"]
    if kv.get("tokenizer.chat_template"):
        return None
    return "gemma" if str(kv.get("general.architecture", "")).startswith("gemma") else None


@contextlib.contextmanager
def server(model: Path, log: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """``typed-gguf serve`` on loopback with a private home; host and server stopped on exit."""
    home = Path(tempfile.mkdtemp(prefix="tg-"))
    env = _env(home)
    _register(home, model)
    port = free_port()
    cmd = [_bin(), "serve", "--host", "127.0.0.1", "--port", str(port), "--keep-alive", "60m"]
    handle = log.open("w")
    proc = subprocess.Popen(
        cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(proc, f"{url}/health", "typed-gguf serve", log, START_TIMEOUT_S, 0.3)
        yield url, env
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                [_bin(), "keep", "stop"],
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=30,
            )
        stop(proc)
        # Anything the server left in its own session (it was started in a new one).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        handle.close()
        shutil.rmtree(home, ignore_errors=True)


def _question(request: DecisionRequest) -> dict[str, Any]:
    return {
        "type": "choice",
        "instructions": request.question,
        "criteria": {o.id: o.description for o in request.options},
    }


def decide(
    url: str, model: Path, requests: list[DecisionRequest], options: dict[str, Any]
) -> dict[str, Any]:
    """One ``/v1/decide`` call: the questions of ``requests`` (all on one state) as q0, q1, ..."""
    body = {
        "model": str(model),
        "state": requests[0].state,
        "questions": {f"q{i}": _question(r) for i, r in enumerate(requests)},
        "options": options,
    }
    req = urllib.request.Request(
        f"{url}/v1/decide",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise RuntimeError(f"typed-gguf /v1/decide answered {exc.code}: {detail}") from None


def _top(answer: dict[str, Any]) -> str:
    probs: dict[str, float] = answer["probabilities"]
    return max(probs, key=probs.__getitem__)


def _median(values: list[float]) -> float | None:
    return float(sorted(values)[len(values) // 2]) if values else None


def compare(engine: Any, requests: list[DecisionRequest], log: Path) -> dict[str, Any]:
    """Per decision and 8-questions-on-one-state latency and agreement against typed-gguf."""
    from typed_gguf.errors import TypedGgufError

    model = Path(engine.resolved.path)
    options: dict[str, Any] = {"threads": engine.settings.n_threads}
    try:
        template = template_for(model)
        if template:
            options["template"] = template
        with server(model, log) as (url, _):
            decide(url, model, requests[:1], options)  # warm-up: loads the model in its host
            engine.score(requests[:1])
            ours, theirs, agree, reused, low_mass, engine_ms = [], [], 0, 0, 0, []
            for request in requests:
                engine.cache.clear()
                started = time.perf_counter()
                result = ok(engine.score([request])[0])
                ours.append(time.perf_counter() - started)
                started = time.perf_counter()
                raw = decide(url, model, [request], options)
                theirs.append(time.perf_counter() - started)
                answer = raw["answers"]["q0"]
                agree += _top(answer) == result.choice
                low_mass += answer.get("reliability") == "low_mass"
                reused += bool((raw.get("engine") or {}).get("prefill_reused"))
                total = (raw.get("timings") or {}).get("total_ms")
                if isinstance(total, (int, float)):
                    engine_ms.append(float(total))
            per_decision = {
                "decisions": len(requests),
                "agreement": agree / len(requests),
                "low_mass_answers": low_mass,
                "prefill_reused": reused,
                "typed_gguf_engine_total_p50_ms": _median(engine_ms),
                **latency_pair(ours, theirs),
            }

            s_ours, s_theirs, s_agree, s_total, prefix_tokens = [], [], 0, 0, None
            for r in range(SHARED_ROUNDS + 1):  # round 0 warms up
                state = sized_state(engine, 77_000 + r, 400, whole_prompt=False)
                batch = [case_decision(i, state, q) for i, q in enumerate(QUESTIONS)]
                engine.cache.clear()
                started = time.perf_counter()
                results = [ok(o) for o in engine.score(batch)]
                ours_s = time.perf_counter() - started
                started = time.perf_counter()
                raw = decide(url, model, batch, options)
                theirs_s = time.perf_counter() - started
                if r:
                    s_ours.append(ours_s)
                    s_theirs.append(theirs_s)
                    prefix_tokens = results[0].prompt.prefix_tokens
                    s_agree += sum(
                        _top(raw["answers"][f"q{i}"]) == res.choice for i, res in enumerate(results)
                    )
                    s_total += len(results)
            shared = {
                "rounds": SHARED_ROUNDS,
                "questions": len(QUESTIONS),
                "state_prefix_tokens": prefix_tokens,
                "agreement": s_agree / s_total,
                "typed_gguf_requests": "one request with 8 questions",
                **latency_pair(s_ours, s_theirs),
            }
    except (RuntimeError, OSError, KeyError, ValueError, ImportError, TypedGgufError) as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
    import typed_gguf

    return {
        "version": getattr(typed_gguf, "__version__", "?"),
        "options": options,
        "per_decision": per_decision,
        "shared_8": shared,
    }


def rows(entry: Any) -> list[str]:
    """Rows of ``all_bench``'s comparison table for ``report["typed_gguf"]``."""
    if not isinstance(entry, dict) or "per_decision" not in entry:
        reason = entry.get("skipped") if isinstance(entry, dict) else entry
        return [f"| typed-gguf | – | – | – | – | {reason} |"]
    out = []
    for name, c in (
        ("typed-gguf /v1/decide, per decision", entry["per_decision"]),
        ("typed-gguf, 8 questions on one state (1 request)", entry["shared_8"]),
    ):
        out.append(
            f"| {name} | {c['arbiter_p50_ms']:.0f} / {c['arbiter_p95_ms']:.0f} "
            f"| {c['other_p50_ms']:.0f} / {c['other_p95_ms']:.0f} | {c['p50_ratio']:.2f}x "
            f"| {c['p95_ratio']:.2f}x | {c['agreement']:.2f} |"
        )
    return out
