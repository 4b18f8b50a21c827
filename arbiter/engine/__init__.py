"""The decision engine: one llama.cpp model and context, scoring decisions and generating text.

A decision is read from one forward pass. The prompt is prefilled with logits requested at the final
position only; the logits of the option-letter tokens there, through a softmax, are the probabilities.
Above 26 options, the options' codes span two tokens: one more decode of the codes' first tokens, as
branches, gives the second factor of each code's probability (``labels``).
``Engine`` is the facade every entry point uses; ``open_engine`` builds one in two timed steps,
the load and the read check. The work is done by one module per concern:

- ``model_files``: the files an engine loads, found and checked without llama.cpp;
  ``loaded``: the model loaded (its lifetime, its prompts and tokens, the lock that serializes
  every use of the context); ``read_check``: what the load is checked with before serving;
- ``llama``: the model and its context through the C API (load, adapters, metadata), with
  ``decoding`` (decode, logits where read) and ``kv_memory`` (KV cache, save and restore) as its
  parts; ``vocabulary``: its tokens (tokenize, token pieces);
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
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from arbiter.engine import multilabel, ordering, read_check, rotation
from arbiter.engine.budget import Budget
from arbiter.engine.calibration import describe
from arbiter.engine.finishing import Finisher
from arbiter.engine.generation import generate, request_for
from arbiter.engine.loaded import LoadedModel, Progress, quiet
from arbiter.engine.model_files import ModelFiles, check_files
from arbiter.engine.prefix_cache import PrefixCache
from arbiter.engine.probabilities import logsumexp
from arbiter.engine.prompting import reference_prompts
from arbiter.engine.rotation import DEFAULT_MARGIN, ReadPolicy
from arbiter.engine.sampling import Choice, Generation, OnDelta, SamplingParams, TokenLogprob
from arbiter.engine.scoring import Scoring
from arbiter.errors import LoadCancelled
from arbiter.lora import weights_id
from arbiter.schema import DecisionRequest
from arbiter.scorer import Outcome
from arbiter.settings import EngineSettings, engine_from_environment

__all__ = [
    "Budget",
    "Choice",
    "Engine",
    "Generation",
    "ModelFiles",
    "Outcome",
    "SamplingParams",
    "TokenLogprob",
    "check_files",
    "open_engine",
]


class Engine(LoadedModel):
    """Scores decisions and generates text with one loaded model. Thread-safe: calls are
    serialized."""

    def __init__(
        self,
        settings: EngineSettings,
        files: ModelFiles | None = None,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        """Load ``files`` (``LoadedModel``; ``cancel`` stops the load, and the read check that
        follows it); the read check is a step of its own (:meth:`check_reads`; ``open_engine``
        runs both)."""
        super().__init__(settings, files, progress, cancel)
        self._load_cancel = cancel
        self.cache = PrefixCache(int(settings.prefix_cache_mb * 1024 * 1024))
        self._scoring = Scoring(
            self.llama,
            self.prompts,
            self.labels,
            weights_id(self.sha256, self.adapters),
            self.model_info,
            self.cost,
        )
        self.read_check: read_check.ReadCheck | None = None  # measured by check_reads

    def check_reads(self, progress: Progress | None = None) -> read_check.ReadCheck:
        """The read check (``read_check``), timed: probes scored where every decision is read,
        through the same path, their label mass judged; ``ReadCheckRefused`` in mode ``refuse``.
        The caller closes an engine it refuses (``open_engine`` does). Once it has run, the
        load's cancel no longer stops a decode (``Llama.loaded``)."""
        settings = self.settings
        (progress or quiet)("read_check_started", {"mode": settings.read_check})
        self.read_check = read_check.run(
            self.resolved.path.name,
            self._probing(self._load_cancel),
            settings.read_check,
            settings.read_check_min_mass,
            settings.read_check_min_ratio,
        )
        self.llama.loaded()
        self.cache.clear()  # the probes' state is nobody's
        return self.read_check

    def _probing(self, cancel: threading.Event | None) -> read_check.Probing:
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
    def seconds_per_token(self) -> float | None:
        """Measured decode speed (a moving average; None before the first decision)."""
        return self._scoring.speed.seconds_per_token

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
        request = request_for(
            len(tokens), self.llama, max_tokens, sampling or SamplingParams(), stop, n, top_logprobs
        )
        check = budget.interrupt if budget is not None else None
        with self.session() as llama, llama.interruptible(check):
            if budget is not None:
                budget.start()
            return generate(llama, tokens, request, on_delta)


def open_engine(
    settings: EngineSettings | None = None,
    model: Path | None = None,
    profile: str | None = None,
    *,
    files: ModelFiles | None = None,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> Engine:
    """An engine loaded and read-checked, as every entry point serves one: from the environment
    as ``arbiter serve`` reads it (``SM_LLAMA_CPP_*`` below ``ARBITER_*``), or from the given
    settings, optionally forcing a model or a profile; ``files``: the ones already checked;
    ``cancel`` stops the load and its read check (``Engine``)."""
    settings = settings or engine_from_environment()
    if model is not None:
        settings = settings.model_copy(update={"model": model})
    if profile is not None:
        settings = settings.model_copy(update={"prompt_profile": profile})
    engine = Engine(settings, files, progress, cancel)
    try:
        engine.check_reads(progress)
    except BaseException:
        engine.close()  # a refused model frees what it loaded
        raise
    return engine
