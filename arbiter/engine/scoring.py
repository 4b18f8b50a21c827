"""Scoring decisions on one llama context: grouped by state, one prefix, branches, readout.

Decisions over the same state are scored as branches of one prefilled prefix: the prefix lives in KV
sequence 0 (prefilled, or restored from the prefix cache), is copied (``llama_memory_seq_cp``) into
sequences 1..k, and each suffix (question and options) is decoded in its branch with logits at its
last token only. The option logits are read there (``labels``), then softmaxed into a result.

A question labelled with codes (more than 26 options) needs one more ``llama_decode``: its branch is
copied into one sequence per distinct code prefix (``labels.Paths``), the prefixes are decoded
together, each read at its last token, and the chain rule gives each code's probability.

A prompt is always prefilled the same way (the prefix, then the suffix on its own, then for codes the
code prefixes of that question alone, always the same batch for the same options), so a decision's
result does not depend on what else is in the request or on the cache (docs/decisions.md, Numerics).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from arbiter import prompt as prompts
from arbiter.engine.budget import Budget, Speed
from arbiter.engine.cost import CostFloor
from arbiter.engine.labels import Labels
from arbiter.engine.llama import Llama
from arbiter.engine.prefix_cache import PrefixCache, prefix_key
from arbiter.engine.preparing import Group, Prepared, Preparer, decision_error
from arbiter.engine.probabilities import softmax
from arbiter.engine.prompting import Prompts
from arbiter.engine.rotation import ReadPolicy, rounds
from arbiter.errors import EngineFailure, InvalidDecision, TimeBudgetExceeded
from arbiter.schema import DecisionRequest, DecisionResult, ModelInfo, PromptInfo, Timing
from arbiter.scorer import Outcome
from arbiter.settings import EngineSettings


@dataclass
class GroupRun:
    prefix_tokens: int
    cache: Literal["hit", "miss", "off"]
    prefill_s: float
    tail: bool = False  # sequence 0 holds a question's cells after the prefix (one pass)


def context_sequences(settings: EngineSettings, labels: Labels) -> int:
    """KV sequences the context needs: the prefix and its question branches, or the prefix, one
    question and the label branches of the largest question, whichever is more."""
    return max(settings.max_branches + 1, 2 + labels.max_branches)


class Scoring:
    """Scores decisions on one context. The caller holds the engine's lock and passes the
    settings and the prefix cache of the call (both may be swapped between calls)."""

    def __init__(
        self,
        llama: Llama,
        prompts_: Prompts,
        labels: Labels,
        weights_id: str,
        model_info: ModelInfo,
        cost: CostFloor,
    ) -> None:
        self.llama = llama
        self.prompts = prompts_
        self.labels = labels
        self.weights_id = weights_id  # the model and its adapters (``lora.weights_id``)
        self.model_info = model_info
        self.preparer = Preparer(prompts_, labels, cost)
        self.speed = Speed()  # seconds per decoded token, for the time budget's estimates

    def score(
        self,
        decisions: Sequence[DecisionRequest],
        settings: EngineSettings,
        cache: PrefixCache,
        budget: Budget | None = None,
        policy: ReadPolicy | None = None,
    ) -> list[Outcome]:
        """Outcomes in input order; a decision that cannot be scored gets its typed error.

        Every decision is tokenized first; with a ``budget``, the tokens the request would decode
        are checked against it before any is decoded, group by group as they are tokenized (a
        refusal raises for the whole call, and stops tokenizing once the request is over), and
        it is checked again before each group is decoded (``Budget.interrupt``)."""
        policy = policy or ReadPolicy(adaptive=False)
        outcomes: list[Outcome | None] = [None] * len(decisions)
        # One group per state and layout (questions with codes have an instruction of their own).
        members: dict[tuple[str, prompts.PromptLayout], list[tuple[int, DecisionRequest]]] = {}
        for i, request in enumerate(decisions):
            try:
                key = (
                    prompts.state_text(request.state),
                    self.prompts.layout_for(len(request.options)),
                )
                members.setdefault(key, []).append((i, request))
            except Exception as exc:  # a state that is not JSON (only without the schema)
                outcomes[i] = decision_error(exc)
        groups: list[Group] = []
        tokens = 0
        for (state, layout), group_members in members.items():
            group, errors = self.preparer.group(state, layout, group_members)
            for index, error in errors:
                outcomes[index] = error
            if group is not None:
                groups.append(group)
                tokens += group.tokens + _further_orders_tokens(group, policy)
                if budget is not None:  # over already: the rest is not tokenized
                    budget.check_tokens(tokens, None, floor=True)
        if budget is not None:
            budget.check_tokens(tokens, self.speed.seconds_per_token, floor=False)
        for group in groups:
            for index, outcome in self._score_group(group, settings, cache, budget, policy):
                outcomes[index] = outcome
        return [o if o is not None else EngineFailure("not scored") for o in outcomes]

    def _score_group(
        self,
        group: Group,
        settings: EngineSettings,
        cache: PrefixCache,
        budget: Budget | None,
        policy: ReadPolicy,
    ) -> list[tuple[int, Outcome]]:
        prepared = group.prepared
        try:
            if budget is not None:
                budget.interrupt()  # the client left, or the time is spent: not started
            with self.llama.kv_cleared():
                run = self._forward(prepared[0].tokens[: group.shared], prepared, settings, cache)
                for p in prepared:
                    p.keep_read()
                self._more_orders(group, run, settings, policy, budget)
        except Exception as exc:  # the group's shared prefill failed: each member says so
            error = decision_error(exc)
            return [(p.index, error) for p in prepared]
        self.speed.observe(
            group.tokens - (group.shared if run.cache == "hit" else 0), run.prefill_s
        )
        results: list[tuple[int, Outcome]] = []
        for p in prepared:
            try:
                temperature = p.request.temperature or settings.temperature
                results.append(
                    (p.index, self._result(p, run, group.tokenize_s, temperature, policy))
                )
            except Exception as exc:
                results.append((p.index, decision_error(exc)))
        return results

    def _forward(
        self,
        prefix: np.ndarray,
        prepared: list[Prepared],
        settings: EngineSettings,
        cache: PrefixCache,
    ) -> GroupRun:
        """Prefill (or restore) the prefix in sequence 0, then decode the suffixes as branches."""
        started = time.perf_counter()
        n_prefix = len(prefix)
        one_pass = settings.parallel_branches and len(prepared) == 1
        cache_state: Literal["hit", "miss", "off"] = "off"
        key = None
        if cache.enabled:
            key = prefix_key(self.weights_id, prefix)
            saved = cache.get(key)
            if saved is not None and self.llama.restore(saved):
                cache_state = "hit"
            else:
                if saved is not None:
                    # A failed restore can leave part of the state behind: the prefill must start
                    # from an empty sequence 0, as a cold run does.
                    self.llama.remove(0)
                cache_state = "miss"
        if one_pass and cache_state != "hit":
            self._one_pass(prepared[0])
            # The cache keeps the state's cells alone: the rest of sequence 0 is dropped (a model
            # whose memory cannot drop a tail, a recurrent one, is not cached).
            tail = True
            if key is not None and self.llama.remove(0, n_prefix, -1):
                tail = False
                self._keep(cache, key)
            return GroupRun(n_prefix, cache_state, time.perf_counter() - started, tail)
        if cache_state != "hit":
            self.llama.prefill(prefix)
            if key is not None:
                self._keep(cache, key)
        self._decode_members(n_prefix, prepared, settings)
        return GroupRun(n_prefix, cache_state, time.perf_counter() - started)

    def _decode_members(
        self, n_prefix: int, prepared: Sequence[Prepared], settings: EngineSettings
    ) -> None:
        """Each member's suffix decoded as a branch of the prefix in sequence 0, in chunks that
        fit the context's cells and sequences."""
        budget = self.llama.n_ctx - n_prefix
        chunk: list[Prepared] = []
        used = 0
        labels = 0  # the most label branches of a chunk member, decoded after the chunk
        per_decode = settings.max_branches if settings.parallel_branches else 1
        for p in prepared:
            # A member's cells: its suffix, and its label branches while they are decoded.
            cells = len(p.tokens) - n_prefix + p.label_cells
            full = len(chunk) == per_decode or (
                len(chunk) + 1 + max(labels, p.label_branches) > self.llama.n_seq_max - 1
            )
            if chunk and (used + cells > budget or full):
                self._decode_branches(n_prefix, chunk)
                chunk, used, labels = [], 0, 0
            chunk.append(p)
            used += cells
            labels = max(labels, p.label_branches)
        self._decode_branches(n_prefix, chunk)

    def _more_orders(
        self,
        group: Group,
        run: GroupRun,
        settings: EngineSettings,
        policy: ReadPolicy,
        budget: Budget | None,
    ) -> None:
        """Further orders of the decisions whose leader is unclear (``rotation``), read round by
        round as branches of the prefix still in sequence 0."""
        pending = [p for p in group.prepared if p.request.order_samples is None]
        prefix = group.prepared[0].tokens[: group.shared]
        while pending:
            variants: list[Prepared] = []
            for p in pending:
                for order in policy.next_orders(len(p.request.options), p.reads):
                    variant = self.preparer.variant(p, order, group)
                    if variant is not None:
                        variants.append(variant)
            if not variants:
                return
            started = time.perf_counter()
            try:
                if budget is not None:
                    budget.interrupt()
                if run.tail and not self.llama.remove(0, run.prefix_tokens, -1):
                    # A memory that cannot drop a tail (a recurrent model): the prefix again.
                    self.llama.remove(0)
                    self.llama.prefill(prefix)
                run.tail = False
                self._decode_members(run.prefix_tokens, variants, settings)
            except TimeBudgetExceeded:
                return  # out of time: each decision keeps the orders it has read
            share = (time.perf_counter() - started) / len(variants)
            for variant in variants:
                variant.keep_read()
                assert variant.parent is not None
                variant.parent.extra_s += share
                variant.parent.extra_tokens += len(variant.tokens) - run.prefix_tokens
            pending = list({id(v.parent): v.parent for v in variants if v.parent}.values())

    def _keep(self, cache: PrefixCache, key: str) -> None:
        """Sequence 0 (the state's cells alone) into the cache, if it fits."""
        state = self.llama.save(cache.limit_bytes)
        if state is not None:
            cache.put(key, state)

    def _one_pass(self, p: Prepared) -> None:
        """A question alone, its state not cached, prefilled with its state in one decode in
        sequence 0 (``parallel_branches``: ~6% less time on a CPU than the prefix then the suffix,
        at the price of the batch-shape invariance; docs/decisions.md, Numerics)."""
        self._decode_runs([p.tokens], 0, np.zeros(1, dtype=np.int32), lambda _, b: self._read(p, b))
        if p.readout is not None:
            self._decode_codes(p, 0, 1)

    def _decode_branches(self, n_prefix: int, chunk: list[Prepared]) -> None:
        seq_ids = np.arange(1, len(chunk) + 1, dtype=np.int32)
        for seq in seq_ids:
            self.llama.copy_sequence(0, int(seq))
        self._decode_runs(
            [p.tokens[n_prefix:] for p in chunk],
            n_prefix,
            seq_ids,
            lambda k, batch_index: self._read(chunk[k], batch_index),
        )
        free = len(chunk) + 1  # the first sequence id no branch of this chunk uses
        for p, branch in zip(chunk, seq_ids.tolist(), strict=True):
            if p.readout is not None:
                self._decode_codes(p, branch, free)
        for seq in seq_ids:
            self.llama.remove(int(seq))

    def _decode_runs(
        self,
        runs: Sequence[np.ndarray],
        start: int,
        seq_ids: np.ndarray,
        on_run: Callable[[int, int], None],
    ) -> None:
        """One ``llama_decode`` of token runs, run ``k`` continuing sequence ``seq_ids[k]`` from
        position ``start``, with logits only at each run's last token: ``on_run(k, batch_index)``
        reads them (the question branches after the prefix, and the code prefixes after a prompt)."""
        lengths = np.array([len(run) for run in runs])
        tokens = np.concatenate(runs)
        pos = np.concatenate([np.arange(start, start + n) for n in lengths]).astype(np.int32)
        want = np.zeros(len(tokens), dtype=np.int8)
        last = np.cumsum(lengths) - 1
        want[last] = 1
        run_at = {stream: k for k, stream in enumerate(last.tolist())}
        self.llama.decode(
            tokens,
            pos,
            np.repeat(seq_ids, lengths),
            want,
            lambda stream, batch_index: on_run(run_at[stream], batch_index),
        )

    def _read(self, p: Prepared, batch_index: int) -> None:
        started = time.perf_counter()
        row = self.llama.logits(batch_index)
        if p.paths is None:
            p.logits, p.full_lse = self.labels.read(row, len(p.request.options))
        else:
            p.readout = p.paths.readout()
            p.readout.take(0, row)
        p.readout_s = time.perf_counter() - started

    def _decode_codes(self, p: Prepared, seq: int, free: int) -> None:
        """The second (and later) factors of each code: every distinct code prefix decoded as a
        branch of the question's own sequence ``seq``, in one ``llama_decode``, read at its end.

        The batch depends only on the question's option count, never on its neighbours."""
        started = time.perf_counter()
        paths, readout = p.paths, p.readout
        assert paths is not None and readout is not None
        branches = paths.branches
        seq_ids = np.arange(free, free + len(branches), dtype=np.int32)
        for branch_seq in seq_ids.tolist():
            self.llama.copy_sequence(seq, branch_seq)
        try:
            self._decode_runs(
                [np.asarray(b, dtype=np.int32) for b in branches],
                len(p.tokens),
                seq_ids,
                lambda k, batch: readout.take(k + 1, self.llama.logits(batch)),  # node 0: prompt
            )
        finally:
            for branch_seq in seq_ids.tolist():
                self.llama.remove(branch_seq)
        p.logits, p.full_lse = readout.option_logits(), 0.0  # log-probabilities already
        p.readout_s += time.perf_counter() - started

    def _result(
        self,
        p: Prepared,
        run: GroupRun,
        group_tokenize_s: float,
        temperature: float,
        policy: ReadPolicy,
    ) -> DecisionResult:
        request = p.request
        if not all(np.all(np.isfinite(r.logits)) and np.isfinite(r.full_lse) for r in p.reads):
            raise EngineFailure(
                "llama.cpp returned non-finite logits for this decision; it was not scored"
            )
        logits, allowed = policy.combine(p.reads)
        probs = softmax(logits, temperature)
        if not np.all(np.isfinite(probs)):
            raise InvalidDecision(
                f"temperature {temperature!r} makes the probabilities overflow; use a "
                "temperature of 0.01 or more",
                param="temperature",
            )
        option_ids = [o.id for o in request.options]
        tokenize_s = p.tokenize_s + group_tokenize_s
        return DecisionResult(
            id=request.id,
            option_ids=option_ids,
            probabilities=[float(x) for x in probs],
            option_logits=[float(x) for x in logits],
            choice=option_ids[int(np.argmax(probs))],
            allowed_mass=min(1.0, allowed),
            orders_read=len(p.reads),
            temperature=float(temperature),
            probability_status="raw",
            prefix_cache=run.cache,
            prompt=PromptInfo(
                sha256=p.prompt_sha256,
                version=p.prompt_version,
                input_tokens=len(p.tokens) + p.extra_tokens,
                prefix_tokens=run.prefix_tokens,
                profile=self.model_info.prompt_profile,
                profile_sha256=self.model_info.prompt_profile_sha256,
            ),
            timing=Timing(
                tokenize_s=tokenize_s,
                prefill_s=run.prefill_s + p.extra_s,
                readout_s=p.readout_s,
                total_s=tokenize_s + run.prefill_s + p.extra_s + p.readout_s,
            ),
            model=self.model_info,
        )


def _further_orders_tokens(group: Group, policy: ReadPolicy) -> int:
    """The most tokens adaptive rotation may add to a group (every unclear decision read in all
    its orders), counted in the request's budget before anything is decoded."""
    if not policy.adaptive:
        return 0
    extra = 0
    for p in group.prepared:
        if p.request.order_samples is not None:
            continue
        reads = min(policy.max_reads, sum(len(r) for r in rounds(len(p.request.options))))
        extra += (reads - 1) * (len(p.tokens) - group.shared + p.label_cells)
    return extra
