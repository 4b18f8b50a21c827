"""llama.cpp's own C++ server, built here from the source the installed llama-cpp-python vendors.

`arbiter bench peers` sets Arbiter against the server of the stock llama.cpp image on the same
tokens. Both must run the same kernels, so the server is built from llama-cpp-python's sdist (the
one the GPU check trims, :func:`arbiter.llama_build.sdist_path`) with the CMake flags the wheel was
built with (:func:`arbiter.llama_build.cmake_args`). The binary is cached under
``~/.cache/arbiter/llama-server/<key>/``, the key being a hash of the version and the flags, like the
wheel: the first build takes about 20 minutes on 2 cores, later runs none.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from arbiter import llama_build

CACHE = llama_build.CACHE / "llama-server"
# Everything the server does not need is off: no curl (models never download), no TLS, no tests.
SERVER_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)


def cache_dir(args: list[str]) -> Path:
    key = hashlib.sha256(
        " ".join([llama_build.LLAMA_CPP_PYTHON_VERSION, *args]).encode()
    ).hexdigest()[:12]
    return CACHE / key


def _extract(sdist: Path, into: Path) -> Path:
    """Unpack the sdist's vendored llama.cpp into ``into``; its root."""
    prefix = sdist.name.removesuffix(".tar.gz") + f"/{llama_build.VENDORED_LLAMA_CPP}/"
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(into, members=members, filter="data")
    return into / prefix.rstrip("/")


def built() -> Path | None:
    """The cached ``llama-server`` binary, or None when it has not been built here yet."""
    binary = cache_dir(llama_build.cmake_args()) / "llama-server"
    return binary if binary.is_file() else None


def ensure_built(log: Path | None = None) -> Path:
    """The ``llama-server`` binary, building it first when the cache has none."""
    args = llama_build.cmake_args()  # the flags the wheel was built with on this machine
    root = cache_dir(args)
    binary = root / "llama-server"
    if binary.is_file():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    work = root / "src"
    shutil.rmtree(work, ignore_errors=True)
    started = time.monotonic()
    tree = _extract(llama_build.sdist_path(), work)
    build = tree / "build"
    jobs = str(os.cpu_count() or 2)
    out = open(log, "a") if log else None  # noqa: SIM115 - closed below
    try:
        subprocess.run(
            ["cmake", "-S", str(tree), "-B", str(build), *SERVER_ARGS, *args],
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
    finally:
        if out:
            out.close()
    shutil.copy2(build / "bin" / "llama-server", binary)
    (root / "build.txt").write_text(
        f"llama-cpp-python {llama_build.LLAMA_CPP_PYTHON_VERSION}\nflags {' '.join(args)}\n"
        f"built in {time.monotonic() - started:.0f} s\n"
    )
    shutil.rmtree(work, ignore_errors=True)
    return binary
