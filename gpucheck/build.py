"""Build the trimmed llama.cpp tree into an importable ``llama_cpp`` package, for the CPU or CUDA.

The result is a folder holding ``llama_cpp/`` (llama-cpp-python's bindings, unchanged) with the
shared libraries in ``llama_cpp/lib``, where the bindings look for them: put the folder on
``PYTHONPATH`` and the engine runs on it. CMake builds only the ``llama`` target and what it links
(ggml, its CPU backend and, with CUDA, its CUDA backend); common, tools and mtmd are off.

CUDA needs cuBLAS. The device image has it as NVIDIA's PyPI wheel (``nvidia-cublas``, inside
site-packages) rather than in the toolkit's folder, where CMake's FindCUDAToolkit looks: when the
toolkit has none, the wheel's library and headers are handed to CMake explicitly and its folder is
added to the libraries' RPATH, so nothing has to set LD_LIBRARY_PATH later.
"""

from __future__ import annotations

import glob
import os
import shutil
import site
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from arbiter import llama_build
from gpucheck import plan

COMMON_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
)


@dataclass
class CudaLibs:
    """Where cuBLAS and the driver library are, when CMake would not find them by itself."""

    nvcc: str
    toolkit_libs: list[str] = field(default_factory=list)  # the toolkit's own (libcudart)
    cublas: str | None = None  # libcublas.so.N outside the toolkit (a wheel), else None
    cublas_lt: str | None = None
    include: str | None = None
    driver: str | None = None  # libcuda outside the toolkit's stubs, else None
    no_vmm: bool = False  # no libcuda to link at all: ggml's VMM pool is compiled out
    notes: list[str] = field(default_factory=list)

    def cmake_args(self) -> list[str]:
        args = [f"-DCMAKE_CUDA_COMPILER={self.nvcc}"]
        if self.cublas and self.cublas_lt and self.include:
            args += [
                f"-DCUDA_cublas_LIBRARY={self.cublas}",
                f"-DCUDA_cublasLt_LIBRARY={self.cublas_lt}",
                f"-DCMAKE_CUDA_FLAGS=-I{self.include}",
                f"-DCMAKE_CXX_FLAGS=-I{self.include}",
            ]
        if self.driver:
            args.append(f"-DCUDA_cuda_driver_LIBRARY={self.driver}")
        if self.no_vmm:
            args.append("-DGGML_CUDA_NO_VMM=ON")
        return args

    def rpath(self) -> list[str]:
        """Folders the CUDA backend loads from at run time, written into the libraries' RPATH
        (the device's ld.so cache may know neither the wheel's folder nor the toolkit's)."""
        found = [os.path.dirname(p) for p in (self.cublas, self.driver) if p]
        return list(dict.fromkeys([*found, *self.toolkit_libs]))


def _first(patterns: list[str]) -> str | None:
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def find_cuda() -> CudaLibs:
    """nvcc, and cuBLAS and libcuda where the toolkit folder lacks them; raises if no nvcc."""
    nvcc = shutil.which("nvcc") or _first(
        ["/usr/local/cuda/bin/nvcc", "/usr/local/cuda-*/bin/nvcc"]
    )
    if nvcc is None:
        raise RuntimeError("no nvcc: the CUDA toolkit's compiler is needed for a CUDA build")
    toolkit = Path(nvcc).resolve().parent.parent
    libdirs = [toolkit / "lib64", *toolkit.glob("targets/*/lib")]
    libs = CudaLibs(nvcc=nvcc, toolkit_libs=[str(d) for d in libdirs if d.is_dir()])
    if not any((d / "libcublas.so").exists() for d in libdirs):
        roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
        for root in dict.fromkeys(r for r in roots if r and os.path.isdir(r)):
            cublas = _first(
                [f"{root}/nvidia/*/lib/libcublas.so.*", f"{root}/nvidia/lib/libcublas.so.*"]
            )
            if cublas is None:
                continue
            libdir = os.path.dirname(cublas)
            libs.cublas = cublas
            libs.cublas_lt = _first([f"{libdir}/libcublasLt.so.*"])
            header = _first([f"{libdir}/../include/cublas_v2.h"])
            libs.include = os.path.dirname(os.path.realpath(header)) if header else None
            libs.notes.append(f"cuBLAS from a wheel: {libdir}")
            break
        if libs.cublas is None or libs.include is None or libs.cublas_lt is None:
            raise RuntimeError(
                f"no cuBLAS: none in {toolkit} and no nvidia-cublas wheel in site-packages"
            )
    stub_dirs = [d / "stubs" for d in libdirs]
    if not any((d / "libcuda.so").exists() for d in stub_dirs + libdirs):
        libs.driver = _first(
            [
                "/usr/local/nvidia/lib64/libcuda.so*",
                "/usr/lib/x86_64-linux-gnu/libcuda.so*",
                "/usr/lib64/libcuda.so*",
            ]
        )
        libs.no_vmm = libs.driver is None
        libs.notes.append(f"libcuda: {libs.driver or 'not found (GGML_CUDA_NO_VMM=ON)'}")
    return libs


