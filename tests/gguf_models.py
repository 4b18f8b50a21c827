"""GGUFs written for the tests with the ``gguf`` package: a bundled model's vocabulary (and weights,
when asked) under another family's chat template, and LoRA adapters for a model's tensors."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import gguf

TEMPLATES = Path(__file__).parent / "data" / "templates"
TEMPLATE_KEY = gguf.Keys.Tokenizer.CHAT_TEMPLATE


def template_text(name: str) -> str:
    """A chat template copied from llama.cpp's models/templates (tests/data/templates/README.md)."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


class Vocabulary:
    """A model's metadata and vocabulary, read once, written under any chat template as a GGUF
    without tensors (for a vocabulary-only load: prompts rendered and tokenized, nothing run)."""

    def __init__(self, source: Path) -> None:
        # Each key-value pair's raw bytes, found by the header reader's cursor (which skips values
        # without decoding them): gguf.GGUFReader took 17 s for SmolLM2's on a loaded machine.
        from arbiter.gguf_info import _Cursor

        with source.open("rb") as handle:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            cursor = _Cursor(data)
            cursor.at = 4 + 4 + 8  # magic, version, tensor count
            n_kv = cursor.take("<Q")
            self.kv = []
            for _ in range(n_kv):
                start = cursor.at
                key = cursor.string()
                cursor.value(cursor.take("<I"))
                if not key.startswith(TEMPLATE_KEY):
                    self.kv.append(bytes(data[start : cursor.at]))
        finally:
            data.close()

    def write(self, target: Path, template: str | None) -> Path:
        kv = list(self.kv)
        if template is not None:
            value_type = struct.pack("<I", int(gguf.GGUFValueType.STRING))
            kv.append(_string(TEMPLATE_KEY) + value_type + _string(template))
        with target.open("wb") as handle:
            handle.write(gguf.GGUF_MAGIC.to_bytes(4, "little"))
            handle.write(struct.pack("<IQQ", 3, 0, len(kv)))  # version, no tensors, the keys
            handle.writelines(kv)
        return target


def with_template(source: Path, target: Path, template: str | None) -> Path:
    """``source`` (weights and all) rewritten with ``template`` as its chat template."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name.startswith(TEMPLATE_KEY):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    if template is not None:
        writer.add_chat_template(template)
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name,
            tensor.data.shape,
            tensor.data.dtype,
            tensor.data.nbytes,
            tensor.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return target
