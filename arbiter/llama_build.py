"""How the engine's llama.cpp is built on this machine: the pinned llama-cpp-python release, its
sdist (the llama.cpp source it vendors) and this CPU's CMake flags.

Three builds read these facts and must agree: ``make setup``'s wheel (``scripts/llama-cmake-args``
prints the flags), ``arbiter bench peers``' llama-server (the same kernels as the wheel) and the GPU
check's trimmed tree. Standard library only: the GPU check imports this on the accelerator machine
before any wheel is installed, and the Makefile runs it before the virtual environment exists.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# llama-cpp-python as pyproject.toml and the Makefile pin it; its sdist vendors llama.cpp here.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
VENDORED_LLAMA_CPP = "vendor/llama.cpp"
CACHE = Path.home() / ".cache" / "arbiter"

# -march=native (GGML_NATIVE=ON) turns on ggml's AMX kernels on Intel CPUs that report AMX, and on
# the Firecracker VMs these machines run in those kernels crash (SIGSEGV in
# ggml_backend_amx_mul_mat on the first llama_decode). So: native off, and each x86 feature the CPU
# has switched on explicitly, in this order (the order is part of the wheel cache's key).
_X86_FEATURES = (
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"),
)
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
_AVX512_EXTRAS = (
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The feature flags of the first CPU ``cpuinfo`` lists (none where it cannot be read)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return frozenset()
    first = next((line for line in lines if line.startswith("flags")), "")
    return frozenset(first.partition(":")[2].split())


def cmake_args(
    flags: frozenset[str] | None = None,
    machine: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The CMake flags llama.cpp is built with here; ``CMAKE_ARGS`` in ``environ`` wins."""
    given = (os.environ if environ is None else environ).get("CMAKE_ARGS", "")
    if given:
        return given.split()
    if (machine or platform.machine()) != "x86_64":
        return ["-DGGML_NATIVE=ON"]
    has = cpu_flags() if flags is None else flags
    args = ["-DGGML_NATIVE=OFF"]
    args += [f"-D{name}=ON" for flag, name in _X86_FEATURES if flag in has]
    if all(flag in has for flag in _AVX512):
        args.append("-DGGML_AVX512=ON")
        args += [f"-D{name}=ON" for flag, name in _AVX512_EXTRAS if flag in has]
    if "avx_vnni" in has:
        args.append("-DGGML_AVX_VNNI=ON")
    return args


def sdist_path() -> Path:
    """llama-cpp-python's sdist, downloaded once into the cache (pip, from the package index)."""
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    target = CACHE / "sdist" / name
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"),
                *("--no-binary", ":all:", "--dest", str(target.parent)),
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            ],
            check=True,
        )
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m arbiter.llama_build cmake-args``: print the flags (scripts/llama-cmake-args)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["cmake-args"]:
        print("usage: python -m arbiter.llama_build cmake-args", file=sys.stderr)
        return 2
    print(" ".join(cmake_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
