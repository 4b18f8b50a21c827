"""`arbiter package-model`: the archive, its manifest, and the adapter's check of both."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from arbiter.cli import main as cli_main
from arbiter.errors import ManifestMismatch
from arbiter.models import MANIFEST_NAME, resolve_model, verify
from infra.package_model import PackageError, package_model, read_archive_manifest

OFF = "off"  # a fake GGUF cannot be loaded: the read check has its own tests (below)


def fake_gguf(path: Path, size: int = 200_000) -> Path:
    """GGUF magic and deterministic bytes: the packaging path never parses the weights."""
    body = hashlib.sha256(path.name.encode()).digest() * (size // 32 + 1)
    path.write_bytes(b"GGUF" + body[: size - 4])
    return path


def unpack(archive: Path, into: Path) -> list[str]:
    into.mkdir()
    with tarfile.open(archive, "r:gz") as tar:
        names = tar.getnames()
        tar.extractall(into, filter="data")
    return names


def test_archive_is_accepted_by_the_adapter(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    gguf = fake_gguf(tmp_path / "decider-q4.gguf")
    expected = hashlib.sha256(gguf.read_bytes()).hexdigest()
    out = tmp_path / "model.tar.gz"

    code = cli_main(
        [
            "package-model",
            "--gguf",
            str(gguf),
            "--expected-sha256",
            expected.upper(),
            "--source",
            "https://example.org/decider",
            "--revision",
            "v1",
            "--out",
            str(out),
            "--read-check",
            OFF,
        ]
    )
    assert code == 0
    stdout = capsys.readouterr().out
    archive_sha = hashlib.sha256(out.read_bytes()).hexdigest()
    assert stdout == f"{archive_sha}  {out}\n"  # sha256sum -c format

    model_dir = tmp_path / "opt-ml-model"
    assert unpack(out, model_dir) == [MANIFEST_NAME, "decider-q4.gguf"]
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    assert manifest["gguf"] == {
        "file": "decider-q4.gguf",
        "bytes": 200_000,
        "sha256": expected,
        "source": "https://example.org/decider",
        "revision": "v1",
    }
    assert manifest["tool"]["name"] == "arbiter package-model"
    assert manifest["tool"]["version"]
    assert manifest["created"].endswith("Z")
    assert read_archive_manifest(out) == manifest

    resolved = resolve_model(None, model_dir)
    assert resolved.source == "model_dir"
    assert resolved.path == model_dir / "decider-q4.gguf"
    assert resolved.expected_sha256 == expected
    assert verify(resolved) == expected


def test_tampered_model_is_refused(tmp_path: Path):
    gguf = fake_gguf(tmp_path / "m.gguf")
    out = package_model(gguf, tmp_path / "model.tar.gz", read_check=OFF).archive
    model_dir = tmp_path / "model"
    unpack(out, model_dir)
    data = bytearray((model_dir / "m.gguf").read_bytes())
    data[1000] ^= 0xFF  # same size, one byte flipped
    (model_dir / "m.gguf").write_bytes(bytes(data))
    with pytest.raises(ManifestMismatch, match="refusing to start"):
        verify(resolve_model(None, model_dir))


def test_tampered_archive_manifest_is_refused(tmp_path: Path):
    """An archive whose manifest was edited (another model's checksum) is refused at start-up."""
    gguf = fake_gguf(tmp_path / "m.gguf")
    good = package_model(gguf, tmp_path / "good.tar.gz", read_check=OFF).archive
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(good, "r:gz") as src, tarfile.open(bad, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == MANIFEST_NAME:
                manifest = json.loads(data)
                manifest["gguf"]["sha256"] = "ab" * 32
                data = json.dumps(manifest).encode()
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    model_dir = tmp_path / "model"
    unpack(bad, model_dir)
    with pytest.raises(ManifestMismatch, match="abab"):
        verify(resolve_model(None, model_dir))


def test_checksum_mismatch_stops_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    gguf = fake_gguf(tmp_path / "m.gguf")
    out = tmp_path / "model.tar.gz"
    argv = [
        "package-model", "--gguf", str(gguf), "--expected-sha256", "0" * 64,
        "--out", str(out), "--read-check", OFF,
    ]  # fmt: skip
    code = cli_main(argv)
    assert code == 2
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "0" * 64 in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no partial file left


def test_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    gguf = fake_gguf(tmp_path / "m.gguf")
    out = tmp_path / "model.tar.gz"
    out.write_bytes(b"precious")
    code = cli_main(["package-model", "--gguf", str(gguf), "--out", str(out), "--read-check", OFF])
    assert code == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expected_sha256": "xyz"}, "64 hexadecimal"),
        ({"source": "https://example.org/m"}, "go together"),
        ({"revision": "v1"}, "go together"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, str], message: str):
    gguf = fake_gguf(tmp_path / "m.gguf")
    with pytest.raises(PackageError, match=message):
        package_model(gguf, tmp_path / "model.tar.gz", read_check=OFF, **kwargs)  # type: ignore[arg-type]


def test_not_a_gguf_or_wrong_archive_name(tmp_path: Path):
    other = tmp_path / "notes.gguf"
    other.write_bytes(b"hello world")
    with pytest.raises(PackageError, match="not a GGUF"):
        package_model(other, tmp_path / "model.tar.gz", read_check=OFF)
    gguf = fake_gguf(tmp_path / "m.gguf")
    with pytest.raises(PackageError, match=r"\.tar\.gz"):
        package_model(gguf, tmp_path / "model.zip", read_check=OFF)


def test_archive_without_manifest_first_is_not_a_package(tmp_path: Path):
    gguf = fake_gguf(tmp_path / "m.gguf")
    plain = tmp_path / "plain.tar.gz"
    with tarfile.open(plain, "w:gz") as tar:
        tar.add(gguf, arcname="m.gguf")
    with pytest.raises(PackageError, match="first member"):
        read_archive_manifest(plain)
