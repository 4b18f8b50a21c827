"""`arbiter package-model`: a GGUF and its checksum manifest in the ``model.tar.gz`` SageMaker unpacks.

The archive holds its members at its root, the manifest first (so a reader can check it without
decompressing the weights)::

    model-manifest.json   {"gguf": {"file", "bytes", "sha256", "source", "revision"},
                           "profile": {"file", "bytes", "sha256"},          (--profile)
                           "lora": [{"file", "bytes", "sha256", "scale"}],  (--lora)
                           "tool": {"name", "version"}, "created"}
    <profile>.toml        a prompt profile (optional)
    <adapter>.gguf        LoRA adapters, applied at their scales (optional)
    <name>.gguf

SageMaker unpacks ``ModelDataUrl`` into ``/opt/ml/model``; :func:`arbiter.models.resolve_model`
finds the GGUF there, reads the manifest beside it, and the engine refuses to start when the file's
sha256 differs. The manifest's name and the hashing are the core's (``arbiter.models``); writing the
archive is a deployment step, so it lives here with ``arbiter deploy``, which reads it back.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from arbiter.errors import ModelLoadError
from arbiter.gguf_info import read_header
from arbiter.lora import check_adapter
from arbiter.models import MANIFEST_NAME, sha256_file
from arbiter.profiles import parse_profile
from infra import package_check

GGUF_MAGIC = b"GGUF"
TOOL_NAME = "arbiter package-model"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_BLOCK = 8 * 1024 * 1024
# Quantized weights barely compress (a few percent); level 1 costs a fraction of level 9's time.
GZIP_LEVEL = 1


class PackageError(Exception):
    """The archive was not written (checksum mismatch, existing output, unreadable input)."""


@dataclass(frozen=True)
class Package:
    archive: Path
    sha256: str  # of the archive itself
    bytes: int
    manifest: dict[str, Any]
    read_check: str = ""  # what the read check measured, one line


class _HashingWriter(io.RawIOBase):
    """Counts and hashes what is written through it (the archive, on its way to disk)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.raw.write(view)
        self.digest.update(view)
        self.size += len(view)
        return len(view)


