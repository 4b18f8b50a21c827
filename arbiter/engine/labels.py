"""Option labels: how the model reads the options, and the option logits read from its predictions.

Up to 26 options are labelled ``A``, ``B``, ... (``prompt.LETTERS``). At load, each letter must be one
token that round-trips through the vocabulary, in each spelling kept (``A`` and `` A``: the model may
predict either); a spelling is kept only if all 26 letters pass and stay distinct. Labels are
tokenized as the model writes them after the prompt's text (``Vocabulary.continued``): under a
SentencePiece space prefix (Llama 2, Mistral v0.1-v0.3, Phi-3, Baichuan) ``A`` alone is ``▁A`` and
`` A`` is ``▁``, ``▁A``: tokenized alone, no spelling would pass for such a model. An option's
logit is the log-sum-exp of its letter's kept spellings, the same way for every option.

From 27 to ``MAX_OPTIONS`` options, every option gets a **code** of a fixed number of characters
(``A0`` ... ``Z9``; see ``CANDIDATES``). A code spans several tokens, so its probability is read by the
chain rule: P(code) = P(t1 | prompt) x P(t2 | prompt, t1) x ... The first factor comes from the
prompt's last position, like a letter; the later ones from one extra ``llama_decode`` of the distinct
proper prefixes of the codes in use, each prefix a branch of its own (``Paths``). Codes of one length
form a prefix-free set whatever the tokenizer does (a token sequence that is a proper prefix of
another decodes to a shorter string), so "the reply starts with code c" are disjoint events and their
probabilities add up to at most 1 with no terminator to read. At load, the first candidate set that
tokenizes soundly in this vocabulary is chosen (every token round-trips, the sequences are distinct
and prefix-free across codes and spellings); a spelling is kept only if every code passes in it. An
option's logit is then the log-sum-exp over kept spellings of its code's chain-rule log-probability.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from arbiter.engine.llama import Llama
from arbiter.engine.probabilities import logsumexp
from arbiter.errors import LabelVocabularyError
from arbiter.prompt import LETTERS
from arbiter.schema import MAX_OPTIONS

SPELLINGS = ("", " ")  # the label alone, and after a space

# Candidate code sets, best first: a letter and a digit (two tokens in Gemma 3's and SmolLM2's
# vocabularies, both spellings, both split digits), then three digits (digits are single tokens in
# most vocabularies that split numbers).
CANDIDATES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("letter-digit", tuple(f"{letter}{digit}" for letter in LETTERS for digit in "0123456789")),
    ("three-digit", tuple(f"{i:03d}" for i in range(1000))),
)
# At most this many prefixes are decoded as branches for the largest question (a context sized for
# it holds one sequence and one output row per branch).
MAX_CODE_BRANCHES = 128

Tokenize = Callable[[str], Sequence[int]]
Piece = Callable[[int], bytes]


@dataclass(frozen=True)
class Paths:
    """How to read the codes of the first ``n_options`` labels: the branches to decode and, for each
    (option, spelling) path, the tokens whose conditional log-probabilities add up to its own.

    Node 0 is the prompt's last position; node ``k`` (1-based) is the end of ``branches[k - 1]``.
    """

    n_options: int
    n_spellings: int
    branches: tuple[tuple[int, ...], ...]
    step_node: np.ndarray  # per step: the node whose row is read
    step_token: np.ndarray  # per step: the token read there
    step_path: np.ndarray  # per step: its path (option * n_spellings + spelling)
    node_steps: tuple[np.ndarray, ...] = field(repr=False)  # per node: the steps read at it

    @property
    def n_nodes(self) -> int:
        return len(self.branches) + 1

    @property
    def cells(self) -> int:
        """KV cells the branches take on top of the prompt."""
        return sum(len(b) for b in self.branches)

    def readout(self) -> CodeReadout:
        return CodeReadout(self)


class CodeReadout:
    """Collects one row per node (as each decode makes it readable) and gives the option logits."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.node_lse = np.full(paths.n_nodes, np.nan)
        self.step_logit = np.full(len(paths.step_token), np.nan)

    def take(self, node: int, row: np.ndarray) -> None:
        """Keep what node ``node`` contributes, from its full-vocabulary logits row."""
        steps = self.paths.node_steps[node]
        self.step_logit[steps] = row[self.paths.step_token[steps]]
        self.node_lse[node] = float(logsumexp(row.astype(np.float64)))

    def option_logits(self) -> np.ndarray:
        """Per option: log of the summed chain-rule probability of its code's kept spellings."""
        p = self.paths
        terms = self.step_logit - self.node_lse[p.step_node]
        path_logp = np.bincount(p.step_path, weights=terms, minlength=p.n_options * p.n_spellings)
        return logsumexp(path_logp.reshape(p.n_options, p.n_spellings), axis=1)


