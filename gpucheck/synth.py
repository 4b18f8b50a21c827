"""A GGUF of the real model's shapes and types, with seeded random weights, from its skeleton.

Two steps, both llama.cpp's own code: gguf-py writes an F16 GGUF (F32 for the 1-D norm weights, as
llama.cpp's converter does) with the skeleton's metadata and, for each tensor of its table, seeded
normal weights scaled by 1/sqrt(fan-in) (norm weights near 1); ``llama_model_quantize`` then turns
it into the skeleton's file type (Q4_K_M for the default model), with the token-embedding and
output types the real file has. The result is checked tensor by tensor against the table: same
names, shapes and types, or the model is refused.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpucheck import skeleton as skel

F16_FILE_TYPE = 1  # LLAMA_FTYPE_MOSTLY_F16: "except 1d tensors"


def _random_f16(reader: Any, out: Path, seed: int) -> list[list[Any]]:
    from gguf import GGUFWriter

    table = skel.read_table(reader)
    writer = GGUFWriter(out, skel.architecture(reader))
    skel.copy_metadata(
        reader,
        writer,
        skip={skel.TABLE_KEY, skel.SOURCE_KEY, "general.file_type", "general.quantization_version"},
    )
    writer.add_file_type(F16_FILE_TYPE)
    rng = np.random.default_rng(seed)
    for name, shape, _ in table:
        dims = tuple(reversed(shape))  # numpy's row-major order: ne0 is the last axis
        if len(shape) == 1:
            data = (1.0 + 0.05 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
        else:
            scale = np.float32(1.0 / np.sqrt(shape[0]))
            data = (rng.standard_normal(dims, dtype=np.float32) * scale).astype(np.float16)
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return table


def _quantize(src: Path, dst: Path, file_type: int, table: list[list[Any]], threads: int) -> None:
    import llama_cpp
    from gguf import GGMLQuantizationType

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = file_type
    types = {name: kind for name, _, kind in table}
    if "token_embd.weight" in types:
        params.token_embedding_type = int(GGMLQuantizationType[types["token_embd.weight"]])
    if "output.weight" in types:
        params.output_tensor_type = int(GGMLQuantizationType[types["output.weight"]])
    status = llama_cpp.llama_model_quantize(
        str(src).encode(), str(dst).encode(), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed with status {status}")


def compare(model: Path, table: list[list[Any]]) -> list[str]:
    """Differences between ``model``'s tensors and the skeleton's table (empty: the same)."""
    from gguf import GGUFReader

    made = skel.tensor_table(GGUFReader(model))
    want = {name: (shape, kind) for name, shape, kind in table}
    got = {name: (shape, kind) for name, shape, kind in made}
    problems = [f"missing {n}" for n in want if n not in got]
    problems += [f"extra {n}" for n in got if n not in want]
    problems += [
        f"{n}: {got[n][0]} {got[n][1]}, the real model has {want[n][0]} {want[n][1]}"
        for n in want
        if n in got and got[n] != want[n]
    ]
    return problems


def synthesize(skeleton: Path, out: Path, *, seed: int, threads: int) -> dict[str, Any]:
    """Write ``out`` from ``skeleton``; returns sizes, seconds and the type census."""
    times: dict[str, float] = {}
    f16 = out.with_suffix(".f16.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    with skel.opened(skeleton) as reader:
        file_type = int(reader.fields["general.file_type"].parts[-1][0])
        started = time.perf_counter()
        table = _random_f16(reader, f16, seed)
        times["write_f16_s"] = time.perf_counter() - started
    try:
        started = time.perf_counter()
        _quantize(f16, out, file_type, table, threads)
        times["quantize_s"] = time.perf_counter() - started
        f16_bytes = f16.stat().st_size
    finally:
        f16.unlink(missing_ok=True)
    problems = compare(out, table)
    if problems:
        out.unlink(missing_ok=True)
        raise RuntimeError("the generated model differs from the real one: " + "; ".join(problems))
    census: dict[str, int] = {}
    for _, _, kind in table:
        census[kind] = census.get(kind, 0) + 1
    return {
        "model": str(out),
        "bytes": out.stat().st_size,
        "f16_bytes": f16_bytes,
        "seed": seed,
        "file_type": file_type,
        "tensors": len(table),
        "types": census,
        "matches_real_tensor_table": True,
        **{k: round(v, 2) for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpucheck.synth", description=__doc__)
    parser.add_argument("skeleton", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=270)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    print(json.dumps(synthesize(args.skeleton, args.out, seed=args.seed, threads=args.threads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
