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

from arbiter import templates
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
        version=f"{profile.codes_name if codes else profile.name}/plain",
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

    Rendered for a decision (``templates.decision_kwargs``: no thinking, no tools, the date of
    ``now``), and closed after any reasoning block the generation prompt leaves open
    (``templates.close_reasoning``), so the labels are read where the model writes its answer.
    The profile's chat answer cue comes after that.
    """
    profile = profile or load_profile(None)
    instruction = profile.instruction(codes)

    def render(messages: list[dict[str, str]]) -> str:
        return templates.render(
            template,
            messages,
            bos_token=bos_token,
            eos_token=eos_token,
            now=now,
            kwargs=templates.decision_kwargs(template),
        )

    preamble = ""
    try:
        text = render(
            [{"role": "system", "content": instruction}, {"role": "user", "content": _SENTINEL}]
        )
    except jinja2.exceptions.TemplateError:
        # Templates without a system role: the instruction goes into the user turn.
        text = render([{"role": "user", "content": _SENTINEL}])
        preamble = instruction + "\n\n"
    if text.count(_SENTINEL) != 1:
        raise ValueError("chat template does not place the user content exactly once")
    head, tail = text.split(_SENTINEL)
    closure = templates.close_reasoning(template, tail)
    return PromptLayout(
        head=head,
        tail=tail + closure.text + profile.spec.answer_cue.chat,
        content_preamble=preamble,
        answer_cue="",
        version=f"{profile.codes_name if codes else profile.name}/chat",
        chat=True,
        profile=profile,
        codes=codes,
        closed_block=closure.block,
    )


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
    return RenderedContent(
        text=prefix + body + layout.answer_cue, state_end=len(prefix), layout=layout
    )


def version(layout: PromptLayout) -> str:
    """The prompt version a result reports: the profile's name (its codes name for codes)."""
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
_MARK = "\u0000ARBITER_MESSAGE_{}\u0000"
_MARKS = re.compile("\u0000ARBITER_MESSAGE_([0-9]+)\u0000")


def render_chat(
    messages: Sequence[tuple[str, str]],
    template: str | None,
    bos_text: str,
    eos_text: str,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Segments:
    """A chat prompt from (role, text) messages, as (text, is_template) segments ending where the
    assistant's reply starts: the model's chat template around the messages, or, for a model
    without one, a plain ``role: text`` transcript ending in ``assistant:``.

    Message text stays apart from template text, so it is tokenized without special-token
    parsing: a message can never become a control token. Each message enters the template as a
    numbered mark; one pass over the rendered text splits it at the marks and checks that every
    message is placed exactly once (linear in the text: a check per message over the whole text
    was quadratic in the number of messages).

    ``template_kwargs`` are the caller's (``enable_thinking``, ``reasoning_effort``, ...): a chat
    completion keeps the template's own defaults unless the request sets them.
    """
    roles = [("system" if role == "developer" else role) for role, _ in messages]
    if not template:
        lines = [f"{role}: {text.strip()}" for role, (_, text) in zip(roles, messages, strict=True)]
        return [("\n".join(lines) + "\nassistant:", False)]
    try:
        text = templates.render(
            template,
            [{"role": r, "content": _MARK.format(i)} for i, r in enumerate(roles)],
            bos_token=bos_text,
            eos_token=eos_text,
            kwargs=template_kwargs,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidDecision(
            f"the model's chat template refused these messages: {exc}",
            param="messages",
            code="chat_template_error",
        ) from exc
    placed = [0] * len(messages)
    segments: Segments = []
    end = 0
    for match in _MARKS.finditer(text):
        index = int(match.group(1))
        if index >= len(placed):
            placed.append(0)  # not a mark of ours: fails the check below
            break
        placed[index] += 1
        if match.start() > end:
            segments.append((text[end : match.start()], True))
        segments.append((messages[index][1], False))
        end = match.end()
    if end < len(text):
        segments.append((text[end:], True))
    if any(count != 1 for count in placed):
        raise InvalidDecision(
            "the model's chat template does not place every message exactly once",
            param="messages",
            code="chat_template_error",
        )
    return segments
