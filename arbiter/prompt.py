"""Prompt rendering: where the state, question and labelled options sit, which labels they get
(letters, or codes above 26 options), and chat prompts in the model's own template.

A prompt has three parts. ``head`` and ``tail`` come from the model's chat template (or are empty for a
plain template) and are tokenized with special-token parsing; ``content`` holds everything the caller
wrote and is tokenized *without* it, so user text can never become a control token. The content starts
with the state, so every decision over one state shares a token prefix (see ``engine``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time
from typing import Any

import jinja2

from arbiter import answer_position, marks, templates
from arbiter.errors import InvalidDecision
from arbiter.profiles import Profile, load_profile

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_SENTINEL = "\u0000ARBITER_CONTENT\u0000"


@dataclass(frozen=True)
class PromptLayout:
    """The fixed text around the caller's content, decided once per model."""

    head: str
    tail: str
    content_preamble: str
    answer_cue: str
    version: str
    chat: bool
    profile: Profile
    codes: bool  # for questions labelled with codes
    closed_block: str | None = None  # a reasoning block Arbiter closed after the template's prompt


@dataclass(frozen=True)
class RenderedContent:
    text: str
    state_end: int  # characters of ``text`` that belong to the shared state prefix
    layout: PromptLayout  # the layout around it (the letters' or the codes')


def state_text(state: Any) -> str:
    """The state as it appears in the prompt: strings verbatim, JSON compact with key order kept."""
    if isinstance(state, str):
        return state
    return json.dumps(state, ensure_ascii=False, allow_nan=False)


def plain_layout(profile: Profile, codes: bool = False) -> PromptLayout:
    """A prompt for a model without a chat template: the instruction, the content, the cue."""
    return PromptLayout(
        head="",
        tail="",
        content_preamble=profile.instruction(codes) + "\n\n",
        answer_cue=profile.spec.answer_cue.plain,
        version=f"{profile.version(codes)}/plain",
        chat=False,
        profile=profile,
        codes=codes,
    )


def prompt_time(pinned: date | None) -> datetime:
    """When a decision prompt says it is: the pinned day (midnight), else now (at load)."""
    return datetime.combine(pinned, time()) if pinned is not None else datetime.now()


def chat_layout(
    template: str,
    bos_token: str,
    eos_token: str,
    now: datetime | None = None,
    profile: Profile | None = None,
    codes: bool = False,
) -> PromptLayout:
    """Render the model's own chat template once, around a sentinel that marks the content.

    Rendered for a decision (``answer_position.switches``: every reasoning switch the template
    reads turned off, no tools, the date of ``now``), then continued to where the model writes its
    answer (``answer_position.closure``: the rest of a reasoning block, or the answer's header, as
    the template's own assistant turn writes it), so the labels are read there. The profile's
    chat answer cue comes after that. Raises ``jinja2.TemplateError`` when the template cannot
    render a decision, ``ValueError`` when it does not place the content exactly once.
    """
    profile = profile or load_profile(None)
    instruction = profile.instruction(codes)
    kwargs = answer_position.switches(template)

    def render(messages: Sequence[Mapping[str, Any]], generation_prompt: bool = True) -> str:
        return templates.render(
            template,
            messages,
            bos_token=bos_token,
            eos_token=eos_token,
            now=now,
            kwargs=kwargs,
            generation_prompt=generation_prompt,
        )

    preamble = ""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": instruction},
        {"role": "user", "content": _SENTINEL},
    ]
    try:
        text = render(messages)
    except jinja2.exceptions.TemplateError:
        # Templates without a system role: the instruction goes into the user turn.
        messages = [{"role": "user", "content": _SENTINEL}]
        text = render(messages)
        preamble = instruction + "\n\n"
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not place the user content exactly once")
    head, tail = text.split(_SENTINEL)
    closure = answer_position.closure(template, tail, render, messages, _SENTINEL)
    head, spaces = split_spaces(head)
    end = answer_ready(tail + closure.text + profile.spec.answer_cue.chat)
    return PromptLayout(
        head=head,
        tail=end,
        content_preamble=spaces + preamble,
        answer_cue="",
        version=f"{profile.version(codes)}/chat",
        chat=True,
        profile=profile,
        codes=codes,
        closed_block=closure.block if len(end) > len(tail) else None,
    )


def answer_ready(prompt_end: str) -> str:
    """The end of a prompt without the space its answer's first token owns.

    A turn written ``Role: `` + content (Llama 2 chat, Vicuna, OpenChat, DeepSeek LLM, Reka-Edge),
    or a cue such as ``The answer is ``, ends in a space that BPE and SentencePiece vocabularies
    write as part of the next word (`` A``): read after it, the model sees a lone space token it
    never wrote and puts half its mass elsewhere (label mass 0.469 against 0.997 on Qwen2.5 1.5B).
    The answer is read before the space, where the labels' spaced spelling (`` A``) is the word
    the model writes."""
    return prompt_end[:-1] if prompt_end.endswith(" ") else prompt_end


