"""The decision engine: the only module that drives llama.cpp.

A decision is read from one forward pass. The prompt is prefilled with logits requested at the final
position only; the logits of the option-letter tokens there, through a softmax, are the probabilities.
Decisions over the same state are scored as branches of one prefilled prefix: the prefix lives in KV
sequence 0, is copied (``llama_memory_seq_cp``) into sequences 1..k, and the k suffixes (question and
options) go through one batched ``llama_decode``. Prefilled prefixes are also kept, as saved sequence
states, in a byte-bounded LRU so a later request over the same state skips the prefill.
"""

from __future__ import annotations

import codecs
import ctypes
import hashlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np

from arbiter import prompt as prompts
from arbiter.engine import calibration, ordering
from arbiter.engine.backends import load_backends
from arbiter.engine.llama import NumpyBatch
from arbiter.engine.prefix_cache import PrefixCache, prefix_key
from arbiter.errors import (
    ArbiterError,
    ContextLengthExceeded,
    EngineFailure,
    InvalidDecision,
    LabelVocabularyError,
    ModelLoadError,
    TooManyOptions,
)
from arbiter.logging import get_logger
from arbiter.models import ResolvedModel, resolve_model, verify
from arbiter.schema import DecisionRequest, DecisionResult, ModelInfo, PromptInfo, Timing
from arbiter.settings import EngineSettings

# llama-cpp-python does not expose the llama.cpp commit it vendors; its changelog names it.
_VENDORED_LLAMA_CPP = {"0.3.36": "ggml-org/llama.cpp@0c1e57098"}
_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4",
}

_backend_ready = False
_backend_lock = threading.Lock()
log = get_logger("arbiter.engine")


@llama_cpp.llama_log_callback
def _llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Pass llama.cpp's own errors to stderr; drop its chatty load and graph logs."""
    if level == _GGML_LOG_LEVEL_ERROR and text:
        sys.stderr.write(text.decode("utf-8", "replace"))


_GGML_LOG_LEVEL_ERROR = 4  # ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5


def _init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_log_set(_llama_log, ctypes.c_void_p(0))
            load_backends()  # a GGML_BACKEND_DL build (the CPU image) has none until loaded
            llama_cpp.llama_backend_init()
            _backend_ready = True


