"""A model's skeleton: its GGUF metadata (hyperparameters, tokenizer, chat template) and its tensor
table (name, shape, type), without a byte of weights.

The bundled Gemma 3 270M GGUF is 253 MB and cannot travel to the device machine (64 MiB in all);
its skeleton is about 2 MB compressed. :mod:`gpucheck.synth` turns a skeleton back into a GGUF of
the same shapes and types with seeded random weights: speed depends on shapes and types, not on
weight values, and the engine's agreement checks hold for any weights.

The skeleton is itself a GGUF file with no tensors (llama.cpp's vocab-only files are the same
idea), so every metadata value keeps its exact GGUF type; the tensor table is one extra string key,
JSON. Written xz-compressed. Uses llama.cpp's own gguf-py (in the trimmed source tree).
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TABLE_KEY = "arbiter.skeleton.tensors"
SOURCE_KEY = "arbiter.skeleton.source"


def _field_value(field: Any) -> tuple[Any, Any, Any]:
    """(value, GGUF type, array item type) of a reader field, strings kept as raw bytes."""
    from gguf import GGUFValueType

    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return [field.parts[i].tolist()[0] for i in field.data], main, sub
    if main == GGUFValueType.STRING:
        return bytes(field.parts[-1]), main, None
    return field.parts[-1].tolist()[0], main, None


def copy_metadata(reader: Any, writer: Any, skip: set[str]) -> None:
    """Every key of ``reader`` into ``writer`` with its own type, except GGUF.* and ``skip``."""
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in skip or name == "general.architecture":
            continue  # GGUFWriter writes general.architecture itself
        value, vtype, sub = _field_value(field)
        writer.add_key_value(name, value, vtype, sub)


def tensor_table(reader: Any) -> list[list[Any]]:
    """[name, shape (ggml order: ne0 first), type name] for each tensor, in file order."""
    return [[t.name, [int(x) for x in t.shape], t.tensor_type.name] for t in reader.tensors]


def architecture(reader: Any) -> str:
    return str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")


def write(real: Path, out: Path) -> dict[str, Any]:
    """The skeleton of ``real`` as ``out`` (.gguf.xz); returns what it holds."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(real)
    table = tensor_table(reader)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "skeleton.gguf"
        writer = GGUFWriter(plain, architecture(reader))
        copy_metadata(reader, writer, skip=set())
        writer.add_string(TABLE_KEY, json.dumps(table, separators=(",", ":")))
        writer.add_string(SOURCE_KEY, real.name)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        out.parent.mkdir(parents=True, exist_ok=True)
        with plain.open("rb") as src, lzma.open(out, "wb", preset=6) as dst:
            shutil.copyfileobj(src, dst)
        plain_bytes = plain.stat().st_size
    return {
        "source": real.name,
        "tensors": len(table),
        "metadata_keys": len([k for k in reader.fields if not k.startswith("GGUF.")]),
        "bytes": out.stat().st_size,
        "bytes_uncompressed": plain_bytes,
    }


@contextmanager
def opened(skeleton: Path) -> Iterator[Any]:
    """A GGUFReader over the decompressed skeleton (a temporary file)."""
    from gguf import GGUFReader

    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "skeleton.gguf"
        with lzma.open(skeleton, "rb") as src, plain.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        yield GGUFReader(plain)


def read_table(reader: Any) -> list[list[Any]]:
    table: list[list[Any]] = json.loads(bytes(reader.fields[TABLE_KEY].parts[-1]))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpucheck.skeleton", description=__doc__)
    parser.add_argument("real", type=Path, help="the real GGUF")
    parser.add_argument("out", type=Path, help="the skeleton to write (.gguf.xz)")
    args = parser.parse_args(argv)
    print(json.dumps(write(args.real, args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