class _HashingReader(io.RawIOBase):
    """Hashes the GGUF a second time while tar copies it, to catch a file changed mid-packaging."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.raw.readinto(buffer)  # type: ignore[attr-defined]
        if n:
            self.digest.update(memoryview(buffer)[:n])
        return n or 0


def tool_version() -> str:
    try:
        return metadata.version("arbiter")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


def _entry(path: Path) -> dict[str, Any]:
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def check_attachments(gguf: Path, profile: Path | None, loras: list[tuple[Path, float]]) -> None:
    """A profile that parses, adapters that fit the GGUF, and names that do not collide."""
    names = [MANIFEST_NAME, gguf.name]
    try:
        if profile is not None:
            parse_profile(profile.read_bytes(), str(profile))
            names.append(profile.name)
        if loras:
            header = read_header(gguf)
            for adapter, _ in loras:
                check_adapter(adapter, header, gguf.name)
                names.append(adapter.name)
    except OSError as exc:
        raise PackageError(f"cannot read {exc.filename}: {exc.strerror or exc}") from exc
    except (ModelLoadError, ValueError) as exc:
        raise PackageError(str(exc).removeprefix("refusing to start: ")) from exc
    if len(set(names)) != len(names):
        raise PackageError(f"two members of the archive would have one name: {names}")


def build_manifest(
    gguf: Path,
    sha256: str,
    size: int,
    source: str | None,
    revision: str | None,
    profile: Path | None = None,
    loras: list[tuple[Path, float]] | None = None,
) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if profile is not None:
        extras["profile"] = _entry(profile)
    if loras:
        extras["lora"] = [{**_entry(path), "scale": scale} for path, scale in loras]
    return {
        "gguf": {
            "file": gguf.name,
            "bytes": size,
            "sha256": sha256,
            "source": source,
            "revision": revision,
        },
        **extras,
        "tool": {"name": TOOL_NAME, "version": tool_version()},
        "created": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
    }


def _check_inputs(
    gguf: Path, out: Path, expected_sha256: str | None, source: str | None, revision: str | None
) -> None:
    if out.exists() or out.is_symlink():
        raise PackageError(f"{out} already exists; refusing to overwrite it (remove it first)")
    if not out.parent.is_dir():
        raise PackageError(f"{out.parent} is not a directory")
    if not out.name.endswith(".tar.gz"):
        raise PackageError(f"{out}: the archive name must end in .tar.gz (SageMaker gunzips it)")
    if not gguf.is_file():
        raise PackageError(f"{gguf} does not exist or is not a file")
    if gguf.suffix != ".gguf":
        raise PackageError(f"{gguf}: the model file name must end in .gguf")
    with gguf.open("rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise PackageError(f"{gguf} is not a GGUF file (its first bytes are not 'GGUF')")
    if expected_sha256 is not None and not _HEX64.match(expected_sha256):
        raise PackageError("--expected-sha256 must be 64 hexadecimal characters")
    if (source is None) != (revision is None):
        raise PackageError("--source and --revision go together: give both or neither")


def _tar_info(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = int(mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def package_model(
    gguf: Path,
    out: Path,
    *,
    expected_sha256: str | None = None,
    source: str | None = None,
    revision: str | None = None,
    profile: Path | None = None,
    loras: list[tuple[Path, float]] | None = None,
    read_check: str = "refuse",
) -> Package:
    """Write ``out`` (a new ``.tar.gz``) holding the manifest and ``gguf``, and a prompt profile
    and LoRA adapters when given (each checked: the profile parses, the adapters fit the GGUF),
    once the engine's read check passes on them as they will be served (``read_check``: refuse,
    warn or off; ``infra.package_check``).

    Raises :class:`PackageError`, leaving nothing at ``out``, when the GGUF's sha256 is not
    ``expected_sha256``, when ``out`` exists, or when the GGUF changes while it is being packaged.
    The archive is written beside ``out`` under a temporary name and linked into place, so a reader
    never sees a partial archive and a concurrent writer of the same name loses instead of clobbering.
    """
    gguf, out = Path(gguf), Path(out)
    _check_inputs(gguf, out, expected_sha256, source, revision)
    loras = [(Path(path), scale) for path, scale in loras or []]
    profile = Path(profile) if profile is not None else None
    check_attachments(gguf, profile, loras)
    try:
        checked = package_check.check_files(gguf, profile, loras, read_check)
    except ModelLoadError as exc:
        raise PackageError(f"{exc.message}; nothing was written") from exc
    size = gguf.stat().st_size
    sha256 = sha256_file(gguf)
    if expected_sha256 is not None and sha256 != expected_sha256.lower():
        raise PackageError(
            f"checksum mismatch: {gguf} has sha256 {sha256}, expected {expected_sha256.lower()}. "
            "Nothing was written; the download is corrupt or not the model you meant."
        )
    manifest = build_manifest(gguf, sha256, size, source, revision, profile, loras)
    manifest_bytes = (json.dumps(manifest, indent=2) + "\n").encode()
    now = datetime.now(UTC).timestamp()

    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        with partial.open("xb") as raw:
            sink = _HashingWriter(raw)
            with tarfile.open(
                fileobj=sink, mode="w:gz", compresslevel=GZIP_LEVEL, format=tarfile.PAX_FORMAT
            ) as tar:
                tar.addfile(
                    _tar_info(MANIFEST_NAME, len(manifest_bytes), now), io.BytesIO(manifest_bytes)
                )
                for extra in [*([profile] if profile else []), *(p for p, _ in loras)]:
                    # Hashed above; a file changed since is caught by the engine's check.
                    with extra.open("rb") as handle:
                        tar.addfile(_tar_info(extra.name, extra.stat().st_size, now), handle)
                with gguf.open("rb") as handle:
                    reader = _HashingReader(handle)
                    tar.addfile(_tar_info(gguf.name, size, now), io.BufferedReader(reader, _BLOCK))
            raw.flush()
            os.fsync(raw.fileno())
        if reader.digest.hexdigest() != sha256 or gguf.stat().st_size != size:
            raise PackageError(f"{gguf} changed while it was being packaged; nothing was written")
        try:
            os.link(partial, out)  # fails if `out` appeared meanwhile: never overwrite
        except FileExistsError as exc:
            raise PackageError(f"{out} already exists; refusing to overwrite it") from exc
    finally:
        partial.unlink(missing_ok=True)
    return Package(
        archive=out,
        sha256=sink.digest.hexdigest(),
        bytes=sink.size,
        manifest=manifest,
        read_check=package_check.describe(checked),
    )


def read_archive_manifest(archive: Path) -> dict[str, Any]:
    """The manifest of a packaged archive, read from its first member (no full decompression)."""
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            first = tar.next()
            if first is None or first.name != MANIFEST_NAME or not first.isfile():
                raise PackageError(
                    f"{archive}: the first member is not {MANIFEST_NAME}; package the model with "
                    "`arbiter package-model`"
                )
            handle = tar.extractfile(first)
            assert handle is not None
            data = json.loads(handle.read())
    except (OSError, tarfile.TarError, ValueError) as exc:
        raise PackageError(f"{archive} is not a readable model archive: {exc}") from exc
    gguf = data.get("gguf") if isinstance(data, dict) else None
    if not isinstance(gguf, dict) or not _HEX64.match(str(gguf.get("sha256", ""))):
        raise PackageError(f"{archive}: {MANIFEST_NAME} has no valid gguf.sha256")
    return dict(data)
