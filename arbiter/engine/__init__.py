"""The decision engine: one llama.cpp model and context, scoring decisions and generating text.

A decision is read from one forward pass. The prompt is prefilled with logits requested at the final
position only; the logits of the option-letter tokens there, through a softmax, are the probabilities.
Above 26 options, the options' codes span two tokens: one more decode of the codes' first tokens, as
branches, gives the second factor of each code's probability (``labels``).
``Engine`` is the facade every entry point uses: it owns the model's lifetime and the lock that
serializes every use of the context. The work is done by one module per concern:

- ``llama``: the model and its context through the C API (load, decode, KV cache, save and
  restore), ``vocabulary``: its tokens (tokenize, token pieces);
- ``preparing``: decisions checked (from bytes first, ``cost``) and tokenized, grouped by state;
- ``scoring``: the shared prefix, branches, readout, results; ``budget``: what a request may
  spend, and the cancellation of work nobody waits for;
- ``labels``: the option labels (letters, codes) and the option logits read from them;
- ``generation``: chat and text completions, over ``sampler`` (llama.cpp's sampler chain and
  grammars), ``sampling`` (parameters, choices, log-probabilities) and ``grammar`` (JSON schemas
  as GBNF); ``prefix_cache``: saved prefixes; ``ordering``: option orders;
  ``calibration``: fitted temperatures; ``probabilities``: log-sum-exp and softmax;
- ``backends``: llama.cpp's process-wide set-up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from arbiter import prompt as prompts
from arbiter.engine import multilabel, ordering, read_check, rotation
from arbiter.engine.budget import Budget
from arbiter.engine.calibration import Calibration, describe, load_calibration
from arbiter.engine.cost import CostFloor
from arbiter.engine.finishing import Finisher
from arbiter.engine.generation import GenerationRequest, generate
from arbiter.engine.llama import LLAMA_CPP_BUILD, LLAMA_CPP_PYTHON_VERSION, Llama
from arbiter.engine.prefix_cache import PrefixCache
from arbiter.engine.probabilities import logsumexp
from arbiter.engine.prompting import open_prompts, reference_prompts
from arbiter.engine.rotation import DEFAULT_MARGIN, ReadPolicy
from arbiter.engine.sampler import Grammar
from arbiter.engine.sampling import Choice, Generation, OnDelta, SamplingParams, TokenLogprob
from arbiter.engine.scoring import Scoring, context_sequences
from arbiter.errors import ContextLengthExceeded, InvalidDecision, LoadCancelled
from arbiter.logging import get_logger
from arbiter.lora import resolve_adapters, weights_id
from arbiter.models import BUNDLED_NOTICE, ResolvedModel, require_weights, resolve_model, verify
from arbiter.profiles import resolve_profile
from arbiter.schema import AdapterInfo, DecisionRequest, ModelInfo
from arbiter.scorer import Outcome
from arbiter.settings import EngineSettings, engine_from_environment

__all__ = [
    "Budget",
    "Choice",
    "Engine",
    "Generation",
    "Outcome",
    "SamplingParams",
    "TokenLogprob",
    "check_files",
    "open_engine",
]


log = get_logger("arbiter.engine")


Progress = Callable[[str, dict[str, Any]], None]


def _quiet(event: str, fields: dict[str, Any]) -> None:
    return None


class Engine:
    """Scores decisions with one llama.cpp model and context. Thread-safe: calls are serialized."""

    def __init__(
        self,
        settings: EngineSettings,
        resolved: ResolvedModel | None = None,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        """``progress`` is told each step of the load as it starts (a server logs them: a 1.5B
        model's checksum, load and read check take tens of seconds that passed in silence); a
        command that loads and answers once stays quiet, its refusals one line. ``cancel``, set
        from another thread, stops the load within a fraction of a second (``LoadCancelled``):
        a server stopped while it loads does not wait for the load to finish."""
        say = progress or _quiet
        self.resolved = resolved or resolve_model(settings.model, settings.model_dir)
        if self.resolved.source == "bundled":
            log.warning("bundled_model", notice=BUNDLED_NOTICE)
        # Checked against the model's tensors before llama.cpp loads anything.
        self.adapters = resolve_adapters(settings.lora, self.resolved, settings.model_dir)
        self.profile = resolve_profile(settings.prompt_profile, self.resolved)  # a bad one: at once
        started = time.perf_counter()
        say(
            "model_loading",
            {
                "model": self.resolved.path.name,
                "mb": round(self.resolved.path.stat().st_size / 1e6, 1),
            },
        )
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
            self.model_info = self._model_info(settings)
            self.calibration = load_calibration(
                settings, self.sha256, self.resolved, self.profile.sha256
            )
            say("model_weights_loaded", {"seconds": round(time.perf_counter() - started, 2)})
            LoadCancelled.check(cancel)
        except BaseException:
            self.llama.close()  # a model refused part-way through loading frees what it had
            raise
        self.settings = settings  # read at each call: a replaced one takes effect at once
        self.cache = PrefixCache(int(settings.prefix_cache_mb * 1024 * 1024))
        self._scoring = Scoring(
            llama,
            self.prompts,
            self.labels,
            weights_id(self.sha256, self.adapters),
            self.model_info,
            self.cost,
        )
        try:  # the probes read where every decision is read, through the same path
            say("read_check_started", {"mode": settings.read_check})
            self.read_check = read_check.run(
                self.resolved.path.name,
                self._probing(settings, cancel),
                settings.read_check,
                settings.read_check_min_mass,
                settings.read_check_min_ratio,
            )
        except BaseException:
            self.llama.close()
            raise
        self.llama.loaded()
        self.cache.clear()  # the probes' state is nobody's

    def _probing(
        self, settings: EngineSettings, cancel: threading.Event | None
    ) -> read_check.Probing:
        """The read check's ways to score: the served path, and the plain built-in prompt on the
        same weights as its reference (none where the served prompt is that one). Probes the
        load's cancel cut short raise ``LoadCancelled``: no verdict on the model."""
        reference: read_check.Score | None = None
        plain = None
        if self.prompts.layout.chat or not self.profile.builtin:
            plain = reference_prompts(self.llama)
        if plain is not None:
            scoring = Scoring(
                self.llama, plain, plain.labels, "reference", self.model_info, self.cost
            )

            def score_plain(probes: Sequence[DecisionRequest]) -> list[Outcome]:
                with self._lock:
                    outcomes = scoring.score(probes, self.settings, self.cache)
                LoadCancelled.check(cancel)
                return outcomes

            reference = score_plain

        def score(probes: Sequence[DecisionRequest]) -> list[Outcome]:
            outcomes = self.score(probes)
            LoadCancelled.check(cancel)
            return outcomes

        return read_check.Probing(score, self.labels.texts(2), reference, self._next_tokens)

    def _next_tokens(self, request: DecisionRequest, k: int = 8) -> list[tuple[str, float]]:
        """The ``k`` likeliest next tokens where ``request`` is read, with their probabilities
        (the read check's diagnosis of a failure: one more prefill, at load only)."""
        tokens = self.prompt_tokens(request)
        with self.session() as llama:
            row = llama.last_logits(tokens, 0)
        probabilities = np.exp(row - logsumexp(row))
        top = np.argsort(probabilities)[::-1][:k]
        return [(self.piece(int(t)), float(probabilities[t])) for t in top]

    @property
    def n_ctx(self) -> int:
        return self.llama.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.llama.n_vocab

    @property
    def layout(self) -> prompts.PromptLayout:
        return self.prompts.layout

    @property
    def seconds_per_token(self) -> float | None:
        """Measured decode speed (a moving average; None before the first decision)."""
        return self._scoring.speed.seconds_per_token

    def _model_info(self, settings: EngineSettings) -> ModelInfo:
        return ModelInfo(
            file=self.resolved.path.name,
            bytes=self.resolved.path.stat().st_size,
            sha256=self.sha256,
            architecture=self.llama.meta("general.architecture") or "unknown",
            quantization=self.llama.quantization(),
            description=self.llama.description(),
            context_tokens=self.llama.n_ctx,
            threads=settings.n_threads,
            n_gpu_layers=settings.n_gpu_layers,
            chat_template=self.prompts.layout.chat,
            llama_cpp_python_version=LLAMA_CPP_PYTHON_VERSION,
            llama_cpp_build=LLAMA_CPP_BUILD,
            prompt_profile=self.profile.name,
            prompt_profile_sha256=self.profile.sha256,
            adapters=[
                AdapterInfo(file=a.path.name, bytes=a.bytes, sha256=a.sha256, scale=a.scale)
                for a in self.adapters
            ],
        )

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
        """Tokens of a rendered chat prompt given as (text, is_template) pieces, in order.

        Template text is tokenized with special-token parsing; caller text without it, so a
        message can never inject a control token. Each piece after the first is tokenized where
        it follows the one before (``Vocabulary.tokenize``'s ``after``: no space prefix of its own).
        BOS is added if the model wants one and the template did not write it.
        """
        llama = self.llama
        parts: list[np.ndarray] = []
        after: int | None = None
        for text, special in segments:
            if text:
                parts.append(llama.vocab.tokenize(text, special=special, after=after))
                after = int(parts[-1][-1]) if len(parts[-1]) else after
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        if llama.vocab.add_bos and (len(tokens) == 0 or tokens[0] != llama.vocab.bos):
            tokens = np.concatenate([np.array([llama.vocab.bos], dtype=np.int32), tokens])
        return tokens.astype(np.int32)

    # -- decisions ---------------------------------------------------------------------------------

    def score(
        self, decisions: Sequence[DecisionRequest], budget: Budget | None = None
    ) -> list[Outcome]:
        """Score decisions in any mix of states; outcomes come back in input order.

        A decision that cannot be scored (too many options, too long, text that is not Unicode,
        non-finite logits, any other failure of its own) becomes its typed error in its slot; the
        others are scored regardless. ``order_samples`` expands a decision into several option
        orders over its state (``ordering``); a calibration file sets the temperature of
        decisions that set none (``calibration``). ``budget``: the request's limits, checked
        before anything is decoded, and its cancellation, checked between decodes (``budget``).
        Raises only for the whole call: the engine is closed, the request is over its budget,
        or its client went away (``RequestCancelled``).
        """
        settings = self.settings
        questions, labels_plan = multilabel.expand(decisions)
        policy = self.read_policy(settings)
        expanded, plan = ordering.expand(rotation.canonical_requests(questions, policy))
        with self._lock:
            self.llama.check_open()
            if budget is not None:
                budget.start()
            with self.llama.interruptible(budget.interrupt if budget is not None else None):
                outcomes = self._scoring.score(expanded, settings, self.cache, budget, policy)
        merged = [
            rotation.as_given(d, o)
            for d, o in zip(
                questions,
                ordering.merge(questions, outcomes, plan, settings.temperature),
                strict=True,
            )
        ]
        finisher = Finisher(
            self.calibration,
            self.order_policy(settings),
            settings.max_error,
            settings.min_confidence,
        )
        finished = [finisher.finish(d, o) for d, o in zip(questions, merged, strict=True)]
        return multilabel.merge(decisions, finished, labels_plan)

    def calibration_info(self) -> dict[str, object]:
        """The served calibration as clients see it (``calibration.describe``)."""
        return describe(self.calibration, self.order_policy(self.settings))

    def order_policy(self, settings: EngineSettings) -> str:
        """The read policy served: ``ARBITER_ORDER_POLICY``, except that a profile's own labels
        mean something next to the question ("yes: it is urgent"), so its options are never
        shown reordered: read once, in the given order (``Profile.positional_labels``)."""
        return settings.order_policy if self.profile.positional_labels else "single"

    def read_policy(self, settings: EngineSettings) -> ReadPolicy:
        """How decisions are read under ``settings``: adaptive rotation or the given order, with
        the calibration's position prior and margin (``rotation``)."""
        calibration = self.calibration
        margin = settings.order_margin
        if margin is None:
            margin = calibration.margin if calibration is not None else DEFAULT_MARGIN
        return ReadPolicy(
            adaptive=self.order_policy(settings) == "adaptive",
            margin=margin,
            prior=calibration.position_prior if calibration is not None else {},
        )

    # -- text generation (chat and text completions) ---------------------------------------------

    def generate(
        self,
        tokens: np.ndarray,
        *,
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        n: int = 1,
        top_logprobs: int | None = None,
        on_delta: OnDelta | None = None,
        budget: Budget | None = None,
    ) -> Generation:
        """Generate ``n`` choices after ``tokens``, the prompt prefilled once for all of them,
        through llama.cpp's sampler chain (``sampling``; greedy at temperature 0).

        ``top_logprobs`` (0-20) adds each token's log-probability and that many alternatives.
        ``on_delta`` receives each choice's text as it becomes final (``generation``); returning
        False stops the generation (finish reason ``cancelled``); a ``budget`` stops it between
        two decodes (its client went away, or its time is spent). Blocking; serialized with
        scoring.
        """
        sampling = sampling or SamplingParams()
        if not 1 <= n <= self.llama.n_seq_max:
            raise InvalidDecision(
                f"n is {n}; this context generates 1 to {self.llama.n_seq_max} choices",
                param="n",
                code="invalid_field",
            )
        if len(tokens) >= self.n_ctx:
            raise ContextLengthExceeded(
                f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx} tokens",
                param="messages",
            )
        # The choices share the prompt's cells; each needs its own for what it generates.
        limit = min(max_tokens, (self.n_ctx - len(tokens)) // n)
        if limit < 1:
            raise ContextLengthExceeded(
                f"the prompt is {len(tokens)} tokens; {n} choices need at least {n} more and the "
                f"context holds {self.n_ctx} tokens",
                param="n",
            )
        request = GenerationRequest(limit, sampling, tuple(stop), n, top_logprobs)
        check = budget.interrupt if budget is not None else None
        with self.session() as llama, llama.interruptible(check):
            if budget is not None:
                budget.start()
            grammar = None
            if sampling.grammar is not None:
                with llama.vocab.vocabulary() as vocab:
                    grammar = Grammar(vocab, sampling.grammar)
            try:
                return generate(llama, tokens, request, grammar, on_delta)
            finally:
                if grammar is not None:
                    grammar.close()

    def check_grammar(self, text: str, param: str = "grammar") -> None:
        """Raise ``InvalidGrammar`` (naming ``param``) for a GBNF grammar llama.cpp cannot use;
        callers check before a response starts, so a bad grammar is a 4xx, never a broken
        stream. Needs the vocabulary only: runs outside the engine lock."""
        with self.llama.vocab.vocabulary() as vocab:
            Grammar(vocab, text, param=param).close()


def check_files(settings: EngineSettings) -> ResolvedModel:
    """What loading an engine of ``settings`` would refuse about its files (the model, its
    adapters, its prompt profile, its calibration), found without llama.cpp: a server checks
    before it binds its port, a pool before it spawns its workers."""
    resolved = resolve_model(settings.model, settings.model_dir)
    require_weights(resolved.path)
    resolve_adapters(settings.lora, resolved, settings.model_dir)
    resolve_profile(settings.prompt_profile, resolved)
    if settings.calibration is not None:
        Calibration.load(settings.calibration)
    return resolved


def open_engine(
    settings: EngineSettings | None = None,
    model: Path | None = None,
    profile: str | None = None,
    cancel: threading.Event | None = None,
) -> Engine:
    """Build an engine from the environment as ``arbiter serve`` reads it (``SM_LLAMA_CPP_*``
    below ``ARBITER_*``), or from the given settings, optionally forcing a model or a profile;
    ``cancel`` stops its load (``Engine``)."""
    settings = settings or engine_from_environment()
    if model is not None:
        settings = settings.model_copy(update={"model": model})
    if profile is not None:
        settings = settings.model_copy(update={"prompt_profile": profile})
    return Engine(settings, cancel=cancel)