def tool(name: str) -> str:
    """``cmake`` or ``ninja``: on PATH, beside this interpreter, or from its PyPI package (the
    device image has both as Python packages, whose scripts may not be on PATH)."""
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if found:
        return found
    try:
        module = __import__(name)
        folder = getattr(module, "CMAKE_BIN_DIR", None) or getattr(module, "BIN_DIR", None)
    except ImportError:
        folder = None
    if folder and os.path.exists(os.path.join(folder, name)):
        return os.path.join(folder, name)
    raise RuntimeError(f"no {name}: neither on PATH nor as a Python package")


def cpu_args() -> list[str]:
    """The project's CPU flags for this machine (no AMX, no -march; :mod:`arbiter.llama_build`),
    whatever ``CMAKE_ARGS`` says: the CUDA build adds its own."""
    return llama_build.cmake_args(environ={})


def configure_args(src: Path, build: Path, cuda: CudaLibs | None) -> list[str]:
    rpath = "$ORIGIN"
    args = [
        tool("cmake"),
        "-S",
        str(src / "vendor" / "llama.cpp"),
        "-B",
        str(build),
        "-G",
        "Ninja",
        f"-DCMAKE_MAKE_PROGRAM={tool('ninja')}",
        *COMMON_ARGS,
        *cpu_args(),
    ]
    if cuda is None:
        args.append("-DGGML_CUDA=OFF")
    else:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={plan.CUDA_ARCHITECTURES}"]
        args += cuda.cmake_args()
        rpath = ";".join([rpath, *cuda.rpath()])
    args.append(f"-DCMAKE_INSTALL_RPATH={rpath}")
    return args


def build(
    src: Path,
    build_dir: Path,
    prefix: Path,
    *,
    cuda: CudaLibs | None,
    jobs: int | None = None,
    log: Path | None = None,
    timeout: float | None = None,
) -> dict[str, float]:
    """Configure, build and lay out ``prefix/llama_cpp``; returns seconds per step. ``timeout``
    bounds the whole (a build past the device run's deadline would leave nothing reported)."""
    jobs = jobs or os.cpu_count() or 2
    times: dict[str, float] = {}
    out = log.open("a") if log else None
    try:
        begun = started = time.perf_counter()
        subprocess.run(
            configure_args(src, build_dir, cuda),
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
        times["configure_s"] = time.perf_counter() - started
        started = time.perf_counter()
        subprocess.run(
            [tool("cmake"), "--build", str(build_dir), "--target", "llama", "-j", str(jobs)],
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=None if timeout is None else max(1.0, timeout - (started - begun)),
        )
        times["build_s"] = time.perf_counter() - started
    finally:
        if out:
            out.close()
    install(src, build_dir, prefix)
    return times


def install(src: Path, build_dir: Path, prefix: Path) -> None:
    """Copy the bindings and the built libraries (symlinks kept) into ``prefix/llama_cpp``."""
    package = prefix / "llama_cpp"
    if package.exists():
        shutil.rmtree(package)
    shutil.copytree(src / "llama_cpp", package)
    lib = package / "lib"
    lib.mkdir(exist_ok=True)
    libraries = sorted(build_dir.glob("bin/lib*.so*")) or sorted(build_dir.rglob("lib*.so*"))
    if not any(p.name.startswith("libllama.so") for p in libraries):
        raise RuntimeError(f"the build in {build_dir} made no libllama.so")
    for path in libraries:
        target = lib / path.name
        if path.is_symlink():
            target.symlink_to(os.readlink(path))
        else:
            shutil.copy2(path, target)
