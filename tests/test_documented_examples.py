"""Every shell and Python block of README.md and docs/*.md runs as pasted against a running stack,
or says why it cannot here.

The stack is `arbiter local` from the project's wheel (``tests.documented``) on the bundled model,
on a block of free ports: the blocks' 8080-8083 are rewritten to its ports (and ``ARBITER_PORT`` is
set for them, as a moved stack's shell has it). Each block runs in ``bash -e -o pipefail`` from a
folder holding the checkout's ``examples/`` and a ``.venv`` that is the wheel's environment, with
curl told to fail on an HTTP error (``--fail-with-body``): a body the server refuses fails its block
(``-d '{"decision": {...}}'`` was one). A line that starts a server (``arbiter serve``, ``arbiter
local``) is the stack itself, already up. A Python block runs with the wheel's interpreter. Blocks
with the same text run once.

A block that is not run says why (``NOT_RUN``, and the rules in :func:`why_not`: a make target or a
bench, a placeholder only AWS fills), and its `arbiter` lines are parsed by the CLI's own parser, so
the options they show exist. JSON, TOML and plain blocks are output or data, not code.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import ROOT
from tests.documented import FENCE, Installed, documents
from tests.ports import free_block
from tests.worker.local_stack import Local

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900)]

RUN = ("sh", "python")
AWS = "needs AWS: its $VARIABLES and <placeholders> come from a deployed stack (infra/README.md)"
CI = (
    "make targets and benches: CI runs make test, make soak and make bench-smoke (every bench "
    "suite at its smallest size); make run is this test's stack with the 1.5B model"
)
# Blocks not run here, found by a text each holds (at least one block of the document must).
NOT_RUN = {
    ("docs/batch-jobs.md", "check-fanout"): "checks a stack deployed on AWS (moto is not S3)",
    ("docs/configuration.md", "ARBITER_PORT=9080"): (
        "starts a second stack; tests/worker/test_local_stack.py runs two side by side"
    ),
    ("docs/evaluation.md", "arbiter eval"): (
        "each reads 36 to 254 labeled decisions in several orders: minutes (the 1.5B: an hour)"
    ),
    (
        "docs/fanout.md",
        "tests.faults.blackbox",
    ): "the checkout's tests, not the wheel's: make faults",
    ("docs/models.md", "models install"): "downloads a 1.1 GB model (make run installs it)",
    ("docs/models.md", "package-model --gguf base-q4_k_m.gguf"): "packs your own GGUF and adapter",
    ("docs/sagemaker.md", "def real_time"): (
        "a quote of examples/sagemaker_app.py, which the block before it runs "
        "(tests/emulator/test_application.py checks the quote)"
    ),
}
_SERVER = re.compile(r"^\s*(\S*/)?arbiter (serve|local)\b")
_PLACEHOLDER = re.compile(r"\$\([^)]*\)|\$\{?[A-Z][A-Z_]*\}?|<[^>\n]+>")
_PORT = re.compile(r"\b808([0-3])\b")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    language: str
    text: str

    def commands(self) -> list[list[str]]:
        """Each command's words (continuations joined; comments, ``X=y`` and placeholders out)."""
        out = []
        for line in self.text.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(_PLACEHOLDER.sub("X", line), posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            try:
                words = list(lexer)
            except ValueError:  # a quote that the next lines close: a body, not a command
                continue
            command: list[str] = []
            for word in [*words, ";"]:
                if word in ("&&", "||", ";", "|", "&"):
                    while command and re.fullmatch(r"[A-Z_]+=.*", command[0]):
                        command = command[1:]
                    out += [command] if command else []
                    command = []
                else:
                    command.append(word)
        return out


def blocks() -> list[Block]:
    found = []
    for path in documents():
        text = path.read_text()
        for match in FENCE.finditer(text):
            head, _, body = match.group(0).partition("\n")
            body = body.rsplit("\n", 1)[0] + "\n"
            line = text.count("\n", 0, match.start()) + 1
            language = head.strip("`~ ").split(" ")[0]
            found.append(Block(str(path.relative_to(ROOT)), line, language, body))
    return found


def why_not(block: Block) -> str | None:
    """Why ``block`` is not run here, or None when it is."""
    if block.language not in RUN:
        return "output or data"
    for (doc, needle), reason in NOT_RUN.items():
        if block.doc == doc and needle in block.text:
            return reason
    commands = block.commands()
    if block.language == "sh" and all(
        c[0] == "make" or (Path(c[0]).name == "arbiter" and c[1:2] == ["bench"]) for c in commands
    ):
        return CI
    if _PLACEHOLDER.search(block.text) or any(c[0] == "aws" for c in commands):
        return AWS
    return None


def test_every_not_run_entry_still_names_a_block() -> None:
    found = blocks()
    stale = [key for key in NOT_RUN if not any(b.doc == key[0] and key[1] in b.text for b in found)]
    assert stale == []


def test_the_rules_run_what_a_stack_answers_and_say_why_not_the_rest() -> None:
    sh = [
        Block("x.md", 1, "sh", "make run     # the stack\nmake test\n"),
        Block("x.md", 1, "sh", ".venv/bin/arbiter bench engine --repeats 7\n"),
        Block("x.md", 1, "sh", "arbiter transform s3://$BUCKET/in/ --role <role ARN>\n"),
        Block("x.md", 1, "sh", "curl -s localhost:8080/ping\n"),
        Block("x.md", 1, "json", '{"id": "t1"}\n'),
    ]
    assert [why_not(b) for b in sh] == [CI, CI, AWS, None, "output or data"]
    assert sh[2].commands() == [["arbiter", "transform", "s3://X/in/", "--role", "X"]]
    two = Block("x.md", 1, "sh", "A=$(arbiter models install q) arbiter serve && make x  # c\n")
    assert two.commands() == [["arbiter", "serve"], ["make", "x"]]


def _runnable() -> list[Block]:
    seen, out = set(), []
    for block in blocks():
        if why_not(block) is None and (block.language, block.text) not in seen:
            seen.add((block.language, block.text))
            out.append(block)
    return out


@pytest.fixture(scope="module")
def stack(installed: Installed) -> Iterator[int]:
    """`arbiter local` from the wheel on a free base port, once it says it is up; its base port."""
    base = free_block()
    env = {
        **installed.env,
        "ARBITER_PORT": str(base),
        "ARBITER_ORDER_POLICY": "single",  # one read a decision: the examples' shapes, quickly
        "ARBITER_READ_CHECK": "off",  # the bundled model's, held by tests/arbiter/test_read_check.py
        "ARBITER_WAIT_TIME_S": "1",
    }
    local = Local(["--fresh"], env, arbiter=installed.arbiter, cwd=installed.cwd)
    try:
        local.wait_for(lambda line: "arbiter local is up" in line, within_s=420)
        yield base
    finally:
        local.close()


# curl refuses --fail beside --fail-with-body: a block's own -f (alone or in -sf) is dropped.
_CURL = """#!/bin/bash
args=()
for a in "$@"; do
    case "$a" in
        --fail) ;;
        -f) ;;
        -[!-]*f*) args+=("${{a//f/}}") ;;
        *) args+=("$a") ;;
    esac
done
exec {curl} --fail-with-body "${{args[@]}}"
"""


@pytest.fixture(scope="module")
def where(installed: Installed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder as a checkout looks to its examples: ``examples/`` and ``.venv`` (the wheel's),
    and a ``curl`` first on the path that fails on an HTTP error."""
    here = tmp_path_factory.mktemp("examples")
    shutil.copytree(ROOT / "examples", here / "examples")
    (here / ".venv").symlink_to(installed.python.parent.parent)
    shims = here / "shims"
    shims.mkdir()
    real = shutil.which("curl")
    assert real, "curl is needed to run the documents' examples"
    (shims / "curl").write_text(_CURL.format(curl=real))
    (shims / "curl").chmod(0o755)
    return here


def _run(block: Block, base: int, here: Path, installed: Installed) -> tuple[int, str]:
    text = _PORT.sub(lambda m: str(base + int(m.group(1))), block.text)
    env = {
        **installed.env,
        "ARBITER_PORT": str(base),
        "PATH": f"{here / 'shims'}:{installed.env['PATH']}",
    }
    if block.language == "python":
        script = here / f"block-{block.line}.py"
        script.write_text(text)
        command = [str(here / ".venv" / "bin" / "python"), str(script)]
    else:
        kept = [line for line in text.splitlines() if not _SERVER.match(line)]
        command = ["bash", "-e", "-o", "pipefail", "-c", "\n".join(kept)]
    done = subprocess.run(
        command, cwd=here, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    return done.returncode, (done.stdout + done.stderr)[-1500:]


def test_every_runnable_block_runs_as_pasted(stack: int, where: Path, installed: Installed) -> None:
    runnable = _runnable()
    assert len(runnable) >= 8, [f"{b.doc}:{b.line}" for b in runnable]
    failed = {}
    for block in runnable:
        code, output = _run(block, stack, where, installed)
        if code != 0:
            failed[f"{block.doc}:{block.line}"] = f"exit {code}:\n{output}"
    assert failed == {}, "\n\n".join(f"{where}, {output}" for where, output in failed.items())


# Run inside the wheel's environment: each argv parsed by the CLI's parser, its error if any.
_PARSE = """
import json, sys
from arbiter.cli import build_parser

errors = {}
for argv in json.loads(sys.stdin.read()):
    try:
        build_parser().parse_args(argv)
    except SystemExit as exit:
        if exit.code:
            errors[" ".join(argv)] = exit.code
print(json.dumps(errors))
"""


def test_the_arbiter_lines_of_blocks_not_run_parse(installed: Installed) -> None:
    argvs = [
        c[1:]
        for block in blocks()
        if block.language == "sh" and why_not(block) is not None
        for c in block.commands()
        if Path(c[0]).name == "arbiter" and "..." not in c  # "..." elides what the line omits
    ]
    assert len(argvs) >= 10
    done = subprocess.run(
        [str(installed.python), "-c", _PARSE],
        input=json.dumps(argvs),
        cwd=installed.cwd,
        env=installed.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(done.stdout.splitlines()[-1]) == {}, done.stderr[-3000:]