def _logsumexp(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    top = np.max(values, axis=axis, keepdims=True)
    out = top + np.log(np.sum(np.exp(values - top), axis=axis, keepdims=True))
    return np.squeeze(out, axis=axis) if axis is not None else out.reshape(())


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


@dataclass
class _Prepared:
    """A validated decision turned into tokens, waiting for its group's forward pass."""

    index: int
    request: DecisionRequest
    tokens: np.ndarray
    prompt_sha256: str
    tokenize_s: float
    suffix_start: int = 0  # set per group: where this prompt leaves the shared prefix
    readout_s: float = 0.0
    logits: np.ndarray = field(default_factory=lambda: np.zeros(0))
    full_lse: float = 0.0


@dataclass
class _GroupRun:
    prefix_tokens: int
    cache: str
    prefill_s: float


class Engine:
    """Scores decisions with one llama.cpp model and context. Thread-safe: calls are serialized."""

    def __init__(self, settings: EngineSettings, resolved: ResolvedModel | None = None) -> None:
        self.settings = settings
        self.resolved = resolved or resolve_model(settings.model, settings.model_dir)
        self.sha256 = verify(self.resolved)
        # ``_lock`` serializes everything that touches the context; ``_tok_lock`` guards the
        # vocabulary (tokenizing runs outside ``_lock``, e.g. chat prompts before admission) so
        # ``close`` can never free it under a running call.
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._closed = False
        self._model = None
        self._ctx = None
        _init_backend()
        try:
            self._load()
        except BaseException:
            self.close()  # a model refused part-way through loading frees what it had
            raise
        self.cache = PrefixCache(int(settings.prefix_cache_mb * 1024 * 1024))
        self.calibration: calibration.Calibration | None = None
        if settings.calibration is not None:
            self.calibration = calibration.Calibration.load(settings.calibration)
            self.calibration.check_model(self.sha256, self.resolved.path.name)

    # -- loading ---------------------------------------------------------------------------------

    def _load(self) -> None:
        s = self.settings
        if s.n_gpu_layers != 0 and not llama_cpp.llama_supports_gpu_offload():
            raise ModelLoadError(
                f"n_gpu_layers={s.n_gpu_layers} was asked for, but this llama.cpp build has no GPU "
                "backend; set ARBITER_N_GPU_LAYERS=0 or use the CUDA image"
            )
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 10_000 if s.n_gpu_layers < 0 else s.n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(
            str(self.resolved.path).encode(), mparams
        )
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self.resolved.path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = s.n_ctx
        cparams.n_batch = s.n_batch
        cparams.n_ubatch = s.n_batch
        cparams.n_seq_max = s.max_branches + 1
        # Logits are read at one position per sequence, never more: this keeps the output and
        # compute buffers at (branches + 1) x vocab floats instead of n_batch x vocab (514 MiB at
        # n_batch 512 for a 262k vocab, 2 GiB at 2048). ``_decode_stream`` checks every slice
        # against it: llama.cpp aborts the process (GGML_ASSERT) on a slice that asks for more.
        self._n_outputs_max = s.max_branches + 1
        cparams.n_outputs_max = self._n_outputs_max
        cparams.n_threads = s.n_threads
        cparams.n_threads_batch = s.n_threads
        cparams.kv_unified = True  # branches share the prefix cells instead of splitting n_ctx
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ModelLoadError(f"llama.cpp could not create a context of {s.n_ctx} tokens")
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = NumpyBatch(self.n_batch)

        self._add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self._bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        if self._add_bos and not 0 <= self._bos < self.n_vocab:
            raise ModelLoadError(
                f"{self.resolved.path.name}: the vocabulary asks for a BOS token but has none "
                f"(token id {self._bos}); refusing to start"
            )
        template = llama_cpp.llama_model_chat_template(self._model, None)
        # For chat completions (``generate``): the raw template, and the texts it names (a model
        # without BOS or EOS names them as "": ``piece`` maps an id outside the vocabulary to "").
        self.chat_template = template.decode("utf-8") if template else None
        self.bos_text = self.piece(self._bos)
        self.eos_text = self.piece(int(llama_cpp.llama_vocab_eos(self._vocab)))
        if template:
            self.layout = prompts.chat_layout(
                template.decode("utf-8"), self.bos_text, self.eos_text
            )
        else:
            self.layout = prompts.plain_layout()
        self._head = self._tokenize(self.layout.head, special=True)
        if self._add_bos and (len(self._head) == 0 or self._head[0] != self._bos):
            self._head = np.concatenate([np.array([self._bos], dtype=np.int32), self._head])
        self._tail = self._tokenize(self.layout.tail, special=True)
        self.label_token_ids = self._label_tokens()
        self.model_info = self._model_info()

    def _label_tokens(self) -> np.ndarray:
        """Token ids per letter (rows) and spelling variant (columns: "A", " A" where both work).

        A variant is kept only if all 26 letters are one token each, round-trip through the
        vocabulary, and differ from each other; the readout combines kept variants by log-sum-exp,
        the same way for every option. No usable variant: the model cannot be served.
        """
        columns = []
        for lead in ("", " "):
            ids = []
            for letter in prompts.LETTERS:
                toks = self._tokenize(lead + letter, special=False)
                if len(toks) != 1 or self.piece(int(toks[0])) != lead + letter:
                    break
                ids.append(int(toks[0]))
            if len(ids) == len(prompts.LETTERS) and len(set(ids)) == len(ids):
                columns.append(ids)
        if not columns:
            raise LabelVocabularyError(
                f"{self.resolved.path.name}: the letters A-Z are not single, distinct, round-trip "
                "tokens in this vocabulary, so option labels cannot be read; refusing to start"
            )
        merged = np.array(columns, dtype=np.int64).T
        if (
            len({tuple(row) for row in merged}) != len(merged)
            or len(np.unique(merged)) != merged.size
        ):
            raise LabelVocabularyError("label token variants collide across letters")
        return merged

    def _meta(self, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else ""

    def _model_info(self) -> ModelInfo:
        desc = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self._model, desc, len(desc))
        file_type = self._meta("general.file_type")
        quant = _FILE_TYPES.get(int(file_type), file_type) if file_type.isdigit() else "unknown"
        version = getattr(llama_cpp, "__version__", "unknown")
        return ModelInfo(
            file=self.resolved.path.name,
            bytes=self.resolved.path.stat().st_size,
            sha256=self.sha256,
            architecture=self._meta("general.architecture") or "unknown",
            quantization=quant,
            description=desc.value.decode("utf-8", "replace"),
            context_tokens=self.n_ctx,
            threads=self.settings.n_threads,
            n_gpu_layers=self.settings.n_gpu_layers,
            chat_template=self.layout.chat,
            llama_cpp_python_version=version,
            llama_cpp_build=_VENDORED_LLAMA_CPP.get(version, "unknown"),
        )

    def close(self) -> None:
        """Free the context and model once no call is using them; later calls get EngineFailure."""
        with self._lock, self._tok_lock:
            self._closed = True
            if self._ctx:
                llama_cpp.llama_free(self._ctx)
                self._ctx = None
            if self._model:
                llama_cpp.llama_model_free(self._model)
                self._model = None

    def _check_open(self) -> None:
        if self._closed:
            raise EngineFailure("the engine is closed (the server is shutting down)")

    # -- tokens ----------------------------------------------------------------------------------

    def _tokenize(self, text: str, *, special: bool) -> np.ndarray:
        """Tokens of ``text``, in a buffer of this call's own.

        ``llama_tokenize`` releases the GIL: a buffer shared between calls let a concurrent
        tokenization (chat prompts are tokenized outside the engine lock) overwrite another's
        tokens, and a decision was scored on the wrong prompt.
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidDecision(
                f"the text is not valid Unicode ({exc.reason} at character {exc.start})",
                code="invalid_text",
            ) from exc
        # A token covers at least one byte; the margin covers a leading-space marker.
        buf = np.empty(len(data) + 16, dtype=np.int32)
        with self._tok_lock:
            self._check_open()
            n = self._tokenize_into(data, buf, special)
            if n < 0:
                buf = np.empty(-n, dtype=np.int32)
                n = self._tokenize_into(data, buf, special)
        if n < 0:
            raise EngineFailure(f"llama_tokenize failed with status {n}")
        return buf[:n].copy()

    def _tokenize_into(self, data: bytes, buf: np.ndarray, special: bool) -> int:
        out = buf.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        return int(
            llama_cpp.llama_tokenize(self._vocab, data, len(data), out, len(buf), False, special)
        )

    def tokenize_content(self, text: str) -> np.ndarray:
        """Tokens of caller-written text: special-token text stays plain text."""
        return self._tokenize(text, special=False)

    def piece(self, token: int) -> str:
        """The text of one token ("" for an id outside the vocabulary, e.g. a missing BOS)."""
        return self._piece_bytes(token, special=True).decode("utf-8", "replace")

    def is_control(self, token: int) -> bool:
        if not 0 <= token < self.n_vocab:
            return False
        with self._tok_lock:
            self._check_open()
            return bool(llama_cpp.llama_vocab_is_control(self._vocab, token))

    def prompt_tokens(self, request: DecisionRequest) -> np.ndarray:
        """The full prompt of one decision, as scored."""
        content = self._render(request)
        return np.concatenate([self._head, self.tokenize_content(content.text), self._tail])

    def render_text(self, request: DecisionRequest) -> str:
        return prompts.full_text(self.layout, self._render(request))

    def _render(self, request: DecisionRequest) -> prompts.RenderedContent:
        return prompts.render_content(
            self.layout,
            prompts.state_text(request.state),
            request.question,
            [o.description for o in request.options],
        )

    # -- scoring ---------------------------------------------------------------------------------

    def score(self, decisions: Sequence[DecisionRequest]) -> list[DecisionResult | ArbiterError]:
        """Score decisions in any mix of states; outcomes come back in input order.

        A decision that cannot be scored (too many options, too long, text that is not Unicode,
        non-finite logits, any other failure of its own) becomes its typed error in its slot; the
        others are scored regardless. ``order_samples`` expands a decision into several option
        orders over its state (``arbiter.engine.ordering``); a calibration file sets the temperature of
        decisions that set none (``arbiter.engine.calibration``). Raises only for the whole call: the
        engine is closed.
        """
        expanded, plan = ordering.expand(decisions)
        with self._lock:
            self._check_open()
            outcomes: list[DecisionResult | ArbiterError | None] = [None] * len(expanded)
            groups: dict[str, list[tuple[int, DecisionRequest]]] = {}
            for i, request in enumerate(expanded):
                try:
                    groups.setdefault(prompts.state_text(request.state), []).append((i, request))
                except Exception as exc:  # a state that is not JSON (only without the schema)
                    outcomes[i] = _decision_error(exc)
            for state, members in groups.items():
                for index, outcome in self._score_state(state, members):
                    outcomes[index] = outcome
        merged = ordering.merge(decisions, outcomes, plan, self.settings.temperature)  # type: ignore[arg-type]
        return [self._calibrated(d, o) for d, o in zip(decisions, merged, strict=True)]

    def _calibrated(
        self, request: DecisionRequest, outcome: DecisionResult | ArbiterError
    ) -> DecisionResult | ArbiterError:
        """Probabilities at the calibrated temperature, unless the request set its own."""
        if self.calibration is None or request.temperature is not None:
            return outcome
        if isinstance(outcome, ArbiterError):
            return outcome
        temperature = self.calibration.temperature_for(request.question_type)
        return outcome.model_copy(
            update={
                "probabilities": calibration.softmax(outcome.option_logits, temperature),
                "temperature": temperature,
                "probability_status": "calibrated",
            }
        )

    def _prepare(self, index: int, request: DecisionRequest) -> _Prepared:
        started = time.perf_counter()
        if len(request.options) > len(prompts.LETTERS):
            raise TooManyOptions(
                f"{len(request.options)} options given; this model reads single-token letter "
                f"labels, so at most {len(prompts.LETTERS)} options are supported",
                param="options",
            )
        content = self._render(request)
        tokens = np.concatenate([self._head, self.tokenize_content(content.text), self._tail])
        if len(tokens) > self.n_ctx:
            field, field_tokens = self._longest_field(request)
            raise ContextLengthExceeded(
                f"the prompt is {len(tokens)} tokens ({field} {field_tokens}); the context holds "
                f"{self.n_ctx} tokens. Nothing is truncated: shorten {field} or raise "
                "ARBITER_N_CTX",
                param=field,
            )
        text = prompts.full_text(self.layout, content)
        return _Prepared(
            index=index,
            request=request,
            tokens=tokens,
            prompt_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
            tokenize_s=time.perf_counter() - started,
        )

    def _longest_field(self, request: DecisionRequest) -> tuple[str, int]:
        """The field of a too-long decision that holds the most tokens, and its count."""
        fields = {
            "state": prompts.state_text(request.state),
            "question": request.question,
            **{f"options.{i}.description": o.description for i, o in enumerate(request.options)},
        }
        counts = {name: len(self.tokenize_content(text)) for name, text in fields.items()}
        name = max(counts, key=lambda k: counts[k])
        return name, counts[name]

    def _score_state(
        self, state: str, members: list[tuple[int, DecisionRequest]]
    ) -> list[tuple[int, DecisionResult | ArbiterError]]:
        results: list[tuple[int, DecisionResult | ArbiterError]] = []
        prepared: list[_Prepared] = []
        for index, request in members:
            try:
                prepared.append(self._prepare(index, request))
            except Exception as exc:
                results.append((index, _decision_error(exc)))
        if not prepared:
            return results
        try:
            started = time.perf_counter()
            prefix_text = prompts.state_prefix(self.layout, state)
            state_prefix = np.concatenate([self._head, self.tokenize_content(prefix_text)])
            # The prefix is a true token prefix of every prompt by construction: the longest run
            # the state's own tokenization shares with each full prompt (BPE merges at the
            # boundary fall outside it), and always at least one token short of the shortest.
            shared = min(_common_prefix(state_prefix, p.tokens) for p in prepared)
            shared = min(shared, min(len(p.tokens) for p in prepared) - 1)
            group_tokenize_s = time.perf_counter() - started
            for p in prepared:
                p.suffix_start = shared
            run = self._forward(prepared[0].tokens[:shared], prepared)
        except Exception as exc:  # the group's shared prefill failed: each member says so
            error = _decision_error(exc)
            return results + [(p.index, error) for p in prepared]
        finally:
            # Only the cells' metadata: zeroing the whole KV buffer (data=True) cost ~3% of a
            # decision and nothing reads a cell that was not written again.
            llama_cpp.llama_memory_clear(self._mem, False)
        for p in prepared:
            try:
                results.append((p.index, self._result(p, run, group_tokenize_s)))
            except Exception as exc:
                results.append((p.index, _decision_error(exc)))
        return results

    def _forward(self, prefix: np.ndarray, prepared: list[_Prepared]) -> _GroupRun:
        """Prefill (or restore) the prefix in sequence 0, then decode the suffixes as branches."""
        started = time.perf_counter()
        cache_state = "off"
        key = prefix_key(self.sha256, prefix) if self.cache.enabled else ""
        if self.cache.enabled:
            saved = self.cache.get(key)
            if saved is not None and self._restore(saved):
                cache_state = "hit"
            else:
                if saved is not None:
                    # A failed restore can leave part of the state behind: the prefill must start
                    # from an empty sequence 0, as a cold run does.
                    llama_cpp.llama_memory_seq_rm(self._mem, 0, -1, -1)
                cache_state = "miss"
                self._prefill(prefix)
                state = self._save(self.cache.limit_bytes)
                if state is not None:
                    self.cache.put(key, state)
        else:
            self._prefill(prefix)
        n_prefix = len(prefix)
        budget = self.n_ctx - n_prefix
        chunk: list[_Prepared] = []
        used = 0
        per_decode = self.settings.max_branches if self.settings.parallel_branches else 1
        for p in prepared:
            suffix = len(p.tokens) - n_prefix
            if chunk and (used + suffix > budget or len(chunk) == per_decode):
                self._decode_branches(n_prefix, chunk)
                chunk, used = [], 0
            chunk.append(p)
            used += suffix
        self._decode_branches(n_prefix, chunk)
        return _GroupRun(n_prefix, cache_state, time.perf_counter() - started)

    def _prefill(self, prefix: np.ndarray) -> None:
        n = len(prefix)
        self._decode_stream(
            prefix, np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.zeros(n, np.int8)
        )

    def _decode_branches(self, n_prefix: int, chunk: list[_Prepared]) -> None:
        seq_ids = np.arange(1, len(chunk) + 1, dtype=np.int32)
        for seq in seq_ids:
            llama_cpp.llama_memory_seq_cp(self._mem, 0, int(seq), -1, -1)
        suffixes = [p.tokens[n_prefix:] for p in chunk]
        lengths = np.array([len(s) for s in suffixes])
        tokens = np.concatenate(suffixes)
        pos = np.concatenate([np.arange(n_prefix, n_prefix + n) for n in lengths]).astype(np.int32)
        want = np.zeros(len(tokens), dtype=np.int8)
        last = np.cumsum(lengths) - 1
        want[last] = 1
        reader_at = dict(zip(last.tolist(), chunk, strict=True))
        self._decode_stream(
            tokens,
            pos,
            np.repeat(seq_ids, lengths),
            want,
            lambda stream_index, batch_index: self._read(reader_at[stream_index], batch_index),
        )
        for seq in seq_ids:
            llama_cpp.llama_memory_seq_rm(self._mem, int(seq), -1, -1)

    def _decode_stream(
        self,
        tokens: np.ndarray,
        pos: np.ndarray,
        seqs: np.ndarray,
        want: np.ndarray,
        on_output: Callable[[int, int], None] | None = None,
    ) -> None:
        """Decode a token stream in n_batch slices, logits only where ``want`` is set.

        ``on_output(stream_index, batch_index)`` is called for each of those right after the slice
        that computed it, while its logits are readable.
        """
        n = len(tokens)
        for start in range(0, n, self.n_batch):
            stop = min(n, start + self.n_batch)
            outputs = int(np.count_nonzero(want[start:stop]))
            if outputs > self._n_outputs_max:
                raise EngineFailure(
                    f"a decode slice asks for {outputs} outputs; the context holds "
                    f"{self._n_outputs_max} (ARBITER_MAX_BRANCHES + 1)"
                )
            self._batch.fill(
                tokens[start:stop], pos[start:stop], seqs[start:stop], want[start:stop]
            )
            rc = llama_cpp.llama_decode(self._ctx, self._batch.struct)
            if rc != 0:
                raise EngineFailure(f"llama_decode failed with status {rc}")
            if on_output is not None:
                for offset in np.flatnonzero(want[start:stop]).tolist():
                    on_output(start + offset, offset)

    def _read(self, p: _Prepared, batch_index: int) -> None:
        started = time.perf_counter()
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        if not ptr:
            raise EngineFailure("llama.cpp returned no logits for a requested position")
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        labels = logits[self.label_token_ids[: len(p.request.options)]].astype(np.float64)
        p.logits = _logsumexp(labels, axis=1) if labels.shape[1] > 1 else labels[:, 0]
        p.full_lse = float(_logsumexp(logits.astype(np.float64)))
        p.readout_s = time.perf_counter() - started

    def plain_pass(self, tokens: np.ndarray) -> tuple[np.ndarray, float]:
        """One prefill of ``tokens`` in sequence 0, logits at the last position only: the floor.

        No prefix split, no branch, no cache. Returns the full-vocabulary logits (a copy) and the
        seconds spent in ``llama_decode``. Used as the reference in tests and benchmarks.
        """
        out: list[np.ndarray] = []

        def keep(_: int, batch_index: int) -> None:
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
            out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

        n = len(tokens)
        want = np.zeros(n, dtype=np.int8)
        want[-1] = 1
        with self._lock:
            self._check_open()
            llama_cpp.llama_memory_clear(self._mem, False)
            started = time.perf_counter()
            try:
                self._decode_stream(
                    tokens, np.arange(n, dtype=np.int32), np.zeros(n, np.int32), want, keep
                )
            finally:
                llama_cpp.llama_memory_clear(self._mem, False)
            return out[0], time.perf_counter() - started

    def floor_shared(self, prefix: np.ndarray, suffixes: list[np.ndarray]) -> tuple[float, float]:
        """The floor for questions over one state: one prefix prefill, then each suffix decoded
        after it (logits at its last token) and removed again. Returns (prefix_s, suffixes_s)."""
        n = len(prefix)
        with self._lock:
            self._check_open()
            llama_cpp.llama_memory_clear(self._mem, False)
            try:
                started = time.perf_counter()
                self._prefill(prefix)
                prefix_s = time.perf_counter() - started
                suffix_s = 0.0
                for suffix in suffixes:
                    m = len(suffix)
                    want = np.zeros(m, dtype=np.int8)
                    want[-1] = 1
                    started = time.perf_counter()
                    self._decode_stream(
                        suffix, np.arange(n, n + m, dtype=np.int32), np.zeros(m, np.int32), want
                    )
                    suffix_s += time.perf_counter() - started
                    llama_cpp.llama_memory_seq_rm(self._mem, 0, n, -1)
            finally:
                llama_cpp.llama_memory_clear(self._mem, False)
        return prefix_s, suffix_s

    def kv_cache_bytes(self) -> int:
        """Size of the f16 K and V caches for the whole context (what the context allocates)."""
        arch = self.model_info.architecture
        n_layer = int(llama_cpp.llama_model_n_layer(self._model))
        n_head_kv = int(llama_cpp.llama_model_n_head_kv(self._model))
        n_embd, n_head = (
            int(llama_cpp.llama_model_n_embd(self._model)),
            int(llama_cpp.llama_model_n_head(self._model)),
        )
        k = int(self._meta(f"{arch}.attention.key_length") or n_embd // n_head)
        v = int(self._meta(f"{arch}.attention.value_length") or n_embd // n_head)
        return n_layer * self.n_ctx * n_head_kv * (k + v) * 2

    def reference_option_logits(self, request: DecisionRequest) -> np.ndarray:
        """Option logits of one decision from a plain prefill of its whole prompt."""
        logits, _ = self.plain_pass(self.prompt_tokens(request))
        labels = logits[self.label_token_ids[: len(request.options)]].astype(np.float64)
        return _logsumexp(labels, axis=1)

    def _save(self, limit: int) -> bytes | None:
        """Sequence 0's state, copied once; None when it is over ``limit`` bytes (not copied)."""
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, 0))
        if size > limit:
            return None
        buf = (ctypes.c_uint8 * size)()
        written = int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, 0))
        return ctypes.string_at(buf, written)

    def _restore(self, state: bytes) -> bool:
        # llama.cpp only reads the buffer: pass the bytes object's own memory, no copy.
        buf = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
        return bool(llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(state), 0))

    def _result(self, p: _Prepared, run: _GroupRun, group_tokenize_s: float) -> DecisionResult:
        request = p.request
        if not (np.all(np.isfinite(p.logits)) and np.isfinite(p.full_lse)):
            raise EngineFailure(
                "llama.cpp returned non-finite logits for this decision; it was not scored"
            )
        temperature = request.temperature or self.settings.temperature
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = p.logits / temperature
            probs = np.exp(scaled - _logsumexp(scaled))
        if not np.all(np.isfinite(probs)):
            raise InvalidDecision(
                f"temperature {temperature!r} makes the probabilities overflow; use a "
                "temperature of 0.01 or more",
                param="temperature",
            )
        allowed = float(np.exp(_logsumexp(p.logits) - p.full_lse))
        option_ids = [o.id for o in request.options]
        tokenize_s = p.tokenize_s + group_tokenize_s
        return DecisionResult(
            id=request.id,
            option_ids=option_ids,
            probabilities=[float(x) for x in probs],
            option_logits=[float(x) for x in p.logits],
            choice=option_ids[int(np.argmax(probs))],
            allowed_mass=min(1.0, allowed),
            temperature=float(temperature),
            probability_status="raw",
            prefix_cache=run.cache,  # type: ignore[arg-type]
            prompt=PromptInfo(
                sha256=p.prompt_sha256,
                version=self.layout.version,
                input_tokens=len(p.tokens),
                prefix_tokens=run.prefix_tokens,
            ),
            timing=Timing(
                tokenize_s=tokenize_s,
                prefill_s=run.prefill_s,
                readout_s=p.readout_s,
                total_s=tokenize_s + run.prefill_s + p.readout_s,
            ),
            model=self.model_info,
        )

    # -- text generation (chat completions) --------------------------------------------------------

    def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> np.ndarray:
        """Tokens of a rendered chat prompt given as (text, is_template) pieces, in order.

        Template text is tokenized with special-token parsing; caller text without it, so a
        message can never inject a control token. BOS is added if the model wants one and the
        template did not write it.
        """
        parts = [self._tokenize(text, special=special) for text, special in segments if text]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        if self._add_bos and (len(tokens) == 0 or tokens[0] != self._bos):
            tokens = np.concatenate([np.array([self._bos], dtype=np.int32), tokens])
        return tokens.astype(np.int32)

    def generate(
        self,
        tokens: np.ndarray,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: Sequence[str] = (),
        seed: int | None = None,
        on_text: Callable[[str], bool] | None = None,
    ) -> Generation:
        """Generate text after ``tokens``: greedy at temperature 0, else sampled with numpy.

        Logits are computed at the last position only (prefill, then one token per decode).
        ``on_text`` receives the text as it becomes final (never part of a stop string); returning
        False stops the generation (finish reason ``cancelled``). Blocking; serialized with scoring.
        """
        if len(tokens) >= self.n_ctx:
            raise ContextLengthExceeded(
                f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx} tokens",
                param="messages",
            )
        budget = min(max_tokens, self.n_ctx - len(tokens))
        rng = np.random.default_rng(None if seed is None else seed % 2**64)
        with self._lock:
            self._check_open()
            llama_cpp.llama_memory_clear(self._mem, False)
            try:
                return self._generate(tokens, budget, temperature, top_p, list(stop), rng, on_text)
            finally:
                llama_cpp.llama_memory_clear(self._mem, False)

    def _generate(
        self,
        tokens: np.ndarray,
        budget: int,
        temperature: float,
        top_p: float,
        stop: list[str],
        rng: np.random.Generator,
        on_text: Callable[[str], bool] | None,
    ) -> Generation:
        started = time.perf_counter()
        logits = self._last_logits(tokens, 0)
        prefill_s = time.perf_counter() - started
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text, sent, produced, finish = "", 0, 0, "length"
        while produced < budget:
            token = _sample(logits, temperature, top_p, rng)
            if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                finish = "stop"
                break
            produced += 1
            text += decoder.decode(self._piece_bytes(token))
            cut = _stop_index(text, stop, sent)
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            final = len(text) - _held_back(text, stop)
            if final > sent and on_text is not None:
                if on_text(text[sent:final]) is False:
                    return self._generation(
                        text[:final], tokens, produced, "cancelled", started, prefill_s
                    )
                sent = final
            if produced < budget:
                logits = self._last_logits(
                    np.array([token], dtype=np.int32), len(tokens) + produced - 1
                )
        if finish == "length":
            text += decoder.decode(b"", final=True)
        if on_text is not None and len(text) > sent:
            on_text(text[sent:])
        return self._generation(text, tokens, produced, finish, started, prefill_s)

    def _generation(
        self,
        text: str,
        tokens: np.ndarray,
        produced: int,
        finish: str,
        started: float,
        prefill_s: float,
    ) -> Generation:
        total = time.perf_counter() - started
        return Generation(text, len(tokens), produced, finish, prefill_s, total - prefill_s)

    def _last_logits(self, tokens: np.ndarray, start: int) -> np.ndarray:
        n = len(tokens)
        want = np.zeros(n, dtype=np.int8)
        want[-1] = 1
        out: list[np.ndarray] = []

        def keep(_: int, batch_index: int) -> None:
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
            if not ptr:
                raise EngineFailure("llama.cpp returned no logits for a requested position")
            out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64))

        self._decode_stream(
            tokens, np.arange(start, start + n, dtype=np.int32), np.zeros(n, np.int32), want, keep
        )
        return out[0]

    def _piece_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of a token (without ``special``, control tokens render as nothing).

        llama.cpp indexes its token table unchecked (``std::out_of_range`` across ctypes aborts
        the process), so an id outside ``[0, n_vocab)`` is "" here and never reaches it.
        """
        if not 0 <= token < self.n_vocab:
            return b""
        with self._tok_lock:
            self._check_open()
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[: max(n, 0)]


@dataclass(frozen=True)
class Generation:
    """The outcome of ``Engine.generate``."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (end of generation or a stop string), "length", "cancelled"
    prefill_s: float
    decode_s: float


