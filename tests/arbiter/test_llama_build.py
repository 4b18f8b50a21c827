"""How llama.cpp is built here (arbiter/llama_build.py): the CPU flags the wheel, `arbiter bench
peers`' llama-server and the GPU check share, and the one command the Makefile runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

from arbiter import llama_build
from tests import ROOT

NATIVE_OFF = "-DGGML_NATIVE=OFF"
AVX2_MACHINE = frozenset({"fpu", "avx", "avx2", "fma", "f16c", "bmi2", "sse4_2"})


def test_native_is_off_on_x86_and_each_feature_the_cpu_has_is_named() -> None:
    args = llama_build.cmake_args(AVX2_MACHINE, "x86_64", environ={})
    assert args == [
        NATIVE_OFF,
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
    ]


def test_avx512_needs_all_four_of_its_parts_and_amx_is_never_turned_on() -> None:
    most = AVX2_MACHINE | {"avx512f", "avx512bw", "avx512dq", "amx_tile", "amx_int8"}
    assert not any("AVX512" in a or "AMX" in a for a in llama_build.cmake_args(most, "x86_64", {}))
    every = most | {"avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni"}
    args = llama_build.cmake_args(every, "x86_64", environ={})
    assert args[-4:] == [
        "-DGGML_AVX512=ON",
        "-DGGML_AVX512_VNNI=ON",
        "-DGGML_AVX512_BF16=ON",
        "-DGGML_AVX_VNNI=ON",
    ]
    assert "-DGGML_AVX512_VBMI=ON" not in args and not any("AMX" in a for a in args)


def test_other_machines_build_native_and_cmake_args_from_the_environment_win() -> None:
    assert llama_build.cmake_args(AVX2_MACHINE, "aarch64", environ={}) == ["-DGGML_NATIVE=ON"]
    given = {"CMAKE_ARGS": "-DGGML_CUDA=on  -DGGML_NATIVE=OFF"}
    assert llama_build.cmake_args(AVX2_MACHINE, "x86_64", given) == given["CMAKE_ARGS"].split()


def test_the_first_cpus_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2\n\nprocessor\t: 1\nflags\t\t: sse\n")
    assert llama_build.cpu_flags(cpuinfo) == {"fpu", "avx2"}
    assert llama_build.cpu_flags(tmp_path / "absent") == frozenset()


def test_the_script_the_makefile_runs_prints_the_same_flags_with_the_systems_python() -> None:
    """The Makefile keys the llama-cpp-python wheel's cache on this output, before any virtual
    environment exists (so ``python3``, not the project's interpreter)."""
    out = subprocess.run(
        [str(ROOT / "scripts" / "llama-cmake-args")],
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert out.stdout.split() == llama_build.cmake_args(environ={})
