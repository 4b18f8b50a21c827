"""A GGUF file's header read without llama.cpp: its string metadata and its tensors' names and
shapes, so an adapter can be checked against a model before llama.cpp is given either (llama.cpp
only logs why it refuses an adapter, and may abort on a file it cannot parse).

Only the header is read (values are skipped, never copied: a 262k-token vocabulary is walked in a
fraction of a second); tensor data is never touched.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
# Scalar value types of GGUF v2/v3 (8: string and 9: array are of variable size).
_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_SIZES = {kind: struct.calcsize(fmt) for kind, fmt in _FORMATS.items()}
# ``general.file_type``'s values (llama.cpp's ``llama_ftype``): the quantization a file reports.
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4",
}

_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands (the message says where)."""


@dataclass(frozen=True)
class GGUFHeader:
    strings: dict[str, str]  # the metadata keys whose values are strings
    floats: dict[str, float]  # and those whose values are numbers
    tensors: dict[str, tuple[int, ...]]  # name -> shape in ggml's order (ne[0] first)


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GGUFError(f"the header ends early (at byte {self.at})")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return int(value)

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.data):
            raise GGUFError(f"a string runs past the end of the file (at byte {self.at})")
        raw = self.data[self.at : self.at + n]
        self.at += n
        return raw.decode("utf-8", "replace")

    def skip_string(self) -> None:
        n = self.take("<Q")  # not `self.at += self.take(...)`: that reads `at` before the take
        self.at += n

    def value(self, kind: int) -> str | float | None:
        """Read a scalar or a string; skip an array. Returns what a check may use."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == _STRING:
                for _ in range(count):
                    self.skip_string()
            elif item in _SIZES:
                self.at += _SIZES[item] * count
                if self.at > len(self.data):
                    raise GGUFError("an array runs past the end of the file")
            else:
                raise GGUFError(f"an array of unknown type {item} (at byte {self.at})")
            return None
        if kind not in _FORMATS:
            raise GGUFError(f"a value of unknown type {kind} (at byte {self.at})")
        (number,) = struct.unpack_from(_FORMATS[kind], self.data, self.at)
        self.at += _SIZES[kind]
        return float(number)


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor shapes of ``path``; ``GGUFError`` when it is not a GGUF."""
    with path.open("rb") as handle:
        try:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file
            raise GGUFError("the file is empty") from exc
    try:
        if data[:4] != MAGIC:
            raise GGUFError("it does not start with 'GGUF'")
        cursor = _Cursor(data)
        cursor.at = 4
        version = cursor.take("<I")
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} (2 and 3 are read)")
        n_tensors, n_kv = cursor.take("<Q"), cursor.take("<Q")
        strings: dict[str, str] = {}
        floats: dict[str, float] = {}
        for _ in range(n_kv):
            key = cursor.string()
            value = cursor.value(cursor.take("<I"))
            if isinstance(value, str):
                strings[key] = value
            elif isinstance(value, float):
                floats[key] = value
        tensors: dict[str, tuple[int, ...]] = {}
        for _ in range(n_tensors):
            name = cursor.string()
            dims = cursor.take("<I")
            if dims > 8:
                raise GGUFError(f"tensor {name!r} has {dims} dimensions")
            tensors[name] = tuple(cursor.take("<Q") for _ in range(dims))
            cursor.take("<I")  # type
            cursor.take("<Q")  # offset
        return GGUFHeader(strings, floats, tensors)
    finally:
        data.close()


TOKENS_KEY = "tokenizer.ggml.tokens"


def token_texts(path: Path, ids: dict[str, int]) -> dict[str, str]:
    """The texts of a few tokens of the vocabulary (``name -> id`` in, ``name -> text`` out; an id
    outside the vocabulary is ""), read from the header without decoding the rest."""
    with path.open("rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cursor = _Cursor(data)
        cursor.at = 4 + 4 + 8  # magic, version, tensor count
        for _ in range(cursor.take("<Q")):
            key = cursor.string()
            kind = cursor.take("<I")
            if key != TOKENS_KEY or kind != _ARRAY:
                cursor.value(kind)
                continue
            item, count = cursor.take("<I"), cursor.take("<Q")
            if item != _STRING:
                raise GGUFError(f"{TOKENS_KEY} is not an array of strings")
            found = dict.fromkeys(ids, "")
            wanted = {token for token in ids.values() if 0 <= token < count}
            for index in range(max(wanted, default=-1) + 1):
                if index in wanted:
                    text = cursor.string()
                    found.update({name: text for name, token in ids.items() if token == index})
                else:
                    cursor.skip_string()
            return found
        return dict.fromkeys(ids, "")
    finally:
        data.close()