def split_spaces(template_text: str) -> tuple[str, str]:
    """Template text before the caller's, and the spaces it ends with: those go with the caller's
    text, so a word after them is tokenized with its space as the whole prompt would be (``User:
    `` + ``Which...``: `` Which``, where tokenized apart the template's last token was a lone
    space)."""
    kept = template_text.rstrip(" ")
    return kept, template_text[len(kept) :]


def state_prefix(layout: PromptLayout, state: str) -> str:
    """The start of the content that every question about ``state`` shares."""
    return layout.content_preamble + layout.profile.state(state)


def render_content(
    layout: PromptLayout,
    state: str,
    question: str,
    descriptions: list[str],
    labels: list[str],
) -> RenderedContent:
    """The caller's part of the prompt: only labels and descriptions, never option ids.

    The profile places them (the built-in lists ``A. ...`` and names codes by their range in the
    reply line instead of one by one, which would cost a token or three per option).
    """
    prefix = state_prefix(layout, state)
    body = layout.profile.question(question, descriptions, labels, layout.codes)
    text = prefix + body + layout.answer_cue
    if not layout.tail:  # the content ends the prompt (a plain one): it ends at the answer
        text = answer_ready(text)
    return RenderedContent(text=text, state_end=len(prefix), layout=layout)


def version(layout: PromptLayout) -> str:
    """The prompt version a result reports: the profile's name (its codes name for codes), a
    profile file's with its sha256 (``Profile.version``), and the layout's kind."""
    return layout.version


def full_text(content: RenderedContent) -> str:
    return content.layout.head + content.text + content.layout.tail


@dataclass(frozen=True)
class Layouts:
    """A model's two prompts: for questions labelled with letters, and with codes."""

    letters: PromptLayout
    codes: PromptLayout


def plain_layouts(profile: Profile) -> Layouts:
    return Layouts(plain_layout(profile, False), plain_layout(profile, True))


def chat_layouts(
    template: str, bos_token: str, eos_token: str, now: datetime, profile: Profile
) -> Layouts:
    return Layouts(
        chat_layout(template, bos_token, eos_token, now, profile, False),
        chat_layout(template, bos_token, eos_token, now, profile, True),
    )


# -- chat completions ------------------------------------------------------------------------------

Segments = list[tuple[str, bool]]  # (text, is_template_text)
PLAIN_STOPS = ["\nuser:", "\nsystem:"]  # where a plain transcript's reply ends
# What every control token's text is written with (<|im_end|>, [INST], <s>, <｜Assistant｜>,
# <start_of_turn>): a caller's string that holds one of these reaches the template as a mark,
# and is placed as text like a message, never tokenized with special-token parsing (a message's
# name, reasoning_effort and the chat_template_kwargs values included). A mark's own name too.
_MARKUP = re.compile("[<>\\[\\]|\uff5c\u0000]|" + marks.NAME.pattern, re.IGNORECASE)


