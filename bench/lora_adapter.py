"""A LoRA adapter for a model's own tensors, written with llama.cpp's ``gguf`` package: small rank,
seeded values. The engine bench measures an adapter's cost with one (``--lora random``); the tests
use it to check what an adapter changes and what it must not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np

from arbiter.gguf_info import read_header

# The attention projections LoRA fine-tunes most often adapt, in llama.cpp's tensor names.
DEFAULT_TARGETS = ("attn_q", "attn_v")


def write_lora(
    model: Path,
    out: Path,
    *,
    rank: int = 4,
    alpha: float = 4.0,
    seed: int = 0,
    std: float = 0.05,
    targets: Sequence[str] = DEFAULT_TARGETS,
    shapes: dict[str, tuple[int, int]] | None = None,
    extra: dict[str, tuple[int, int]] | None = None,
    architecture: str | None = None,
) -> Path:
    """An adapter with ``lora_a``/``lora_b`` for each block's ``targets`` of ``model``.

    ``shapes`` (tensor name -> (in, out)) overrides the model's shapes, ``extra`` adds tensors the
    model may not have and ``architecture`` sets another architecture: how the tests write
    adapters for another base.
    """
    header = read_header(model)
    arch = architecture or header.strings["general.architecture"]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    names = sorted(
        name
        for name in header.tensors
        if name.startswith("blk.") and name.split(".")[2] in targets and name.endswith(".weight")
    )
    planned = {name: (shapes or {}).get(name, header.tensors[name][:2]) for name in names}
    for name, (n_in, n_out) in {**planned, **(extra or {})}.items():
        # ggml order is (ne0, ne1); numpy's is reversed: lora_a is ne (in, rank), lora_b (rank, out).
        writer.add_tensor(f"{name}.lora_a", rng.normal(0, std, (rank, n_in)).astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", rng.normal(0, std, (n_out, rank)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
