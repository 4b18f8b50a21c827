"""The KV cells of a llama.cpp context: cleared, branched (a sequence shares another's cells),
trimmed, and sequence 0 saved and restored (the prefix cache's states). Part of
:class:`~arbiter.engine.llama.Llama`; the caller holds the lock that serializes decoding.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import llama_cpp


class KVMemory:
    """A context's KV memory (``_ctx`` and its ``_mem``, set by ``Llama.open_context``)."""

    _ctx: Any
    _mem: Any

    def clear(self) -> None:
        # Only the cells' metadata: zeroing the whole KV buffer (data=True) cost ~3% of a
        # decision and nothing reads a cell that was not written again.
        llama_cpp.llama_memory_clear(self._mem, False)

    @contextmanager
    def kv_cleared(self) -> Iterator[None]:
        """The KV cache empty when the block starts and emptied when it ends, however it ends."""
        self.clear()
        try:
            yield
        finally:
            self.clear()

    def copy_sequence(self, source: int, target: int) -> None:
        """Sequence ``target`` shares ``source``'s cells (a branch of a prefilled prefix)."""
        llama_cpp.llama_memory_seq_cp(self._mem, source, target, -1, -1)

    def remove(self, seq: int, start: int = -1, end: int = -1) -> bool:
        """Drop positions ``[start, end)`` of sequence ``seq`` (-1: open-ended); False when the
        memory cannot drop part of a sequence (a recurrent model's)."""
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, seq, start, end))

    def save(self, limit: int) -> bytearray | None:
        """Sequence 0's state, copied once (llama.cpp writes it straight into the buffer that is
        kept); None when it is over ``limit`` bytes (not copied)."""
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, 0))
        if size > limit:
            return None
        state = bytearray(size)
        view = (ctypes.c_uint8 * size).from_buffer(state)
        written = int(llama_cpp.llama_state_seq_get_data(self._ctx, view, size, 0))
        del view  # the export ends, so the buffer may shrink in place
        if written < size:
            del state[written:]
        return state

    def restore(self, state: bytes | bytearray) -> bool:
        """Sequence 0 from a saved state; False when llama.cpp refuses it (part may be written)."""
        # llama.cpp only reads the buffer: pass the object's own memory, no copy.
        if isinstance(state, bytearray):
            buf: Any = (ctypes.c_uint8 * len(state)).from_buffer(state)
        else:
            buf = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
        return bool(llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(state), 0))
