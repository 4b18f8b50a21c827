"""A model's decision prompts: the layout from its chat template (or the plain one), its labels, and
decisions turned into the exact text and tokens that are prefilled.

The engine scores with :class:`Prompts`; `arbiter prompt` prints with the same object built on a
vocabulary-only load (:func:`open_prompts`), so what it shows is what the model reads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from arbiter import prompt as prompts
from arbiter.engine.labels import Labels
from arbiter.engine.llama import Llama
from arbiter.schema import DecisionRequest
from arbiter.settings import EngineSettings


def prompt_sha256(text: str) -> str:
    """The ``prompt.sha256`` a result reports: of the whole prefilled text, in UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


class Prompts:
    """Decisions as the model reads them: the rendered text and its tokens (``arbiter.prompt``
    around the model's chat template). Caller text is tokenized without special-token parsing."""

    def __init__(self, llama: Llama, layout: prompts.PromptLayout, labels: Labels) -> None:
        self.llama = llama
        self.layout = layout
        self.labels = labels
        head = llama.tokenize(self.layout.head, special=True)
        if llama.add_bos and (len(head) == 0 or head[0] != llama.bos):
            head = np.concatenate([np.array([llama.bos], dtype=np.int32), head])
        self.head = head
        self.tail = llama.tokenize(self.layout.tail, special=True)

    def content(self, text: str) -> np.ndarray:
        return self.llama.tokenize(text, special=False)

    def render(self, request: DecisionRequest) -> prompts.RenderedContent:
        return prompts.render_content(
            self.layout,
            prompts.state_text(request.state),
            request.question,
            [o.description for o in request.options],
            self.labels.texts(len(request.options)),
        )

    def version(self, request: DecisionRequest) -> str:
        return prompts.version(self.layout, self.labels.texts(len(request.options)))

    def text(self, request: DecisionRequest) -> str:
        return prompts.full_text(self.layout, self.render(request))

    def tokens(self, rendered: prompts.RenderedContent) -> np.ndarray:
        return np.concatenate([self.head, self.content(rendered.text), self.tail])

    def state_prefix(self, state: str) -> np.ndarray:
        """The tokens every prompt over ``state`` starts with, as the state tokenizes alone."""
        return np.concatenate([self.head, self.content(prompts.state_prefix(self.layout, state))])

    def shared_prefix(self, state: str, prompt_tokens: Sequence[np.ndarray]) -> int:
        """How many tokens of the prompts over ``state`` are prefilled once for all of them.

        The longest run that the state's own tokenization shares with every full prompt (BPE
        merges at the boundary fall outside it), so it is a true token prefix by construction, and
        always at least one token short of the shortest prompt (its last token is decoded in its
        branch, where its logits are read).
        """
        state_prefix = self.state_prefix(state)
        shared = min(_common_prefix(state_prefix, tokens) for tokens in prompt_tokens)
        return min(shared, min(len(tokens) for tokens in prompt_tokens) - 1)


def open_prompts(llama: Llama, settings: EngineSettings) -> Prompts:
    """The decision prompts of a loaded model (its vocabulary is all this needs)."""
    template = llama.chat_template
    if template:
        layout = prompts.chat_layout(
            template,
            llama.piece_text(llama.bos),
            llama.piece_text(llama.eos),
            prompts.prompt_time(settings.prompt_date),
        )
    else:
        layout = prompts.plain_layout()
    return Prompts(llama, layout, Labels.of(llama))
