"""Where a decision is read: the position where the model writes its answer, with no tools and no
reasoning, found from the chat template's own text.

A decision reads the option labels at the last position of its prompt, so the prompt must end where
the model's answer starts. Families differ in how they get there, and each way is read off the
template itself, never off a family's name:

- **Switches** (``switches``): the keywords the template reads that turn reasoning off, with the
  value it compares them with: ``enable_thinking`` and ``thinking`` false (Qwen3, Kimi-K3,
  DeepSeek), ``thinking_budget`` 0 (Seed-OSS), ``thinking_mode`` ``"disabled"`` (MiniMax-M3),
  ``reasoning_effort`` its lowest value (``"none"``: Command A reasoning; ``"no_think"``: Hunyuan;
  ``"minimal"``: Solar); gpt-oss at ``"low"`` (it has no off).
- **The assistant's own turn** (``closure``): the template renders a finished assistant message
  (with a marked reasoning text, and without) after the same user turn. What that turn writes
  after the generation prompt, before its content, is what the model would write first: the rest
  of a reasoning block the prompt opened, in the family's own form (MiniMax-M2's
  ``\\n</think>\\n\\n``, Seed-OSS's newline after ``</seed:think>``, Apriel-1.6's
  ``\\n[BEGIN FINAL RESPONSE]\\n``); a closed empty block where the model opens one itself
  (Kimi-K2-Thinking's ``<think></think>``); an answer header or recipient (Solar's
  ``<|content|>``, muse's `` to=user<|message|>``, functionary-v3.2's ``all\\n``).
- **A block left open** that no assistant turn shows how to close (DeepSeek-R1-Distill-Llama drops
  the reasoning of past turns): closed the common way (``BLOCKS``). One the prompt closed at its
  very end in the newline form (``<think>\n</think>``: QwQ's and R1-Distill-Qwen's fixtures) gets
  the blank line those families write after it (``THINK_SEPARATOR``).
- **A block the model opens itself**, known from the template's own assistant turn: it opens a
  reasoning block right after the generation prompt, and no switch of the template turns it off
  (LFM2.5-8B-A1B): closed empty in that turn's form (``<think></think>``).
- **Models that open reasoning themselves** while their template never writes it
  (``SELF_OPENED``): found by their template's own text (MiniMax-M1's and MiMo-VL's system prompts,
  Apriel-1.5's instruction naming ``[BEGIN FINAL RESPONSE]``), closed in their family's form.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from arbiter.templates import GenerationTag

GPT_OSS_CHANNEL = "<|channel|>"
GPT_OSS_FINAL = "<|start|>assistant<|channel|>final<|message|>"
GPT_OSS_EMPTY_ANALYSIS = "<|channel|>analysis<|message|><|end|>"
# Values that turn reasoning off, or lowest first, as templates compare their switches with them.
OFF_VALUES = ("none", "no_think", "disabled", "off", "minimal", "low")
OFF_SWITCHES = ("reasoning_effort", "thinking_mode")
ANSWER = "\u0000ARBITER_ANSWER\u0000"
REASONING = "\u0000ARBITER_REASONING\u0000"
# The message fields templates read a past turn's reasoning from.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
_FIRST_MARK = re.compile(r"<[^<>]+>|\[[^\[\]]+\]|\S+")  # a tag, a bracketed marker, or a word
_MARKUP = re.compile(r"(\s*<\|?[A-Za-z_:/]+\|?>)+\s*")  # special-token tags only

Message = Mapping[str, Any]
# Renders messages with the decision's keywords: (messages, with the generation prompt) -> text.
Render = Callable[[Sequence[Message], bool], str]


# -- switches ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reads:
    """The names a template reads from its caller, and the constants each is compared with."""

    names: frozenset[str]
    compared: Mapping[str, frozenset[object]]


def _names(node: nodes.Node) -> Iterator[str]:
    if isinstance(node, nodes.Name):
        yield node.name
    elif isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
        yield from _names(node.node)


def _constants(node: nodes.Node) -> Iterator[object]:
    if isinstance(node, nodes.Const):
        yield node.value
    elif isinstance(node, nodes.List | nodes.Tuple):
        for item in node.items:
            yield from _constants(item)


@functools.lru_cache(maxsize=8)
def template_reads(template: str) -> Reads:
    """What ``template`` reads (from its syntax tree: every name it loads, which is cheap where
    Jinja's ``meta.find_undeclared_variables`` compiles the template); empty when it does not
    parse (the render reports that)."""
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols, GenerationTag])
    try:
        tree = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return Reads(frozenset(), {})
    compared: dict[str, set[object]] = {}
    for compare in tree.find_all(nodes.Compare):
        sides = [compare.expr, *(operand.expr for operand in compare.ops)]
        names = [name for side in sides for name in _names(side)]
        values = [value for side in sides for value in _constants(side)]
        for name in names:
            compared.setdefault(name, set()).update(values)
    return Reads(
        frozenset(name.name for name in tree.find_all(nodes.Name) if name.ctx == "load"),
        {name: frozenset(values) for name, values in compared.items()},
    )


def switches(template: str) -> dict[str, Any]:
    """The keywords a decision is rendered with: every reasoning switch the template reads, off."""
    reads = template_reads(template)
    kwargs: dict[str, Any] = {"enable_thinking": False}
    if "thinking" in reads.names:
        kwargs["thinking"] = False
    if "thinking_budget" in reads.names and 0 in reads.compared.get("thinking_budget", ()):
        kwargs["thinking_budget"] = 0
    for name in OFF_SWITCHES:
        values = reads.compared.get(name, frozenset())
        off = next((value for value in OFF_VALUES if value in values), None)
        if name in reads.names and off is not None:
            kwargs[name] = off
    if GPT_OSS_CHANNEL in template and "reasoning_effort" not in kwargs:
        kwargs["reasoning_effort"] = "low"
    return kwargs


# -- reasoning blocks closed the common way ------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningBlock:
    """A family's reasoning block: how it opens and closes, and what closes it when left open."""

    name: str
    opens: str
    closes: str
    closing: Callable[[str], str]  # the text that closes it, given the prompt so far


def _newline_then(text: str) -> Callable[[str], str]:
    return lambda prompt: ("" if prompt.endswith("\n") else "\n") + text


BLOCKS = (
    # Qwen3's own closed block is "<think>\n\n</think>\n\n".
    ReasoningBlock("think", "<think>", "</think>", _newline_then("\n</think>\n\n")),
    ReasoningBlock(
        "gemma4-thought", "<|channel>thought", "<channel|>", _newline_then("<channel|>")
    ),
    ReasoningBlock(
        "gpt-oss-analysis",
        "<|channel|>analysis<|message|>",
        "<|end|>",
        lambda _: "<|end|>" + GPT_OSS_FINAL,
    ),
    ReasoningBlock("mistral-think", "[THINK]", "[/THINK]", lambda _: "[/THINK]"),
    ReasoningBlock(
        "command-thinking", "<|START_THINKING|>", "<|END_THINKING|>", lambda _: "<|END_THINKING|>"
    ),
    ReasoningBlock("kimi-think", "<|open|>think", "<|close|>", lambda _: "<|close|>"),
)


def open_block(text: str) -> ReasoningBlock | None:
    """The reasoning block ``text`` ends inside (opened and not closed after), if any."""
    found: tuple[int, ReasoningBlock] | None = None
    for block in BLOCKS:
        start = text.rfind(block.opens)
        if start == -1 or block.closes in text[start + len(block.opens) :]:
            continue
        if found is None or start > found[0]:
            found = (start, block)
    return found[1] if found else None


@dataclass(frozen=True)
class SelfOpened:
    """A family whose model opens a reasoning block by itself where its template never writes one:
    known by a sentence of its template, closed in the family's form."""

    name: str
    marker: str  # text of the template that names the family
    closing: str


SELF_OPENED = (
    # MiniMax-M1 starts every reply with "<think>\n" (its template shows no reasoning); closed as
    # its successor MiniMax-M2's template writes a past turn's reasoning.
    SelfOpened("minimax-m1-think", "based on MiniMax-M1 model", "<think>\n\n</think>\n\n"),
    # MiMo-VL (Qwen2.5's turns) starts its replies with a <think> block, as Qwen3 writes it.
    SelfOpened(
        "mimo-think",
        "You are MiMo, an AI assistant developed by Xiaomi.",
        "<think>\n\n</think>\n\n",
    ),
    # Apriel-1.5's instruction asks for reasoning, then "[BEGIN FINAL RESPONSE]" before the answer.
    SelfOpened("apriel-final-response", "[BEGIN FINAL RESPONSE] ...", "[BEGIN FINAL RESPONSE]\n"),
)


# The switches a template reads to turn its reasoning on or off: one that reads none of them and
# whose assistant turn opens a block first is a model that always opens it itself.
REASONING_SWITCHES = ("enable_thinking", "thinking", "thinking_budget", *OFF_SWITCHES)
# A think block the prompt wrote in the newline form and closed at its very end (QwQ's and
# R1-Distill-Qwen's fixtures, ``<think>\n</think>``): those families write a blank line after the
# close (Qwen3's own closed block is ``<think>\n\n</think>\n\n``), and the answer comes after
# it, one token later (read at ``</think>``, the labels get 0.001 of the mass).
NEWLINE_THINK_CLOSED = re.compile(r"<think>\n\s*</think>\Z")
THINK_SEPARATOR = "\n\n"


# -- the closure ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Closure:
    """What was appended to a decision's generation prompt so the answer comes next."""

    block: str | None  # how it was found; None when the prompt already ends at the answer
    text: str


def _assistant_turn(
    render: Render, messages: Sequence[Message], user: str, reasoning: bool
) -> str | None:
    """A finished assistant message rendered after ``messages``, from the user's content (``user``)
    to the start of the assistant's (``ANSWER``); None when the template refuses it."""
    message: dict[str, Any] = {"role": "assistant", "content": ANSWER}
    if reasoning:
        message.update(dict.fromkeys(REASONING_FIELDS, REASONING))
    try:
        text = render([*messages, message], False)
    except jinja2.TemplateError:
        return None
    if text.count(ANSWER) != 1 or text.count(user) != 1:
        return None
    turn = text.split(user)[1]
    return turn[: turn.index(ANSWER)] if ANSWER in turn else None


def _overlap(text: str, turn: str) -> int:
    """The longest end of ``text`` that starts ``turn`` (what both have written), counted only when
    it holds more than whitespace."""
    for size in range(min(len(text), len(turn)), 0, -1):
        if text.endswith(turn[:size]):
            return size if turn[:size].strip() else 0
    return 0


def _rest_of_block(tail: str, before: str, after: str) -> str | None:
    """When ``tail`` has reached the reasoning slot of the assistant's turn (``before`` REASONING
    ``after``): the rest of ``after`` it has not written (the block's close, then the answer's
    header); None when it has not reached the slot."""
    if not tail.startswith(before) or not after.strip():
        return None
    begun = tail[len(before) :]
    written = _overlap(begun, after)
    if written:
        return after[written:]
    first = _FIRST_MARK.match(after.strip())
    if first is not None and first.group() in begun:
        return ""  # closed already, and followed by what this turn does not write
    return after  # reasoning begun, not closed: close it as the template does


def _header(tail: str, turn: str) -> str | None:
    """The answer's header the assistant's turn writes after what ``tail`` wrote; None when the
    two do not line up."""
    written = _overlap(tail, turn)
    if written:
        return turn[written:]
    # The generation prompt wrote markup the finished turn leaves out (an empty reasoning block,
    # Command R7B's): the turn's own header follows it, unless the prompt wrote that too.
    same = next((i for i, (a, b) in enumerate(zip(tail, turn, strict=False)) if a != b), None)
    shared = tail[: min(len(tail), len(turn)) if same is None else same]
    common = max(shared.rfind(">"), shared.rfind("\n")) + 1  # at a tag's end, not inside one
    inserted, header = tail[common:], turn[common:]
    if common and header and _MARKUP.fullmatch(inserted) and header not in inserted:
        return header
    return None


def closure(
    template: str, tail: str, render: Render, messages: Sequence[Message], user: str
) -> Closure:
    """The text that puts the read position where the model writes its answer.

    ``tail`` is the generation prompt after the user's content ``user`` in ``messages``; ``render``
    renders with the decision's keywords.
    """
    if GPT_OSS_CHANNEL in template and tail.endswith("<|start|>assistant"):
        # gpt-oss must name a channel: the analysis channel written empty and closed, then final.
        return Closure("gpt-oss-analysis", GPT_OSS_EMPTY_ANALYSIS + GPT_OSS_FINAL)
    with_reasoning = _assistant_turn(render, messages, user, reasoning=True)
    plain = _assistant_turn(render, messages, user, reasoning=False)
    found: Closure | None = None
    if with_reasoning is not None and with_reasoning.count(REASONING) == 1:
        before, after = with_reasoning.split(REASONING)
        rest = _rest_of_block(tail, before, after)
        if rest is not None:
            found = Closure("assistant-reasoning" if rest else None, rest)
    if found is None and plain is not None:
        header = _header(tail, plain)
        if header is not None:
            found = Closure("assistant-header" if header else None, header)
    found = found or Closure(None, "")
    block = open_block(tail + found.text)
    if block is not None:
        text = found.text + block.closing(tail + found.text)
        return Closure(block.name, text)
    if NEWLINE_THINK_CLOSED.search(tail + found.text):
        return Closure(found.block or "think-separator", found.text + THINK_SEPARATOR)
    if not found.text:
        opened = _opened_by_the_model(template, tail, with_reasoning)
        if opened is not None:
            return opened
        for family in SELF_OPENED:
            if family.marker in template:
                return Closure(family.name, family.closing)
    return found


def _opened_by_the_model(template: str, tail: str, turn: str | None) -> Closure | None:
    """A closed empty block in the turn's own form, where the template's assistant turn opens a
    reasoning block right after the generation prompt and no switch of the template can turn it
    off: the model opens it itself (LFM2.5-8B-A1B: ``<think>...</think>`` and the answer; llama.cpp's
    own chat tests say it always emits ``<think>``)."""
    if turn is None or turn.count(REASONING) != 1:
        return None
    before, after = turn.split(REASONING)
    opener = before.removeprefix(tail) if before.startswith(tail) else ""
    reads = template_reads(template).names
    if not any(opener.strip() == block.opens for block in BLOCKS) or reads & set(
        REASONING_SWITCHES
    ):
        return None
    return Closure("opened-by-the-model", opener + after)
