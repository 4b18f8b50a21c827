"""Option labels: the letter tokens a model reads the options by, and the option logits read there.

Options are shown to the model as ``A``, ``B``, ... (``prompt.LETTERS``). At load, each letter must be
one token that round-trips through the vocabulary, in each spelling kept (``A`` and `` A``: the model
may predict either); a spelling is kept only if all 26 letters pass and stay distinct. An option's
logit is the log-sum-exp of its letter's kept spellings, the same way for every option.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from arbiter.engine.llama import Llama
from arbiter.engine.probabilities import logsumexp
from arbiter.errors import LabelVocabularyError
from arbiter.prompt import LETTERS

SPELLINGS = ("", " ")  # the letter alone, and after a space


@dataclass(frozen=True)
class Labels:
    """Token ids per letter (rows) and kept spelling (columns)."""

    token_ids: np.ndarray

    @property
    def max_options(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def of(cls, llama: Llama) -> Labels:
        """The labels of this model's vocabulary; ``LabelVocabularyError`` when none are usable."""
        columns = []
        for lead in SPELLINGS:
            ids = []
            for letter in LETTERS:
                toks = llama.tokenize(lead + letter, special=False)
                piece = llama.piece_bytes(int(toks[0]), special=True) if len(toks) == 1 else b""
                if piece.decode("utf-8", "replace") != lead + letter:
                    break
                ids.append(int(toks[0]))
            if len(ids) == len(LETTERS) and len(set(ids)) == len(ids):
                columns.append(ids)
        if not columns:
            raise LabelVocabularyError(
                f"{llama.path.name}: the letters A-Z are not single, distinct, round-trip "
                "tokens in this vocabulary, so option labels cannot be read; refusing to start"
            )
        merged = np.array(columns, dtype=np.int64).T
        if (
            len({tuple(row) for row in merged}) != len(merged)
            or len(np.unique(merged)) != merged.size
        ):
            raise LabelVocabularyError("label token variants collide across letters")
        return cls(merged)

    def read(self, logits: np.ndarray, n_options: int) -> tuple[np.ndarray, float]:
        """The option logits (float64) of the first ``n_options`` labels in one full-vocabulary
        logits row, and the log-sum-exp of the whole row (for the label mass)."""
        picked = logits[self.token_ids[:n_options]].astype(np.float64)
        options = logsumexp(picked, axis=1) if picked.shape[1] > 1 else picked[:, 0]
        return options, float(logsumexp(logits.astype(np.float64)))
