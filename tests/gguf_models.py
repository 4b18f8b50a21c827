"""GGUFs written for the tests with the ``gguf`` package: a bundled model's vocabulary (and weights,
when asked) under another family's chat template, and LoRA adapters for a model's tensors."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import gguf

TEMPLATES = Path(__file__).parent / "data" / "templates"
MORE_TEMPLATES = Path(__file__).parent / "data" / "more-templates"  # outside llama.cpp's 70
TEMPLATE_KEY = gguf.Keys.Tokenizer.CHAT_TEMPLATE


def template_text(name: str) -> str:
    """A chat template copied from llama.cpp's models/templates (tests/data/templates/README.md),
    or one of the few outside them (tests/data/more-templates/README.md)."""
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        path = MORE_TEMPLATES / f"{name}.jinja"
    return path.read_text(encoding="utf-8")


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

    def set_bool(self, key: str, value: bool) -> None:
        """Set (or replace) a boolean key, such as ``tokenizer.ggml.add_space_prefix``."""
        name = _string(key)
        self.kv = [kv for kv in self.kv if not kv.startswith(name)]
        self.kv.append(name + struct.pack("<I", int(gguf.GGUFValueType.BOOL)) + bytes([value]))

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


def sdist_vocabularies() -> dict[str, Path]:
    """llama.cpp's own test vocabularies (``models/ggml-vocab-*.gguf``: a GGUF each, no weights) in
    the llama-cpp-python sdist that `make setup` fetched (``arbiter.llama_build.sdist_path``),
    extracted once beside it; by name (``llama-spm``, ``phi-3``, ...)."""
    import os
    import tarfile
    import tempfile

    from arbiter import llama_build

    sdist = llama_build.sdist_path()
    target = sdist.parent / f"vocab-{llama_build.LLAMA_CPP_PYTHON_VERSION}"
    if not target.is_dir():
        prefix = sdist.name.removesuffix(".tar.gz") + f"/{llama_build.VENDORED_LLAMA_CPP}/models/"
        work = Path(tempfile.mkdtemp(dir=sdist.parent, prefix=".vocab-"))
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                name = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and "/" not in name and name.endswith(".gguf"):
                    source = tar.extractfile(member)
                    assert source is not None
                    (work / name).write_bytes(source.read())
        try:
            os.rename(work, target)  # whole, or not at all; another worker may have won
        except OSError:
            for path in work.iterdir():
                path.unlink()
            work.rmdir()
    return {p.stem.removeprefix("ggml-vocab-"): p for p in sorted(target.glob("ggml-vocab-*.gguf"))}


def random_weights(vocabulary: Path, target: Path, template: str | None, seed: int = 0) -> Path:
    """A tiny Llama-architecture model with seeded random weights over ``vocabulary``'s tokenizer
    (a vocabulary-only GGUF such as llama.cpp's ``ggml-vocab-llama-spm.gguf``), under ``template``:
    the engine's whole path (load, prefill, branches, readout) on a vocabulary no bundled model
    has. Its answers mean nothing; the read check is for real weights."""
    import numpy as np

    reader = gguf.GGUFReader(str(vocabulary))
    writer = gguf.GGUFWriter(str(target), "llama")
    for field in reader.fields.values():
        name = field.name
        if name.startswith(("GGUF.", "llama.", TEMPLATE_KEY)) or name in {
            gguf.Keys.General.ARCHITECTURE,
            gguf.Keys.General.FILE_TYPE,
        }:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    embd, ff, heads, layers = 64, 128, 4, 2
    writer.add_context_length(4096)
    writer.add_embedding_length(embd)
    writer.add_feed_forward_length(ff)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(embd // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)  # all F32
    if template is not None:
        writer.add_chat_template(template)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(
            np.float32
        )

    writer.add_tensor("token_embd.weight", weight(n_vocab, embd))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(embd, dtype=np.float32))
        for part in ("q", "k", "v", "output"):
            writer.add_tensor(f"blk.{i}.attn_{part}.weight", weight(embd, embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(ff, embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(ff, embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(embd, ff))
    writer.add_tensor("output_norm.weight", np.ones(embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight(n_vocab, embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
