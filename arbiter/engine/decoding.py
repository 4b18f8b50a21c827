"""Decoding on a llama.cpp context: a token stream in ``n_batch`` slices, logits only at the
positions that are read (``want``), each slice checked against the context's output rows, and a
check between slices that can stop the work (never inside one: a ``llama_decode`` call cannot be
stopped). Part of :class:`~arbiter.engine.llama.Llama`; the caller holds the lock that serializes
decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import llama_cpp
import numpy as np

from arbiter.engine.batch import NumpyBatch
from arbiter.errors import EngineFailure

# Called with (position in the decoded stream, index in its slice) for each position whose logits
# were asked for, right after the slice that computed them, while they are readable.
OnOutput = Callable[[int, int], None]


class Decoding:
    """Decodes on a context (``_ctx``, its batch and sizes, set by ``Llama.open_context``)."""

    _ctx: Any
    _batch: NumpyBatch
    _interrupt: Callable[[], None] | None
    _cancellable: Callable[[], AbstractContextManager[None]]
    n_batch: int
    n_outputs_max: int
    n_vocab: int

    @contextmanager
    def interruptible(self, check: Callable[[], None] | None) -> Iterator[None]:
        """``check`` runs before every ``llama_decode`` call in the block (never inside one: a
        call cannot be stopped); whatever it raises ends the decode there. The caller holds the
        lock that serializes decoding, so one check is active at a time."""
        self._interrupt = check
        try:
            yield
        finally:
            self._interrupt = None

    def decode(
        self,
        tokens: np.ndarray,
        pos: np.ndarray,
        seqs: np.ndarray,
        want: np.ndarray,
        on_output: OnOutput | None = None,
    ) -> None:
        """Decode a token stream in n_batch slices, logits only where ``want`` is set."""
        n = len(tokens)
        for start in range(0, n, self.n_batch):
            stop = min(n, start + self.n_batch)
            outputs = int(np.count_nonzero(want[start:stop]))
            if outputs > self.n_outputs_max:
                raise EngineFailure(
                    f"a decode slice asks for {outputs} outputs; the context holds "
                    f"{self.n_outputs_max} (one per sequence)"
                )
            if self._interrupt is not None:
                self._interrupt()
            self._batch.fill(
                tokens[start:stop], pos[start:stop], seqs[start:stop], want[start:stop]
            )
            with self._cancellable():  # rc 2: aborted by the load's cancel
                rc = llama_cpp.llama_decode(self._ctx, self._batch.struct)
            if rc != 0:
                raise EngineFailure(f"llama_decode failed with status {rc}")
            if on_output is not None:
                for offset in np.flatnonzero(want[start:stop]).tolist():
                    on_output(start + offset, offset)

    def prefill(self, tokens: np.ndarray) -> None:
        """Decode ``tokens`` into sequence 0 from position 0, reading no logits."""
        n = len(tokens)
        self.decode(
            tokens, np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.zeros(n, np.int8)
        )

    def logits(self, batch_index: int) -> np.ndarray:
        """The full-vocabulary logits at ``batch_index`` of the last slice: a view into llama.cpp's
        buffer, valid until the next decode."""
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        if not ptr:
            raise EngineFailure("llama.cpp returned no logits for a requested position")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def last_logits(self, tokens: np.ndarray, start: int) -> np.ndarray:
        """Decode ``tokens`` into sequence 0 from position ``start``; the logits at the last one
        (a float64 copy)."""
        n = len(tokens)
        want = np.zeros(n, dtype=np.int8)
        want[-1] = 1
        out: list[np.ndarray] = []

        def keep(_: int, batch_index: int) -> None:
            out.append(self.logits(batch_index).astype(np.float64))

        self.decode(
            tokens, np.arange(start, start + n, dtype=np.int32), np.zeros(n, np.int32), want, keep
        )
        return out[0]
