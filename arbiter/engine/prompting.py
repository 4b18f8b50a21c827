"""A model's decision prompts: the layout from its chat template (or the plain one), its labels, and
decisions turned into the exact text and tokens that are prefilled.

The engine scores with :class:`Prompts`; `arbiter prompt` prints with the same object built on a
vocabulary-only load (:func:`open_prompts`), so what it shows is what the model reads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import jinja2
import numpy as np

from arbiter import prompt as prompts
from arbiter.engine.labels import Labels
from arbiter.engine.llama import Llama
from arbiter.errors import LabelVocabularyError, TemplateRefused
from arbiter.gguf_info import GGUFError, read_header, token_texts
from arbiter.profiles import Profile, load_profile
from arbiter.schema import DecisionRequest
from arbiter.settings import EngineSettings

TEMPLATE_KEY = "tokenizer.chat_template"  # where llama.cpp reads a model's chat template


def prompt_sha256(text: str) -> str:
    """The ``prompt.sha256`` a result reports: of the whole prefilled text, in UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


class Prompts:
    """Decisions as the model reads them: the rendered text and its tokens (``arbiter.prompt``
    around the model's chat template). Caller text is tokenized without special-token parsing.

    Questions labelled with letters and with codes have a layout each (their instructions
    differ); the state comes first in both, right after the instruction."""

    def __init__(self, llama: Llama, layouts: prompts.Layouts, labels: Labels) -> None:
        self.llama = llama
        self.layouts = layouts
        self.labels = labels
        self._around: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._tail_after_special: dict[int, np.ndarray] = {}
        for layout in (layouts.letters, layouts.codes):
            head = llama.vocab.tokenize(layout.head, special=True)
            if llama.vocab.add_bos and (len(head) == 0 or head[0] != llama.vocab.bos):
                head = np.concatenate([np.array([llama.vocab.bos], dtype=np.int32), head])
            # The tail follows the caller's text (a space prefix is not written again there).
            tail = llama.vocab.continued(layout.tail, special=True)
            self._around[id(layout)] = (head, tail)
            self._tail_after_special[id(layout)] = llama.vocab.tokenize(layout.tail, special=True)

    @property
    def layout(self) -> prompts.PromptLayout:
        """The layout of lettered questions (what most decisions read)."""
        return self.layouts.letters

    def layout_for(self, n_options: int) -> prompts.PromptLayout:
        codes = n_options > self.labels.max_letters
        return self.layouts.codes if codes else self.layouts.letters

    def content(self, text: str, head: np.ndarray) -> np.ndarray:
        """The caller's part, tokenized without special-token parsing where it follows ``head``."""
        return self.llama.vocab.tokenize(
            text, special=False, after=int(head[-1]) if len(head) else None
        )

    def render(self, request: DecisionRequest) -> prompts.RenderedContent:
        n_options = len(request.options)
        return prompts.render_content(
            self.layout_for(n_options),
            prompts.state_text(request.state),
            request.question,
            [o.description for o in request.options],
            self.labels.texts(n_options),
        )

    def version(self, request: DecisionRequest) -> str:
        n_options = len(request.options)
        return prompts.version(self.layout_for(n_options))

    def text(self, request: DecisionRequest) -> str:
        return prompts.full_text(self.render(request))

    def tokens(self, rendered: prompts.RenderedContent) -> np.ndarray:
        """The prompt's tokens: as llama.cpp tokenizes the whole text (a space prefix only at the
        start and after special tokens), with the caller's part never parsed for them."""
        head, tail = self._around[id(rendered.layout)]
        content = self.content(rendered.text, head)
        if len(content) and self.llama.vocab.opens_text(int(content[-1])):
            tail = self._tail_after_special[id(rendered.layout)]
        return np.concatenate([head, content, tail])

    def fewest_around(self) -> tuple[int, int]:
        """The fewest template tokens before and after the content in any layout (what a floor
        from bytes may count: ``cost``)."""
        heads, tails = zip(*self._around.values(), strict=True)
        return min(len(h) for h in heads), min(len(t) for t in tails)

    def fixed_tokens(self, layout: prompts.PromptLayout) -> int:
        """Tokens of the template around the content (head and tail) in ``layout``."""
        head, tail = self._around[id(layout)]
        return len(head) + len(tail)

    def state_prefix(self, state: str, layout: prompts.PromptLayout) -> np.ndarray:
        """The tokens every prompt over ``state`` in ``layout`` starts with, as the state
        tokenizes alone."""
        head, _ = self._around[id(layout)]
        return np.concatenate([head, self.content(prompts.state_prefix(layout, state), head)])

    def shared_prefix(
        self, state: str, layout: prompts.PromptLayout, prompt_tokens: Sequence[np.ndarray]
    ) -> int:
        """How many tokens of the prompts over ``state`` in ``layout`` are prefilled once for all.

        The longest run that the state's own tokenization shares with every full prompt (BPE
        merges at the boundary fall outside it), so it is a true token prefix by construction, and
        always at least one token short of the shortest prompt (its last token is decoded in its
        branch, where its logits are read).
        """
        state_prefix = self.state_prefix(state, layout)
        shared = min(_common_prefix(state_prefix, tokens) for tokens in prompt_tokens)
        return min(shared, min(len(tokens) for tokens in prompt_tokens) - 1)


