"""One llama.cpp model and context through the C API: every ctypes call the engine makes is here.

Logits are requested only at the positions that are read (``want``), never for every token, and the
context is sized for that: ``n_outputs_max`` rows of logits instead of ``n_batch``. Batches are filled
from numpy arrays (no Python loop per token). Nothing here knows what a decision is.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from arbiter.engine import backends
from arbiter.engine.batch import NumpyBatch
from arbiter.engine.vocabulary import Vocabulary
from arbiter.errors import EngineFailure, LoadCancelled, ModelLoadError
from arbiter.gguf_info import FILE_TYPES
from arbiter.models import require_weights
from arbiter.settings import EngineSettings

LLAMA_CPP_PYTHON_VERSION: str = getattr(llama_cpp, "__version__", "unknown")
# llama-cpp-python does not expose the llama.cpp commit it vendors; its changelog names it.
LLAMA_CPP_BUILD = {"0.3.36": "ggml-org/llama.cpp@0c1e57098"}.get(
    LLAMA_CPP_PYTHON_VERSION, "unknown"
)

# Called with (position in the decoded stream, index in its slice) for each position whose logits
# were asked for, right after the slice that computed them, while they are readable.
OnOutput = Callable[[int, int], None]


@dataclass(frozen=True)
class ContextShape:
    """How a context is laid out beyond its size and sequences: what the engine asks for, and
    what `arbiter bench peers` varies one setting at a time against llama.cpp's own server."""

    # Branches share the prefix cells instead of splitting n_ctx into one stream per sequence.
    unified: bool = True
    # llama.cpp's default: a sliding-window layer keeps every cell (a saved prefix restores whole).
    swa_full: bool = True
    outputs: int | None = None  # rows of logits; at least one per sequence (llama.cpp's rule)