class _Values:
    """The caller's strings that reach a template besides the messages (names, keyword values),
    each that could hold a control token's text swapped for a numbered mark after the messages',
    with the request field it came from (``fields``).

    A string the template compares its keyword with (``reasoning_effort == "high"``) is the
    template's own text and stays as it is, as does one with no markup (a mark would change how
    plain text tokenizes at its edges, for nothing)."""

    def __init__(self, first: int, compared: Mapping[str, frozenset[object]]) -> None:
        self.texts: list[str] = []
        self.fields: list[str] = []
        self.first = first
        self.compared = compared

    def text(self, value: str, field: str, key: str | None = None) -> str:
        if not _MARKUP.search(value) or (key is not None and value in self.compared.get(key, ())):
            return value
        self.texts.append(value)
        self.fields.append(field)
        return marks.Mark(self.first + len(self.texts) - 1, value)

    def any(self, value: Any, field: str, key: str | None = None) -> Any:
        if isinstance(value, str):
            return self.text(value, field, key)
        if isinstance(value, Mapping):
            return {self.any(k, field): self.any(v, f"{field}.{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.any(v, f"{field}.{i}") for i, v in enumerate(value)]
        return value

    def kwargs(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        return {
            key: self.any(value, f"chat_template_kwargs.{key}", key)
            for key, value in (kwargs or {}).items()
        }


def _refuse_changed_marks(segments: Segments, fields: Sequence[str]) -> None:
    """A 400 naming the field whose mark the template changed (``name | lower``): what it would
    have written for the caller's string is unknown, so it cannot be placed."""
    for part, template_text in segments:
        left = marks.residue(part) if template_text else None
        if left is not None:
            index = int(left[1]) if left[1] else -1
            field = fields[index] if 0 <= index < len(fields) else "messages"
            raise InvalidDecision(
                f"{field}: the model's chat template changes this value where it writes it (a "
                "filter other than tojson or string); a value holding markup (<, >, [, ], |) "
                "cannot be placed there as text",
                param=field,
                code="chat_template_error",
            )


def render_chat(
    messages: Sequence[tuple[str, str]],
    template: str | None,
    bos_text: str,
    eos_text: str,
    template_kwargs: Mapping[str, Any] | None = None,
    *,
    names: Sequence[str | None] | None = None,
    prefill: bool = False,
) -> Segments:
    """A chat prompt from (role, text) messages, as (text, is_template) segments ending where the
    assistant's reply starts: the model's chat template around the messages, or, for a model
    without one, a plain ``role: text`` transcript ending in ``assistant:``.

    Message text stays apart from template text, so it is tokenized without special-token
    parsing: a message can never become a control token. Each message enters the template as a
    numbered mark; one pass over the rendered text splits it at the marks and checks that every
    message is placed exactly once (linear in the text: a check per message over the whole text
    was quadratic in the number of messages). Every other string of the caller's that the template
    is given (``names``, the keywords' values) is text too: one that holds markup enters as a mark
    of its own (``_Values``), placed as text wherever the template writes it: through ``tojson``
    or ``string`` as those would have written it (``marks``); changed by any other filter it is a
    400 naming the field, never a mark left in the prompt.

    ``template_kwargs`` are the caller's (``enable_thinking``, ``reasoning_effort``, ...): a chat
    completion keeps the template's own defaults unless the request sets them. ``names`` are the
    messages' ``name`` fields, given to the template. ``prefill``: a last assistant message is
    the start of the reply (llama.cpp's server does this by default): rendered without the
    generation prompt and cut after its text, so the reply continues it.
    """
    roles = [("system" if role == "developer" else role) for role, _ in messages]
    prefilled = prefill and bool(roles) and roles[-1] == "assistant"
    if not template:
        lines = [f"{role}: {text.strip()}" for role, (_, text) in zip(roles, messages, strict=True)]
        if prefilled:
            return [("\n".join([*lines[:-1], f"assistant: {messages[-1][1].lstrip()}"]), False)]
        return [("\n".join(lines) + "\nassistant:", False)]
    values = _Values(len(messages), answer_position.template_reads(template).compared)
    marked: list[dict[str, str]] = []
    for i, role in enumerate(roles):
        message = {"role": role, "content": marks.Mark(i, messages[i][1])}
        if names is not None and names[i]:
            message["name"] = values.text(str(names[i]), f"messages.{i}.name")
        marked.append(message)
    try:
        text = templates.render(
            template,
            marked,
            bos_token=bos_text,
            eos_token=eos_text,
            kwargs=values.kwargs(template_kwargs),
            generation_prompt=not prefilled,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidDecision(
            f"the model's chat template refused these messages: {exc}",
            param="messages",
            code="chat_template_error",
        ) from exc
    texts = [message for _, message in messages] + values.texts
    fields = [f"messages.{i}.content" for i in range(len(messages))] + values.fields
    placed = [0] * len(texts)
    segments: Segments = []
    end = 0
    for match in marks.MARKS.finditer(text):
        index = int(match[1])
        if index >= len(placed):
            placed.append(0)  # not a mark of ours: fails the check below
            break
        placed[index] += 1
        before, spaces = split_spaces(text[end : match.start()])
        if before:
            segments.append((before, True))
        segments.append((spaces + marks.placed(texts[index], match[2]), False))
        end = match.end()
    if end < len(text) and not prefilled:
        segments.append((text[end:], True))  # prefilled: the turn's end is not written
    if any(count != 1 for count in placed[: len(messages)]) or len(placed) > len(texts):
        raise InvalidDecision(
            "the model's chat template does not place every message exactly once",
            param="messages",
            code="chat_template_error",
        )
    _refuse_changed_marks(segments, fields)
    last, is_template = segments[-1] if segments else ("", True)
    if prefilled and (is_template or split_spaces(last.removesuffix(messages[-1][1]))[0]):
        raise InvalidDecision(
            "the model's chat template writes the last assistant message before another one; "
            "it cannot be continued",
            param="messages",
            code="chat_template_error",
        )
    return segments