@dataclass(frozen=True)
class Codes:
    """A code set chosen for this vocabulary: its texts and each code's tokens per kept spelling."""

    name: str
    texts: tuple[str, ...]
    spellings: tuple[str, ...]
    tokens: tuple[tuple[tuple[int, ...], ...], ...]  # [code][spelling] -> token ids
    _plans: dict[int, Paths] = field(default_factory=dict, compare=False, repr=False)

    def paths(self, n_options: int) -> Paths:
        """The readout of the first ``n_options`` codes (built once per count)."""
        plan = self._plans.get(n_options)
        if plan is None:
            plan = _plan(self.tokens[:n_options], len(self.spellings))
            self._plans[n_options] = plan
        return plan


def _plan(tokens: Sequence[Sequence[tuple[int, ...]]], n_spellings: int) -> Paths:
    nodes: dict[tuple[int, ...], int] = {(): 0}
    branches: list[tuple[int, ...]] = []
    step_node: list[int] = []
    step_token: list[int] = []
    step_path: list[int] = []
    for option, spellings in enumerate(tokens):
        for s, seq in enumerate(spellings):
            for depth, token in enumerate(seq):
                prefix = tuple(seq[:depth])
                if prefix not in nodes:
                    nodes[prefix] = len(nodes)
                    branches.append(prefix)
                step_node.append(nodes[prefix])
                step_token.append(token)
                step_path.append(option * n_spellings + s)
    nodes_arr = np.array(step_node, dtype=np.int64)
    return Paths(
        n_options=len(tokens),
        n_spellings=n_spellings,
        branches=tuple(branches),
        step_node=nodes_arr,
        step_token=np.array(step_token, dtype=np.int64),
        step_path=np.array(step_path, dtype=np.int64),
        node_steps=tuple(np.flatnonzero(nodes_arr == k) for k in range(len(nodes))),
    )


def _prefix_free(sequences: Sequence[tuple[int, ...]]) -> bool:
    """No sequence equals or starts another (sorted order puts a prefix right before an extension
    of it, so neighbours suffice)."""
    ordered = sorted(sequences)
    return all(b[: len(a)] != a for a, b in itertools.pairwise(ordered))


def code_set(
    name: str,
    texts: Sequence[str],
    tokenize: Tokenize,
    piece: Piece,
    max_tokens: int | None = None,
) -> Codes | None:
    """``texts`` as a code set read by the chain rule, or None when it is not sound here.

    Sound: in each kept spelling, every code's tokens (at most ``max_tokens``) decode back to
    exactly that spelling of the code (no merge with the space, nothing lost); all kept sequences
    are distinct and prefix-free; the branches of the largest question fit ``MAX_CODE_BRANCHES``.
    """
    kept: list[str] = []
    columns: list[list[tuple[int, ...]]] = []
    for lead in SPELLINGS:
        column = []
        for text in texts:
            seq = tuple(int(t) for t in tokenize(lead + text))
            joined = b"".join(piece(t) for t in seq).decode("utf-8", "replace")
            if not seq or joined != lead + text or (max_tokens and len(seq) > max_tokens):
                break
            column.append(seq)
        else:
            kept.append(lead)
            columns.append(column)
    if not kept:
        return None
    sequences = [seq for column in columns for seq in column]
    if not _prefix_free(sequences):
        return None
    codes = Codes(name, tuple(texts), tuple(kept), tuple(zip(*columns, strict=True)))
    if len(codes.paths(len(texts)).branches) > MAX_CODE_BRANCHES:
        return None
    return codes


def choose_codes(tokenize: Tokenize, piece: Piece, n_codes: int = MAX_OPTIONS) -> Codes | None:
    """The first candidate code set (``CANDIDATES``) that is sound in this vocabulary, or None."""
    for name, texts in CANDIDATES:
        if len(texts) >= n_codes:
            codes = code_set(name, texts[:n_codes], tokenize, piece)
            if codes is not None:
                return codes
    return None


def _single_tokens(labels: Sequence[str], tokenize: Tokenize, piece: Piece) -> np.ndarray | None:
    """Per label and kept spelling, its one token; a spelling is kept only if every label is one
    token that round-trips in it and the labels stay distinct. None when no spelling is kept."""
    columns = []
    for lead in SPELLINGS:
        ids = []
        for label in labels:
            toks = tokenize(lead + label)
            text = piece(int(toks[0])) if len(toks) == 1 else b""
            if text.decode("utf-8", "replace") != lead + label:
                break
            ids.append(int(toks[0]))
        if len(ids) == len(labels) and len(set(ids)) == len(ids):
            columns.append(ids)
    if not columns:
        return None
    merged = np.array(columns, dtype=np.int64).T
    if len({tuple(row) for row in merged}) != len(merged) or len(np.unique(merged)) != merged.size:
        raise LabelVocabularyError("label token variants collide across labels")
    return merged


def _describe(label: str, tokenize: Tokenize, piece: Piece) -> str:
    pieces = [piece(int(t)).decode("utf-8", "replace") for t in tokenize(label)]
    return f"{label!r} is {len(pieces)} tokens here ({', '.join(map(repr, pieces))})"


LabelSet = str | Sequence[str]  # "letters", "digits", or a profile's own labels
DIGITS = "123456789"