def template_refusal(model: str, exc: Exception) -> str:
    """One line: the model, the key its template is in, what the renderer said, what to do."""
    where = f" (line {exc.lineno})" if isinstance(exc, jinja2.TemplateSyntaxError) else ""
    said = " ".join(str(exc).split()) or type(exc).__name__
    return (
        f"refusing to start: {model}'s chat template ({TEMPLATE_KEY}){where} cannot "
        f"render a decision prompt: {said}. Fix the template in the GGUF (the gguf package's "
        "gguf-new-metadata --chat-template-file rewrites it)"
    )


def check_template(path: Path, settings: EngineSettings, profile: Profile) -> None:
    """The model's chat template renders a decision prompt, checked from the GGUF's header alone
    (no llama.cpp load: milliseconds, where a vocabulary-only load of a 262k-token vocabulary
    takes seconds): what `arbiter serve` and the container entrypoint check before they listen.
    ``TemplateRefused`` in one line when it does not; a file that is not a GGUF is left to the
    engine's load, which says so."""
    try:
        header = read_header(path)
        template = header.strings.get(TEMPLATE_KEY)
        if not template:
            return
        ids = {
            name: int(header.floats.get(f"tokenizer.ggml.{name}_token_id", -1))
            for name in ("bos", "eos")
        }
        texts = token_texts(path, ids)
    except (GGUFError, OSError):
        return
    try:
        prompts.chat_layouts(
            template, texts["bos"], texts["eos"], prompts.prompt_time(settings.prompt_date), profile
        )
    except (jinja2.TemplateError, ValueError) as exc:
        raise TemplateRefused(template_refusal(path.name, exc)) from None


def check_prompts(path: Path, settings: EngineSettings, profile: Profile) -> Prompts:
    """The profile's prompts and labels built on the model's vocabulary alone (a start-up check
    that loads no weights); raises what the engine's load would raise."""
    llama = Llama(path, settings.model_copy(update={"n_gpu_layers": 0}), vocab_only=True)
    try:
        return open_prompts(llama, settings, profile)
    finally:
        llama.close()


def open_prompts(llama: Llama, settings: EngineSettings, profile: Profile) -> Prompts:
    """The decision prompts of a loaded model under ``profile`` (its vocabulary is all this
    needs); ``TemplateRefused`` when its chat template cannot render a decision,
    ``LabelVocabularyError`` when the profile's labels do not tokenize soundly."""
    template = llama.chat_template
    if template:
        try:
            layouts = prompts.chat_layouts(
                template,
                llama.vocab.piece_text(llama.vocab.bos),
                llama.vocab.piece_text(llama.vocab.eos),
                prompts.prompt_time(settings.prompt_date),
                profile,
            )
        except (jinja2.TemplateError, ValueError) as exc:
            raise TemplateRefused(template_refusal(llama.path.name, exc)) from None
    else:
        layouts = prompts.plain_layouts(profile)
    return Prompts(llama, layouts, Labels.of(llama, profile.spec.labels))


def reference_prompts(llama: Llama) -> Prompts | None:
    """The plain built-in prompt (no chat template, the default profile, letters) on ``llama``'s
    vocabulary: the read check's reference on the same weights; None when its letters cannot be
    read in this vocabulary."""
    profile = load_profile(None)
    try:
        return Prompts(llama, prompts.plain_layouts(profile), Labels.of(llama))
    except LabelVocabularyError:
        return None
