"""One ``llama_decode`` call's batch, filled from numpy arrays: tokens, positions, one sequence id
each and output flags, in buffers allocated once per context (no Python loop per token)."""

from __future__ import annotations

import ctypes
from typing import Any, cast

import llama_cpp
import numpy as np


class NumpyBatch:
    """Tokens, positions, one sequence id each, and output flags for one ``llama_decode`` call."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._token = np.zeros(capacity, dtype=np.int32)
        self._pos = np.zeros(capacity, dtype=np.int32)
        self._n_seq = np.ones(capacity, dtype=np.int32)
        self._seq = np.zeros(capacity, dtype=np.int32)
        # seq_id is an array of pointers, one per token, each into self._seq.
        self._seq_ptrs = (self._seq.ctypes.data + 4 * np.arange(capacity, dtype=np.uint64)).astype(
            np.uint64
        )
        self._logits = np.zeros(capacity, dtype=np.int8)
        # llama-cpp-python annotates these pointer fields as ctypes arrays: the struct is Any here.
        self.struct: Any = cast(Any, llama_cpp.llama_batch())
        self.struct.token = self._token.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()
        self.struct.pos = self._pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        self.struct.n_seq_id = self._n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(
            self._seq_ptrs.ctypes.data, ctypes.POINTER(ctypes.POINTER(llama_cpp.llama_seq_id))
        )
        self.struct.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, want: np.ndarray) -> None:
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds capacity {self.capacity}")
        self._token[:n] = tokens
        self._pos[:n] = pos
        self._seq[:n] = seq
        self._logits[:n] = want
        self.struct.n_tokens = n
