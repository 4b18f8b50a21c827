"""glibc's allocator set for a long-running server: large buffers go back to the system when freed.

By default glibc raises its mmap threshold to the size of the largest block freed so far (up to 32
MiB): after the first 5 MB request body or 2.7 MB prefix state is freed, every later buffer of that
size comes from a heap arena and stays in the process when it is freed, and each thread may get an
arena of its own. Under the soak (``bench/soak.py``: 5 MB hostile bodies, JSON Lines, chat, a prefix
cache that churns) RSS kept climbing 175 MB over the 1,000 requests after the cache was full. With a
fixed 1 MiB threshold (a buffer from 1 MiB up is a mapping of its own, unmapped when freed) and two
arenas it stayed within a few MB of flat over the same soak.

``tune`` is called once by `arbiter serve` at start-up, before its threads exist. The environment
wins: ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_ARENA_MAX``, read by glibc when the process starts, are
left alone. Anywhere but glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 1 << 20
ARENA_MAX = 2
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_M_ARENA_MAX = -8


def tune() -> dict[str, int]:
    """Set what the environment does not: the settings applied (empty when none could be)."""
    name = ctypes.util.find_library("c")
    if name is None or "libc.so" not in name:
        return {}
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return {}
    applied: dict[str, int] = {}
    wanted = (
        ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        ("MALLOC_ARENA_MAX", _M_ARENA_MAX, ARENA_MAX),
    )
    for variable, option, value in wanted:
        if variable not in os.environ and mallopt(option, value) == 1:
            applied[variable] = value
    return applied
