"""The `arbiter` command: `python -m arbiter` is the one way in, each command loads only its own
package, and `arbiter decide` writes one output line per input line, errors beside results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests import ROOT


def test_decide_writes_one_line_per_input_line(tmp_path: Path) -> None:
    good = json.loads((ROOT / "examples" / "decisions.jsonl").read_text().splitlines()[0])
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({**good, "id": "dup", "options": [good["options"][0], good["options"][0]]}),
        json.dumps({**good, "id": "second", "question": "Is the customer on enterprise?"}),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "arbiter", "decide", str(source), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={
            **{k: v for k, v in os.environ.items() if k != "ARBITER_MODEL"},
            "ARBITER_MODEL_DIR": str(tmp_path / "none"),
        },
    )
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [o["line"] for o in out] == [1, 2, 3, 4]
    assert out[0]["result"]["choice"] in {o["id"] for o in good["options"]}
    assert out[1]["error"]["code"] == "invalid_json" and out[1]["id"] is None
    assert out[2]["error"]["param"] == "options" and out[2]["id"] == "dup"
    assert out[3]["id"] == "second" and "result" in out[3]
    # Both scored decisions share the ticket state: the second reused the first's prefix.
    assert (
        out[3]["result"]["prompt"]["prefix_tokens"] == out[0]["result"]["prompt"]["prefix_tokens"]
    )


def test_decide_refuses_a_missing_input_in_one_line_before_any_model_loads(
    tmp_path: Path,
) -> None:
    """A mistyped file name costs no model load: the input is opened first, and the refusal takes
    the time an interpreter takes to start (0.5 s here; the bound is 3 s). The model named here is
    a file llama.cpp cannot load, so a command that loaded first would refuse the model."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model\n" * 64)
    missing = tmp_path / "missing.jsonl"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "arbiter", "decide", str(missing), "--model", str(junk), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"arbiter decide: {missing}: No such file or directory"]
    assert proc.stdout == ""
    assert took < 3, f"{took:.1f} s"


def _loaded_after(code: str) -> set[str]:
    """Top-level packages of this project that a fresh interpreter has imported after ``code``."""
    probe = f"import sys\n{code}\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    return set(out) & {"arbiter", "adapter", "worker", "evaluation", "bench", "infra"}


def test_a_command_loads_only_its_own_package() -> None:
    """`arbiter serve` builds its parser without the worker, the evaluation or the benchmarks
    (the old CLI imported every package, bench included, to build any command's parser)."""
    serve = "from arbiter.cli import build_parser; build_parser('serve').parse_args(['serve'])"
    assert _loaded_after(serve) == {"arbiter", "adapter"}
    work = "from arbiter.cli import build_parser; build_parser('work').parse_args(['work'])"
    assert _loaded_after(work) == {"arbiter", "worker"}
    every = "from arbiter.cli import build_parser; build_parser()"
    assert _loaded_after(every) == {"arbiter", "adapter", "worker", "evaluation", "bench", "infra"}


def test_python_m_arbiter_is_the_arbiter_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "arbiter", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
    ).stdout
    for command in ("decide", "serve", "entrypoint", "work", "eval", "bench", "deploy"):
        assert command in out


def test_decide_answers_a_line_that_is_not_utf8_with_its_error_and_keeps_going(
    engine: object, tmp_path: Path, capsys: object
) -> None:
    """A Latin-1 line was a UnicodeDecodeError traceback with no output (issue 35)."""
    import pytest

    from arbiter.cli import main
    from tests.fakes import decision_body

    assert isinstance(capsys, pytest.CaptureFixture)
    source = tmp_path / "latin1.jsonl"
    latin1 = json.dumps(decision_body("caf\u00e9"), ensure_ascii=False).encode("latin-1")
    good = json.dumps(decision_body("good")).encode()
    source.write_bytes(latin1 + b"\n" + good + b"\n")
    model = engine.resolved.path  # type: ignore[attr-defined]
    assert main(["decide", str(source), "--model", str(model), "--quiet"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["line"] for o in out] == [1, 2]
    assert out[0]["error"]["code"] == "invalid_json" and out[0]["id"] is None
    assert out[1]["id"] == "good" and "result" in out[1]
