"""LoRA adapters served on their base model: which (``ARBITER_LORA``, or the model's manifest),
at what scale, and whether each fits the model, checked before llama.cpp is given it.

``ARBITER_LORA`` takes llama-server's ``--lora-scaled`` form, ``path[:scale]`` separated by commas
(scale 1 when omitted); a relative path is in the model dir. llama.cpp applies an adapter at load
(``llama_adapter_lora_init``, then ``llama_set_adapters_lora`` with the scales); it refuses an
adapter for another base only with a log line, so the adapter's header is read here first
(``gguf_info``) and a mismatch (architecture, a tensor the model does not have, a shape that is not
the model's) stops start-up with one line that names the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from arbiter.errors import ModelLoadError
from arbiter.gguf_info import GGUFError, GGUFHeader, read_header
from arbiter.models import Attachment, ResolvedModel, sha256_file, verify_attachment

MAX_ADAPTERS = 8


class AdapterMismatch(ModelLoadError):
    code = "lora_adapter_mismatch"


@dataclass(frozen=True)
class Adapter:
    """An adapter to apply: its file, its scale, and its sha256 (pinned in every result)."""

    path: Path
    scale: float
    sha256: str
    bytes: int


def parse_lora(value: str, model_dir: Path) -> list[tuple[Path, float]]:
    """``a.gguf:0.5,b.gguf`` as (path, scale) pairs; ``ModelLoadError`` naming a bad entry."""
    entries: list[tuple[Path, float]] = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        path_text, scale = item, 1.0
        head, sep, tail = item.rpartition(":")
        if sep:
            try:
                scale = float(tail)
            except ValueError:
                pass  # a ":" that is part of the path
            else:
                path_text = head
        if not math.isfinite(scale):
            raise ModelLoadError(f"ARBITER_LORA: {item!r} has a scale that is not a number")
        path = Path(path_text)
        entries.append((path if path.is_absolute() else model_dir / path, scale))
    if len(entries) > MAX_ADAPTERS:
        raise ModelLoadError(f"ARBITER_LORA names {len(entries)} adapters; at most {MAX_ADAPTERS}")
    return entries


def check_adapter(adapter: Path, model: GGUFHeader, model_name: str) -> None:
    """Refuse (``AdapterMismatch``, one line) an adapter whose base is not this model."""
    where = f"refusing to start: the LoRA adapter {adapter.name} does not fit {model_name}"
    try:
        header = read_header(adapter)
    except (GGUFError, OSError) as exc:
        raise AdapterMismatch(f"{where}: it is not a readable GGUF ({exc})") from None
    kind = header.strings.get("general.type", "")
    if kind != "adapter" or header.strings.get("adapter.type") != "lora":
        raise AdapterMismatch(
            f"{where}: it is not a LoRA adapter (general.type {kind!r}, adapter.type "
            f"{header.strings.get('adapter.type')!r}; llama.cpp's convert_lora_to_gguf.py writes one)"
        )
    arch, model_arch = (
        header.strings.get("general.architecture"),
        model.strings.get("general.architecture"),
    )
    if arch != model_arch:
        raise AdapterMismatch(
            f"{where}: it is for architecture {arch!r}, the model is {model_arch!r}"
        )
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in header.tensors.items():
        for part in ("a", "b"):
            if name.endswith(f".lora_{part}"):
                pairs.setdefault(name.removesuffix(f".lora_{part}"), {})[part] = shape
                break
        else:
            if not name.endswith("_norm.weight"):  # llama.cpp ignores norm vectors
                raise AdapterMismatch(f"{where}: tensor {name!r} is neither a lora_a nor a lora_b")
    if not pairs:
        raise AdapterMismatch(f"{where}: it has no LoRA tensors")
    for base, parts in sorted(pairs.items()):
        _check_pair(where, base, parts, model.tensors.get(base))


def _check_pair(
    where: str, base: str, parts: dict[str, tuple[int, ...]], target: tuple[int, ...] | None
) -> None:
    if "a" not in parts or "b" not in parts:
        raise AdapterMismatch(f"{where}: {base!r} has lora_a or lora_b but not both")
    if target is None:
        raise AdapterMismatch(f"{where}: the model has no tensor {base!r} (another base model?)")
    a, b = parts["a"], parts["b"]
    if len(a) != 2 or len(b) != 2 or len(target) < 2:
        raise AdapterMismatch(f"{where}: {base!r}: lora_a and lora_b must be matrices")
    if base.endswith("token_embd.weight"):  # llama.cpp reads B un-transposed there
        fits = target[0] == b[1] and target[1] == a[1]
    else:
        fits = target[0] == a[0] and target[1] == b[1] and a[1] == b[0]
    if not fits:
        raise AdapterMismatch(
            f"{where}: {base!r} is {target[0]}x{target[1]} in the model, the adapter's lora_a "
            f"{a[0]}x{a[1]} and lora_b {b[0]}x{b[1]} do not fit it (an adapter for another base "
            "model?)"
        )


def weights_id(model_sha256: str, adapters: list[Adapter]) -> str:
    """What the prefix cache keys saved states by: the model, and each adapter with its scale (a
    state prefilled with an adapter is not the base model's)."""
    applied = ",".join(f"{a.sha256}:{a.scale!r}" for a in adapters if a.scale != 0)
    return f"{model_sha256}+lora[{applied}]" if applied else model_sha256


def resolve_adapters(
    setting: str | None, resolved: ResolvedModel, model_dir: Path
) -> list[Adapter]:
    """The adapters to serve: ``ARBITER_LORA``, else the manifest's (sha256 checked), each one
    checked against the model's tensors; [] when there are none."""
    if setting is not None and setting.strip():
        entries = [Attachment(path, "", scale) for path, scale in parse_lora(setting, model_dir)]
    else:
        entries = list(resolved.loras)
    if not entries:
        return []
    try:
        model = read_header(resolved.path)
    except (GGUFError, OSError) as exc:
        raise ModelLoadError(f"{resolved.path} is not a readable GGUF: {exc}") from None
    adapters = []
    for entry in entries:
        if not entry.path.is_file():
            raise ModelLoadError(f"refusing to start: the LoRA adapter {entry.path} does not exist")
        check_adapter(entry.path, model, resolved.path.name)
        sha256 = (
            verify_attachment(entry, "LoRA adapter") if entry.sha256 else sha256_file(entry.path)
        )
        adapters.append(Adapter(entry.path, entry.scale, sha256, entry.path.stat().st_size))
    return adapters
