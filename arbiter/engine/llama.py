"""One llama.cpp model and context through the C API: the model loaded, its context opened, its
LoRA adapters applied, its metadata read. ``Llama`` is also where the engine decodes
(``decoding``) and keeps its KV cells (``kv_memory``); with ``vocabulary``, these modules hold every
ctypes call the engine makes.

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

from arbiter.engine import backends
from arbiter.engine.batch import NumpyBatch
from arbiter.engine.decoding import Decoding
from arbiter.engine.kv_memory import KVMemory
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


@dataclass(frozen=True)
class ContextShape:
    """How a context is laid out beyond its size and sequences: what the engine asks for, and
    what `arbiter bench peers` varies one setting at a time against llama.cpp's own server."""

    # Branches share the prefix cells instead of splitting n_ctx into one stream per sequence.
    unified: bool = True
    # llama.cpp's default: a sliding-window layer keeps every cell (a saved prefix restores whole).
    swa_full: bool = True
    outputs: int | None = None  # rows of logits; at least one per sequence (llama.cpp's rule)


class Llama(Decoding, KVMemory):
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
