"""A model loaded for decisions and text: its weights and context (``llama``), the prompts its
profile renders (``prompting``), its calibration, and the lock that serializes every use of the
context. ``Engine`` builds on it; the load is timed step by step for a server's log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from arbiter import prompt as prompts
from arbiter.engine.calibration import load_calibration
from arbiter.engine.cost import CostFloor
from arbiter.engine.llama import LLAMA_CPP_BUILD, LLAMA_CPP_PYTHON_VERSION, Llama
from arbiter.engine.model_files import ModelFiles, check_files
from arbiter.engine.prompting import open_prompts
from arbiter.engine.sampler import Grammar
from arbiter.engine.scoring import context_sequences
from arbiter.errors import LoadCancelled
from arbiter.logging import get_logger
from arbiter.models import BUNDLED_NOTICE, verify
from arbiter.schema import AdapterInfo, DecisionRequest, ModelInfo
from arbiter.settings import EngineSettings

log = get_logger("arbiter.engine")

# Told each step of a load (or of the read check) as it starts: (event, fields).
Progress = Callable[[str, dict[str, Any]], None]


def quiet(event: str, fields: dict[str, Any]) -> None:
    return None


class LoadedModel:
    """One model and context, loaded; thread-safe: what uses the context holds its lock."""

    def __init__(
        self,
        settings: EngineSettings,
        files: ModelFiles | None = None,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        """Load ``files`` under ``settings`` (``check_files(settings)`` when not given; a server
        passes the files it checked before binding its port). ``progress`` is told each step as
        it starts (a server logs them: a 1.5B model's checksum and load take seconds that would
        pass in silence); a command that loads and answers once stays quiet. ``cancel``, set
        from another thread, stops the load within a fraction of a second (``LoadCancelled``):
        a server stopped while it loads does not wait for the load to finish."""
        say = progress or quiet
        files = files or check_files(settings)
        self.resolved, self.profile = files.model, files.profile
        self.adapters = list(files.adapters)
        if self.resolved.source == "bundled":
            log.warning("bundled_model", notice=BUNDLED_NOTICE)
        started = time.perf_counter()
        size_mb = round(self.resolved.path.stat().st_size / 1e6, 1)
        say("model_loading", {"model": self.resolved.path.name, "mb": size_mb})
        self.sha256 = verify(self.resolved, cancel)
        # Serializes everything that uses the context; tokenizing runs outside it (chat prompts
        # are tokenized in their admission slot) under the model's own lock.
        self._lock = threading.Lock()
        self.llama = Llama(self.resolved.path, settings, cancel=cancel)
        try:
            llama = self.llama
            self.bos_text = llama.vocab.piece_text(llama.vocab.bos)  # "" for a model without one
            self.eos_text = llama.vocab.piece_text(llama.vocab.eos)
            self.chat_template = llama.chat_template
            self.prompts = open_prompts(llama, settings, self.profile)
            self.labels = self.prompts.labels
            LoadCancelled.check(cancel)
            llama.open_context(settings, context_sequences(settings, self.labels))
            LoadCancelled.check(cancel)
            llama.load_adapters([(a.path, a.scale) for a in self.adapters])
            head_tokens, tail_tokens = self.prompts.fewest_around()
            self.cost = CostFloor(
                n_ctx=llama.n_ctx,
                max_piece=llama.vocab.max_piece_bytes(),
                head_tokens=head_tokens,
                tail_tokens=tail_tokens,
            )
            self.model_info = model_info(llama, files, self.sha256, settings, self.prompts.layout)
            self.calibration = load_calibration(
                settings, self.sha256, self.resolved, self.profile.sha256
            )
            say("model_weights_loaded", {"seconds": round(time.perf_counter() - started, 2)})
            LoadCancelled.check(cancel)
        except BaseException:
            self.llama.close()  # a model refused part-way through loading frees what it had
            raise
        self.settings = settings  # read at each call: a replaced one takes effect at once

    @property
    def n_ctx(self) -> int:
        return self.llama.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.llama.n_vocab

    @property
    def layout(self) -> prompts.PromptLayout:
        return self.prompts.layout

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context and model once no call is using them; later calls get EngineFailure."""
        with self._lock:
            self.llama.close()

    @contextmanager
    def session(self) -> Iterator[Llama]:
        """The context, held exclusively, its KV cache empty on entry and emptied on exit (for
        generation and for measurements that decode on it directly)."""
        with self._lock:
            self.llama.check_open()
            with self.llama.kv_cleared():
                yield self.llama

    # -- tokens ------------------------------------------------------------------------------------

    def tokenize_content(self, text: str) -> np.ndarray:
        """Tokens of caller-written text: special-token text stays plain text."""
        return self.llama.vocab.tokenize(text, special=False)

    def piece(self, token: int) -> str:
        """The text of one token ("" for an id outside the vocabulary, e.g. a missing BOS)."""
        return self.llama.vocab.piece_text(token)

    def is_control(self, token: int) -> bool:
        return self.llama.vocab.is_control(token)

    def prompt_tokens(self, request: DecisionRequest) -> np.ndarray:
        """The full prompt of one decision, as scored."""
        return self.prompts.tokens(self.prompts.render(request))

    def render_text(self, request: DecisionRequest) -> str:
        return self.prompts.text(request)

    def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> np.ndarray:
        """Tokens of a rendered chat prompt given as (text, is_template) pieces
        (``Vocabulary.encode_segments``: caller text can never inject a control token)."""
        return self.llama.vocab.encode_segments(segments)

    def check_grammar(self, text: str, param: str = "grammar") -> None:
        """Raise ``InvalidGrammar`` (naming ``param``) for a GBNF grammar llama.cpp cannot use;
        callers check before a response starts, so a bad grammar is a 4xx, never a broken
        stream. Needs the vocabulary only: runs outside the engine lock."""
        with self.llama.vocab.vocabulary() as vocab:
            Grammar(vocab, text, param=param).close()


def model_info(
    llama: Llama,
    files: ModelFiles,
    sha256: str,
    settings: EngineSettings,
    layout: prompts.PromptLayout,
) -> ModelInfo:
    """What every result says of the model that read it."""
    return ModelInfo(
        file=files.model.path.name,
        bytes=files.model.path.stat().st_size,
        sha256=sha256,
        architecture=llama.meta("general.architecture") or "unknown",
        quantization=llama.quantization(),
        description=llama.description(),
        context_tokens=llama.n_ctx,
        threads=settings.n_threads,
        n_gpu_layers=settings.n_gpu_layers,
        chat_template=layout.chat,
        llama_cpp_python_version=LLAMA_CPP_PYTHON_VERSION,
        llama_cpp_build=LLAMA_CPP_BUILD,
        prompt_profile=files.profile.name,
        prompt_profile_sha256=files.profile.sha256,
        adapters=[
            AdapterInfo(file=a.path.name, bytes=a.bytes, sha256=a.sha256, scale=a.scale)
            for a in files.adapters
        ],
    )
