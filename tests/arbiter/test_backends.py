"""ggml's backend registry as libllama sees it (arbiter/engine/backends.py), in fresh processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from arbiter.engine.backends import loaded_cpu_variant
from tests import ROOT

_PROBE = """
import json, re
def ggml_libs():
    return sorted(set(re.findall(r"/(libggml[^/\\s]*)", open("/proc/self/maps").read())))
import llama_cpp
before = ggml_libs()
from arbiter.engine.backends import load_backends
found = load_backends()
print(json.dumps({"before": before, "after": ggml_libs(), "count": found.count,
                  "variant": found.cpu_variant, "from": str(found.loaded_from)}))
"""


def probe() -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_load_backends_uses_the_libggml_that_libllama_is_linked_against():
    """pip installs libggml.so, .so.0 and .so.0.x as three copies; opening one by file name maps a
    second ggml whose registry libllama never reads (the CPU image then loaded no model)."""
    seen = probe()
    assert seen["after"] == seen["before"], "load_backends mapped another copy of a ggml library"
    assert "libggml.so.0" in seen["before"]
    assert isinstance(seen["count"], int) and seen["count"] >= 1
    # This venv's build has the CPU backend linked in: nothing is loaded, no variant is mapped.
    assert seen["variant"] is None and seen["from"] == "None"


def test_the_mapped_cpu_variant_is_read_from_the_process_maps(tmp_path: Path):
    maps = tmp_path / "maps"
    lib = "/opt/venv/lib/python3.11/site-packages/llama_cpp/lib"
    maps.write_text(
        f"7f00-7f01 r-xp 00000000 fd:00 1 {lib}/libggml-base.so.0\n"
        f"7f01-7f02 r-xp 00000000 fd:00 2 {lib}/libggml-cpu-zen4.so\n"
        f"7f02-7f03 r--p 00001000 fd:00 2 {lib}/libggml-cpu-zen4.so\n"
    )
    assert loaded_cpu_variant(maps) == "zen4"
    maps.write_text(f"7f00-7f01 r-xp 00000000 fd:00 1 {lib}/libggml-cpu.so.0\n")
    assert loaded_cpu_variant(maps) is None
    assert loaded_cpu_variant(tmp_path / "missing") is None
