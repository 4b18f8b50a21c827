"""A byte-bounded LRU of saved sequence states, keyed by the prefix tokens they hold.

A state is kept as the buffer llama.cpp wrote it into (``Llama.save``): never copied again."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

State = bytes | bytearray


def prefix_key(weights_id: str, tokens: np.ndarray) -> str:
    """The key of a saved prefix: the weights it was computed with (the model's sha256 and any
    adapter's, with its scale) and its tokens."""
    digest = hashlib.sha256(weights_id.encode())
    digest.update(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    return digest.hexdigest()


class PrefixCache:
    """Evicts least recently used entries once their bytes pass ``limit_bytes``."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[str, State] = OrderedDict()
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> State | None:
        state = self._entries.get(key)
        if state is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return state

    def put(self, key: str, state: State) -> None:
        if len(state) > self.limit_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes_used -= len(old)
        self._entries[key] = state
        self.bytes_used += len(state)
        while self.bytes_used > self.limit_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes_used -= len(evicted)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes_used = 0
