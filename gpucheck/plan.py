"""The device machine's facts and the check's own budget: the numbers every other module reads.

Facts come from the device tool's notes (README, KINDS.md, H200.md): an H200 with 16 CPU cores,
CUDA 13.0, ``python3`` 3.12 holding torch, numpy, aiohttp, jinja2, pytest, hypothesis and NVIDIA's
CUDA wheels, but no pydantic, pydantic-settings or structlog; no network; at most 64 MiB of files
travel; one command runs at most 600 s and a task has 900 s of device time, start-up included.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu-carry"  # ignored through .gitignore; named in the call's carry list
CACHE = Path.home() / ".cache" / "arbiter" / "gpu-check"

# What travels: the working tree (tracked and untracked-not-ignored files) plus carried paths.
TRAVEL_LIMIT_BYTES = 64 * 2**20
TRAVEL_MARGIN_BYTES = 8 * 2**20  # room for the repository to grow before the call is made

# The device's Python (KINDS.md: 3.12.3). pydantic-core is compiled per CPython minor version, so
# wheels for the neighbours travel too and the install picks the one that matches.
DEVICE_PYTHON = (3, 12)
CORE_PYTHONS = ((3, 11), (3, 12), (3, 13))
MANYLINUX = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

# The engine's import closure beyond what the device image has (checked by the rehearsal, which
# runs the engine, its tests and the bench in an environment of only the image's packages and
# these). Versions are whatever this checkout's .venv resolved, so both sides run the same code.
CARRIED_WHEELS = (
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "python-dotenv",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "structlog",
    "diskcache",  # llama_cpp imports it (llama_cache.py)
)

# The device image's own packages that the check uses; the rehearsal installs these from PyPI into
# its device-like environment, and nothing else.
DEVICE_IMAGE_PACKAGES = (
    "numpy",
    "jinja2",
    "pyyaml",
    "tqdm",
    "pytest",
    "pytest-timeout",
    "hypothesis",
    "packaging",
)

# The call: one command, its limit, and what it carries. docs/gpu-check.md quotes these.
DEVICE_COMMAND = "PYTHONUNBUFFERED=1 scripts/gpu-check --device"
DEVICE_CARRY = (".gpu-carry",)
DEVICE_TIMEOUT_S = 540
# The pipeline's own deadline inside that call: later stages shrink or skip to end before it, so
# the results written so far always come back.
DEVICE_BUDGET_S = 480
CUDA_ARCHITECTURES = "90"  # H200 (sm_90); a single architecture keeps the build short