def _sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = logits / temperature
        probs = np.exp(scaled - scaled.max())
    if not np.all(np.isfinite(probs)):  # a temperature so small that it overflows: greedy
        return int(np.argmax(logits))
    if top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, top_p * cumulative[-1])) + 1]
        weights = np.cumsum(probs[keep])
        return int(keep[np.searchsorted(weights, rng.random() * weights[-1], side="right")])
    cumulative = np.cumsum(probs)
    pick = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(pick, len(probs) - 1)


def _stop_index(text: str, stops: list[str], since: int) -> int | None:
    """Where the earliest stop string starts in ``text`` (searching only what is new), if any."""
    found = [i for s in stops if s and (i := text.find(s, max(0, since - len(s) + 1))) != -1]
    return min(found) if found else None


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could still become a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


def _decision_error(exc: Exception) -> ArbiterError:
    """Any failure while scoring one decision, as that decision's typed error."""
    if isinstance(exc, ArbiterError):
        return exc
    if isinstance(exc, UnicodeError):
        return InvalidDecision(f"the text is not valid Unicode: {exc}", code="invalid_text")
    log.error("decision_failed", error=repr(exc), exc_info=exc)
    return EngineFailure(f"this decision could not be scored ({type(exc).__name__}); see the log")


def open_engine(settings: EngineSettings | None = None, model: Path | None = None) -> Engine:
    """Build an engine from the environment (or the given settings), optionally forcing a model."""
    settings = settings or EngineSettings()
    if model is not None:
        settings = settings.model_copy(update={"model": model})
    return Engine(settings)
