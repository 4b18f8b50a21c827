"""Each subcommand's refusals, run as a user runs them: one line on stderr that names what to
change, status 2, no traceback (arbiter.cli's main and arbiter/refusals.py).

A missing model, a missing adapter and a bad prompt profile for every command that loads an
engine (``serve`` and ``work`` refuse before they bind a port or spawn a worker); no AWS
credentials for every command that calls AWS. The environment is emptied of ARBITER_*, SM_* and
AWS_* first, with the credential files and the instance metadata lookup turned off, so nothing
here reaches a network.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import EXAMPLES

MISSING_MODEL = {"ARBITER_MODEL": "/nonexistent/model.gguf"}
MISSING_ADAPTER = {"ARBITER_LORA": "/nonexistent/adapter.gguf"}
BAD_PROFILE = {"ARBITER_PROMPT_PROFILE": "bad-profile.toml"}
DIGEST = "a" * 64
IMAGE = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter@sha256:{DIGEST}"

# What each command is given: files are in the run's directory (written by the fixture).
ENGINE_COMMANDS = {
    "decide": ["decide", "decisions.jsonl", "--quiet"],
    "prompt": ["prompt", "decisions.jsonl"],
    "eval": ["eval", "labeled.jsonl", "--out", "eval-out"],
    "calibrate": ["calibrate", "labeled.jsonl", "-o", "calibration.json"],
    "serve": ["serve", "--port", "0"],
    "work": ["work"],
    "local": ["local", "--moto-port", "0", "--no-runtime"],
    "bench": ["bench", "engine", "--repeats", "1"],
}
AWS_COMMANDS = {
    "submit": ["submit", "decisions.jsonl"],
    "work": ["work"],
    "check-fanout": ["check-fanout"],
    "runtime": ["runtime", "--aws"],  # without --aws it refuses real AWS before credentials
    "transform": ["transform", "s3://b/in/", "s3://b/out/", "--aws", "--model-name", "m"],
    "deploy": [
        *("deploy", "--model", "s3://b/models/m.tar.gz", "--stack", "s", "--bucket", "b"),
        *("--image", IMAGE, "--subnets", "subnet-1", "--security-groups", "sg-1"),
    ],
}
# The adapter is read by what scores; `arbiter prompt` shows text, which no adapter changes.
ADAPTER_COMMANDS = {k: v for k, v in ENGINE_COMMANDS.items() if k not in ("prompt", "bench")}


def _cases() -> list[object]:
    cases = []
    for failure, env, commands, named in (
        ("missing model", MISSING_MODEL, ENGINE_COMMANDS, "/nonexistent/model.gguf"),
        ("missing adapter", MISSING_ADAPTER, ADAPTER_COMMANDS, "/nonexistent/adapter.gguf"),
        ("bad profile", BAD_PROFILE, ENGINE_COMMANDS, "bad-profile.toml"),
        ("no credentials", {}, AWS_COMMANDS, "AWS_ACCESS_KEY_ID"),
    ):
        for name, argv in commands.items():
            cases.append(pytest.param(argv, env, named, id=f"{name}, {failure}"))
    return cases


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("refusals")
    lines = (EXAMPLES / "decisions.jsonl").read_text().splitlines()[:1]
    (work / "decisions.jsonl").write_text("\n".join(lines) + "\n")
    labeled = (EXAMPLES / "labeled.jsonl").read_text().splitlines()[:2]
    (work / "labeled.jsonl").write_text("\n".join(labeled) + "\n")
    (work / "bad-profile.toml").write_text('name = "no format, no layout"\n')
    return work


def _environment(extra: dict[str, str], home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARBITER_", "SM_", "AWS_"))}
    env.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=str(home / "no-credentials"),
        AWS_CONFIG_FILE=str(home / "no-config"),
        AWS_DEFAULT_REGION="us-east-1",
        ARBITER_METRICS_PORT="0",  # `arbiter work` serves no metrics port here
    )
    env.update(extra)
    return env


@pytest.mark.parametrize(("argv", "env", "named"), _cases())
def test_a_refusal_is_one_line_and_status_2(
    argv: list[str], env: dict[str, str], named: str, workdir: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "arbiter", *argv],
        cwd=workdir,
        env=_environment(env, workdir),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert (done.returncode, len(lines)) == (2, 1), done.stderr[-3000:]
    assert lines[0].startswith(f"arbiter {argv[0]}: "), lines
    assert named in lines[0], lines
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is not a refusal leaves main as it was raised, not summarised into a line."""
    from arbiter import cli

    parser = cli.build_parser("decide")
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub.choices["decide"].set_defaults(func=lambda args: 1 / 0)
    monkeypatch.setattr(cli, "build_parser", lambda command=None: parser)
    with pytest.raises(ZeroDivisionError):
        cli.main(["decide", "decisions.jsonl"])
