"""llama.cpp's dynamically loadable backends, for builds made with ``GGML_BACKEND_DL=ON``.

The container images build llama-cpp-python with ``GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON``: the
CPU backend is compiled once per x86 feature level (sse42, haswell, skylakex, icelake, ...) as a
separate ``libggml-cpu-*.so`` and the best one for the CPU it runs on is picked at load time. Such a
build has *no* backend until ``ggml_backend_load_all*`` is called, and llama-cpp-python does not call
it (abetlen/llama-cpp-python#2069): model loading fails with "no backends are loaded". Every process
that loads a model calls :func:`load_backends` once first (the engine's backend initialisation; the
entrypoint before its GPU check). On a build with the backends linked in (the development venv) it
does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

_loaded: int | None = None


def _candidate_dirs(llama_dir: Path) -> list[Path]:
    # llama-cpp-python installs its libraries in llama_cpp/lib; MODULE targets (the backends) have
    # landed in the wheel's bin/ in some versions.
    return [llama_dir / "lib", llama_dir.parent / "bin", Path(sys.prefix) / "bin"]


def load_backends(search: list[Path] | None = None) -> int:
    """Register the dynamically loadable backends if none is registered; returns how many are."""
    global _loaded
    if _loaded:
        return _loaded
    import llama_cpp  # loads libllama and, with it, libggml

    llama_dir = Path(llama_cpp.__file__).parent
    libs = sorted((llama_dir / "lib").glob("libggml.so*")) or sorted(
        llama_dir.glob("**/libggml.so*")
    )
    if not libs:
        return 0
    ggml = ctypes.CDLL(str(libs[0]))  # the same handle libllama uses (same soname)
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    count = int(ggml.ggml_backend_reg_count())
    if count == 0:
        ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        ggml.ggml_backend_load_all_from_path.restype = None
        for directory in search or _candidate_dirs(llama_dir):
            if any(directory.glob("libggml-cpu*.so")):
                ggml.ggml_backend_load_all_from_path(str(directory).encode())
                break
        count = int(ggml.ggml_backend_reg_count())
    _loaded = count
    return count


if __name__ == "__main__":  # the image build checks that a backend loads
    n = load_backends()
    print(f"ggml backends registered: {n}")
    raise SystemExit(0 if n else 1)