class Llama:
    """A loaded model and its context (:meth:`open_context`). Not thread-safe for decoding: the
    engine serializes that; tokenizing and token texts take a lock of their own, so :meth:`close`
    never frees the vocabulary under a running call."""

    def __init__(
        self,
        path: Path,
        settings: EngineSettings,
        *,
        vocab_only: bool = False,
        cancel: threading.Event | None = None,
    ) -> None:
        """Load the model and its vocabulary; :meth:`open_context` makes the context.

        ``vocab_only``: the vocabulary and metadata alone (no weights: the prompts of a model can
        be rendered and counted, nothing decoded). ``cancel``, once set, stops the load: the
        weights' read (llama.cpp's progress callback) and, until :meth:`loaded`, any decode
        (its abort callback, checked between a graph's nodes), each with ``LoadCancelled``."""
        self.path = path
        self._cancel = cancel
        # ctypes callbacks llama.cpp holds: kept alive here as long as it may call them.
        self._on_progress: Any = None
        self._on_abort: Any = None
        self._tok_lock = threading.Lock()
        self._closed = False
        self._model: Any = None
        self._ctx: Any = None
        self._adapters: list[Any] = []  # LoRA adapters (load_adapters), freed with the model
        self._interrupt: Callable[[], None] | None = None
        backends.init()
        try:
            self._load(settings, vocab_only)
        except BaseException:
            self.close()  # a model refused part-way through loading frees what it had
            raise

    def _load(self, s: EngineSettings, vocab_only: bool) -> None:
        if s.n_gpu_layers != 0 and not llama_cpp.llama_supports_gpu_offload():
            raise ModelLoadError(
                f"n_gpu_layers={s.n_gpu_layers} was asked for, but this llama.cpp build has no GPU "
                "backend; set ARBITER_N_GPU_LAYERS=0 or use the CUDA image"
            )
        if not vocab_only:
            require_weights(self.path)
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 10_000 if s.n_gpu_layers < 0 else s.n_gpu_layers
        mparams.vocab_only = vocab_only
        if self._cancel is not None:
            cancel = self._cancel
            self._on_progress = llama_cpp.llama_progress_callback(
                lambda _progress, _data: not cancel.is_set()
            )
            mparams.progress_callback = self._on_progress
        with self._cancellable():
            self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self.path}")
        handle = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab = Vocabulary(handle, self.path, self._tok_lock)
        self.n_vocab = self.vocab.n_vocab
        template = llama_cpp.llama_model_chat_template(self._model, None)
        self.chat_template: str | None = template.decode("utf-8") if template else None

    def open_context(
        self, s: EngineSettings, sequences: int, shape: ContextShape | None = None
    ) -> None:
        """Create the context for ``sequences`` KV sequences, each read at one position at most
        per decode (the engine sizes it: the prefix, the question branches, the label branches).

        Logits are read at one position per sequence, never more: ``n_outputs_max`` keeps the
        output and compute buffers at ``sequences`` x vocab floats instead of n_batch x vocab (514
        MiB at n_batch 512 for a 262k vocab, 2 GiB at 2048). ``decode`` checks every slice against
        it: llama.cpp aborts the process (GGML_ASSERT) on a slice that asks for more.
        """
        shape = shape or ContextShape()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = s.n_ctx
        cparams.n_batch = s.n_batch
        cparams.n_ubatch = s.n_batch
        cparams.n_seq_max = sequences
        self.n_seq_max = sequences
        # llama.cpp reserves an output row per sequence at construction, so the cap is at least
        # that; it is also what the largest label decode reads.
        self.n_outputs_max = max(sequences, shape.outputs or 0)
        cparams.n_outputs_max = self.n_outputs_max
        cparams.n_threads = s.n_threads
        cparams.n_threads_batch = s.n_threads
        cparams.kv_unified = shape.unified
        cparams.swa_full = shape.swa_full
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ModelLoadError(f"llama.cpp could not create a context of {s.n_ctx} tokens")
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = NumpyBatch(self.n_batch)
        if self._cancel is not None:  # the load's decodes (the read check) stop when cancelled
            cancel = self._cancel
            self._on_abort = llama_cpp.ggml_abort_callback(lambda _data: cancel.is_set())
            llama_cpp.llama_set_abort_callback(self._ctx, self._on_abort, None)

    @contextmanager
    def _cancellable(self) -> Iterator[None]:
        """A llama.cpp call the load's cancel may stop: ``LoadCancelled`` once it returns, and
        the error lines llama.cpp logs about the stop dropped (they are no failure)."""
        if self._cancel is None:  # served: nothing to stop, nothing collected
            yield
            return
        with backends.collected_errors() as said:
            yield
        LoadCancelled.check(self._cancel)
        for line in said:
            sys.stderr.write(line)

    def loaded(self) -> None:
        """The load is over: ``cancel`` no longer stops a decode (a request's is never aborted
        half-way; its own checks run between decodes, :meth:`interruptible`)."""
        if self._ctx and self._on_abort is not None:
            llama_cpp.llama_set_abort_callback(self._ctx, llama_cpp.ggml_abort_callback(), None)
        self._cancel = None

    def load_adapters(self, adapters: Sequence[tuple[Path, float]]) -> None:
        """Load LoRA adapters on the model and apply them to the context at their scales
        (``arbiter.lora`` has checked each against the model's tensors first)."""
        self._adapters = []
        for path, _ in adapters:
            handle = llama_cpp.llama_adapter_lora_init(self._model, str(path).encode())
            if not handle:
                raise ModelLoadError(
                    f"refusing to start: llama.cpp could not load the LoRA adapter {path} "
                    "(its log line says why)"
                )
            self._adapters.append(handle)
        self.set_adapter_scales([scale for _, scale in adapters])

    def set_adapter_scales(self, scales: Sequence[float]) -> None:
        """Apply the loaded adapters at ``scales`` (0: not applied; the base model's numbers)."""
        n = len(self._adapters)
        if len(scales) != n:
            raise ValueError(f"{len(scales)} scales for {n} adapters")
        if n == 0:
            return
        handles = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*self._adapters)
        values = (ctypes.c_float * n)(*scales)
        rc = llama_cpp.llama_set_adapters_lora(self._ctx, handles, n, values)
        if rc != 0:
            raise ModelLoadError(f"llama.cpp refused to apply the LoRA adapters (status {rc})")

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model; later calls raise ``EngineFailure``. The caller holds
        whatever lock serializes decoding."""
        with self._tok_lock:
            self._closed = True
            if (vocab := self.__dict__.get("vocab")) is not None:  # none if the load failed
                vocab.closed = True
            if self._ctx:
                llama_cpp.llama_free(self._ctx)
                self._ctx = None
            if self._model:
                llama_cpp.llama_model_free(self._model)
                self._model = None

    def check_open(self) -> None:
        if self._closed:
            raise EngineFailure("the engine is closed (the server is shutting down)")

    # -- the model's metadata ----------------------------------------------------------------------

    def meta(self, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else ""

    def description(self) -> str:
        desc = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self._model, desc, len(desc))
        return desc.value.decode("utf-8", "replace")

    def quantization(self) -> str:
        file_type = self.meta("general.file_type")
        return FILE_TYPES.get(int(file_type), file_type) if file_type.isdigit() else "unknown"

    def kv_cache_bytes(self) -> int:
        """Size of the f16 K and V caches for the whole context (what the context allocates)."""
        arch = self.meta("general.architecture")
        n_layer = int(llama_cpp.llama_model_n_layer(self._model))
        n_head_kv = int(llama_cpp.llama_model_n_head_kv(self._model))
        n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        n_head = int(llama_cpp.llama_model_n_head(self._model))
        k = int(self.meta(f"{arch}.attention.key_length") or n_embd // n_head)
        v = int(self.meta(f"{arch}.attention.value_length") or n_embd // n_head)
        return n_layer * self.n_ctx * n_head_kv * (k + v) * 2

    # -- the KV cache ------------------------------------------------------------------------------

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

    # -- decoding ----------------------------------------------------------------------------------

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