@dataclass(frozen=True)
class Labels:
    """The labels options get, as tokens: single-token labels (rows: labels, columns: kept
    spellings), read from one row of logits; and codes, read by the chain rule, for the options
    past them (letters: A-Z, then codes up to 255) or for a profile's two-token labels."""

    token_ids: np.ndarray
    codes: Codes | None
    singles: tuple[str, ...] = tuple(LETTERS)
    max_options: int = MAX_OPTIONS

    @property
    def max_letters(self) -> int:
        """How many options get single-token labels (26 letters)."""
        return int(self.token_ids.shape[0])

    @property
    def max_branches(self) -> int:
        """Branches of the label decode for the largest question (sequences and output rows)."""
        if self.codes is None or self.max_options <= self.max_letters:
            return 0
        return len(self.codes.paths(self.max_options).branches)

    def too_many(self, n_options: int) -> str:
        """Why a question with ``n_options`` options cannot be labelled."""
        if self.singles == tuple(LETTERS) and self.codes is not None:
            return (
                f"{n_options} options given; at most {self.max_options} options are supported "
                f"(up to {self.max_letters} are labelled with letters, more with "
                f"{self.codes.name} codes)"
            )
        return (
            f"{n_options} options given; the prompt profile's labels label at most "
            f"{self.max_options} options"
        )

    def texts(self, n_options: int) -> list[str]:
        """The labels the prompt shows for a question with ``n_options`` options."""
        if n_options <= self.max_letters:
            return list(self.singles[:n_options])
        assert self.codes is not None
        return list(self.codes.texts[:n_options])

    def paths(self, n_options: int) -> Paths | None:
        """The chain-rule readout for ``n_options`` codes; None when single tokens label them."""
        if n_options <= self.max_letters:
            return None
        assert self.codes is not None
        return self.codes.paths(n_options)

    @classmethod
    def of(cls, llama: Llama, label_set: LabelSet = "letters") -> Labels:
        """The labels of this model's vocabulary; ``LabelVocabularyError`` when none are usable."""
        return cls.from_vocabulary(
            # As the model writes a label after the prompt's text: under a space prefix
            # (SentencePiece), "A" alone is "▁A" and " A" is "▁", "▁A".
            lambda text: llama.vocab.continued(text, special=False).tolist(),
            lambda token: llama.vocab.piece_bytes(token, special=True),
            llama.path.name,
            label_set,
        )

    @classmethod
    def from_vocabulary(
        cls, tokenize: Tokenize, piece: Piece, name: str, label_set: LabelSet = "letters"
    ) -> Labels:
        """The labels of a vocabulary given as its tokenizer and token texts."""
        if label_set == "letters":
            return cls._letters(tokenize, piece, name)
        texts = list(DIGITS) if label_set == "digits" else list(label_set)
        singles = _single_tokens(texts, tokenize, piece)
        if singles is not None:
            return cls(singles, None, tuple(texts), len(texts))
        codes = code_set("labels", texts, tokenize, piece, max_tokens=2)
        if codes is None:
            long = [t for t in texts if min(len(tokenize(t)), len(tokenize(" " + t))) > 2]
            why = (
                f"label {_describe(long[0], tokenize, piece)}"
                if long
                else "their tokens collide, or one label's tokens start another's"
            )
            raise LabelVocabularyError(
                f"{name}: the profile's labels are neither single tokens nor distinct, "
                f"prefix-free two-token codes in this vocabulary: {why}; refusing to start"
            )
        return cls(np.zeros((0, len(codes.spellings)), dtype=np.int64), codes, (), len(texts))

    @classmethod
    def _letters(cls, tokenize: Tokenize, piece: Piece, name: str) -> Labels:
        merged = _single_tokens(LETTERS, tokenize, piece)
        if merged is None:
            raise LabelVocabularyError(
                f"{name}: the letters A-Z are not single, distinct, round-trip "
                "tokens in this vocabulary, so option labels cannot be read; refusing to start"
            )
        codes = choose_codes(tokenize, piece)
        if codes is None:
            tried = ", ".join(n for n, _ in CANDIDATES)
            raise LabelVocabularyError(
                f"{name}: no option code set ({tried}) tokenizes into distinct, prefix-free, "
                f"round-trip token sequences in this vocabulary, so questions with more than "
                f"{len(LETTERS)} options cannot be read; refusing to start"
            )
        return cls(merged, codes)

    def read(self, logits: np.ndarray, n_options: int) -> tuple[np.ndarray, float]:
        """The option logits (float64) of the first ``n_options`` letters in one full-vocabulary
        logits row, and the log-sum-exp of the whole row (for the label mass)."""
        if n_options > self.max_letters:
            raise ValueError(f"{n_options} options are read as codes (Paths), not letters")
        picked = logits[self.token_ids[:n_options]].astype(np.float64)
        options = logsumexp(picked, axis=1) if picked.shape[1] > 1 else picked[:, 0]
        return options, float(logsumexp(logits.astype(np.float64)))
