"""What the benchmarks share: statistics, the decisions they are made of, and local servers.

Builders: generated support-case states sized to a token count on the real tokenizer, and the
questions asked about them. Statistics: percentiles in milliseconds and the latency pair that every
comparison table prints (p50 and p95 of both sides, and their ratios). Local servers: a free port on
127.0.0.1 and waiting until a started server answers.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from arbiter.prompt import state_text
from arbiter.schema import DecisionRequest, DecisionResult

if TYPE_CHECKING:
    from arbiter.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
LABELED = ROOT / "examples" / "labeled.jsonl"
# The floor and the peers read a prompt once, in the given order, and so does Arbiter in the benches
# that set it beside them: by default it reads more orders while the leader is unclear (four on the
# bundled model, which ships no calibration), which `arbiter bench orders` prices on its own.
ONE_READ = "single"
DECISIONS = ROOT / "evaluation" / "data" / "decisions"  # the project's own labeled decisions


def shown(path: Path | str) -> str:
    """A path as generated text shows it: relative to the repository, else its file name (never a
    path of the machine that produced the text)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else resolved.name


# -- decisions -------------------------------------------------------------------------------------

_WORDS = [
    "customer",
    "order",
    "invoice",
    "shipment",
    "delayed",
    "refund",
    "account",
    "login",
    "password",
    "reset",
    "error",
    "page",
    "support",
    "agent",
    "priority",
    "outage",
    "payment",
    "card",
    "region",
    "server",
    "database",
    "latency",
    "report",
    "user",
    "billing",
    "contract",
    "renewal",
    "seat",
    "license",
    "escalation",
    "ticket",
    "email",
    "phone",
    "weekend",
    "manager",
]

QUESTIONS = [
    "Which queue should handle this case?",
    "Which team owns the follow-up?",
    "What is the most likely root cause?",
    "Where should the customer be routed?",
    "Which specialist should review it first?",
    "What kind of problem is described?",
    "Which department is responsible?",
    "Which category fits the case best?",
]


def case_state(seed: int, words: int) -> dict[str, Any]:
    """A support case whose notes are ``words`` words drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    text = " ".join(rng.choice(_WORDS, size=words).tolist())
    return {"case": f"C-{seed}", "tier": "enterprise", "notes": text}


def case_decision(
    i: int, state: Any, question: str = "Which queue should handle this case?"
) -> DecisionRequest:
    """Decision ``d<i>`` over ``state`` with four routing options."""
    return DecisionRequest.model_validate(
        {
            "id": f"d{i}",
            "state": state,
            "question": question,
            "options": [
                {"id": "access", "description": "Account access and login"},
                {"id": "billing", "description": "Billing, invoices and refunds"},
                {"id": "shipping", "description": "Shipping and delivery"},
                {"id": "tech", "description": "Technical outage or error"},
            ],
        }
    )


def sized_state(
    engine: Engine, seed: int, target_tokens: int, *, whole_prompt: bool = True
) -> dict[str, Any]:
    """A state sized so that the whole prompt (or the state alone) is about ``target_tokens``."""

    def count(words: int) -> int:
        state = case_state(seed, words)
        if whole_prompt:
            return len(engine.prompt_tokens(case_decision(0, state)))
        return len(engine.tokenize_content(state_text(state)))

    words = max(4, target_tokens // 2)
    for _ in range(30):
        tokens = count(words)
        if abs(tokens - target_tokens) <= 8:
            break
        words = max(4, int(words * target_tokens / tokens))
    return case_state(seed, words)


def ok(outcome: object) -> DecisionResult:
    """A benchmark decision's result; a failure stops the benchmark."""
    if not isinstance(outcome, DecisionResult):
        raise RuntimeError(f"the engine failed a benchmark decision: {outcome}")
    return outcome


# -- statistics ------------------------------------------------------------------------------------


def percentile_ms(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (seconds), in milliseconds."""
    return float(np.percentile(np.asarray(values) * 1000.0, q))


def latency_pair(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, Any]:
    """p50 and p95 of Arbiter's and the other side's seconds, and the other's over Arbiter's."""
    return {
        "arbiter_p50_ms": percentile_ms(ours, 50),
        "arbiter_p95_ms": percentile_ms(ours, 95),
        "other_p50_ms": percentile_ms(theirs, 50),
        "other_p95_ms": percentile_ms(theirs, 95),
        "p50_ratio": percentile_ms(theirs, 50) / percentile_ms(ours, 50),
        "p95_ratio": percentile_ms(theirs, 95) / percentile_ms(ours, 95),
        "pairs": [t / o for o, t in zip(ours, theirs, strict=True)],
    }


# -- local servers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_ready(
    proc: subprocess.Popen[bytes], url: str, name: str, log: Path, timeout_s: float, poll_s: float
) -> None:
    """Poll ``url`` until it answers; raise (naming ``log``) if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start; see {log}") from None
            time.sleep(poll_s)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 20) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``: a started server never outlives its benchmark."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
