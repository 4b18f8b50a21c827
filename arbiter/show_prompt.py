"""`arbiter prompt FILE.jsonl`: for each decision, the exact text the engine prefills, its token
count and how much of it is prefilled once for its state, so a user sees what the model saw.

Built by the engine's own prompt object (``engine.prompting.Prompts``) on a vocabulary-only load of
the same model, grouped by state the way ``arbiter decide`` groups a chunk, so the prefix count is
the ``prompt.prefix_tokens`` a result reports and the sha256 its ``prompt.sha256``. A decision read
adaptively shows its first read (its options in their canonical order); its result's
``prompt.input_tokens`` also counts the later orders' suffixes, when it read any.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from arbiter import prompt as prompts
from arbiter.errors import ArbiterError, ModelLoadError, TooManyOptions
from arbiter.lines import chunk_size, echo_id, numbered_lines, parse_decision_line
from arbiter.schema import MAX_OPTIONS, DecisionRequest
from arbiter.settings import EngineSettings

if TYPE_CHECKING:
    from arbiter.engine.preparing import Preparer
    from arbiter.engine.prompting import Prompts

    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def preparer_for(view: Prompts, n_ctx: int) -> Preparer:
    """The engine's own checks of a decision for a context of ``n_ctx`` tokens (its labels, its
    floor from bytes, its exact length), over ``view``."""
    from arbiter.engine.cost import CostFloor
    from arbiter.engine.preparing import Preparer

    head, tail = view.fewest_around()
    floor = CostFloor(n_ctx, view.llama.vocab.max_piece_bytes(), head, tail)
    return Preparer(view, view.labels, floor)


def describe(
    view: Prompts,
    chunk: Sequence[tuple[int, str | bytes]],
    preparer: Preparer | None = None,
    adaptive: bool = True,
) -> list[dict[str, Any]]:
    """One record per line of a chunk: the decision's prompt, or the error the engine would give
    (``preparer``: the engine's own checks, for the default context when None). A decision read
    adaptively (``adaptive``, and no ``order_samples``) shows its first read: its options in their
    canonical order (``rotation``)."""
    from arbiter.engine.preparing import decision_error
    from arbiter.engine.rotation import ReadPolicy, canonical_requests

    preparer = preparer or preparer_for(view, EngineSettings.model_fields["n_ctx"].default)
    records: list[dict[str, Any]] = []
    built: list[tuple[dict[str, Any], DecisionRequest, Any]] = []
    for number, line in chunk:
        try:
            request = canonical_requests([parse_decision_line(line)], ReadPolicy(adaptive))[0]
            if len(request.options) > MAX_OPTIONS:
                raise TooManyOptions(
                    f"{len(request.options)} options given; at most {MAX_OPTIONS} options are "
                    "supported",
                    param="options",
                )
            state_bytes = len(prompts.state_text(request.state).encode("utf-8", "surrogatepass"))
            prepared = preparer.prepare(number, request, state_bytes)
            text = view.text(request)
        except Exception as exc:  # the engine's typed error for this decision, as it scores it
            error = exc if isinstance(exc, ArbiterError) else decision_error(exc)
            records.append({"line": number, "id": _id(line), "error": error.to_dict()})
            continue
        record = {
            "line": number,
            "id": request.id,
            "version": prepared.prompt_version,
            "sha256": prepared.prompt_sha256,
            "tokens": len(prepared.tokens),
            "prefix_tokens": 0,
            "text": text,
        }
        records.append(record)
        built.append((record, request, prepared.tokens))
    groups: dict[tuple[str, prompts.PromptLayout], list[tuple[dict[str, Any], Any]]] = {}
    for record, request, tokens in built:
        key = (prompts.state_text(request.state), view.layout_for(len(request.options)))
        groups.setdefault(key, []).append((record, tokens))
    for (state, layout), members in groups.items():
        shared = view.shared_prefix(state, layout, [tokens for _, tokens in members])
        for record, _ in members:
            record["prefix_tokens"] = shared
    return records


def _id(line: str | bytes) -> Any:
    try:
        return echo_id(json.loads(line))
    except ValueError:
        return None


def _write_text(record: dict[str, Any], out: TextIO) -> None:
    if "error" in record:
        error = record["error"]
        out.write(f"### line {record['line']}: error {error['code']}: {error['message']}\n\n")
        return
    out.write(
        f"### line {record['line']} id={record['id']}: {record['tokens']} tokens, "
        f"{record['prefix_tokens']} prefilled once for its state; {record['version']}, "
        f"sha256 {record['sha256'][:16]}\n{record['text']}\n\n"
    )


def cmd_prompt(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print each decision's prompt; exit 1 when no line is a decision, 2 when the model, its
    template or the profile is refused (one line on stderr, as `arbiter decide` says it)."""
    out = out or sys.stdout
    from arbiter.engine.llama import Llama
    from arbiter.engine.prompting import open_prompts
    from arbiter.models import resolve_model
    from arbiter.profiles import resolve_profile
    from arbiter.settings import engine_from_environment

    settings = engine_from_environment()  # as `arbiter serve` reads it, SM_LLAMA_CPP_* included
    if args.profile is not None:
        settings = settings.model_copy(update={"prompt_profile": args.profile})
    try:
        resolved = resolve_model(args.model or settings.model, settings.model_dir)
        profile = resolve_profile(settings.prompt_profile, resolved)
        llama = Llama(resolved.path, settings, vocab_only=True)
    except ModelLoadError as exc:  # one line, as the engine's load refuses it
        print(f"arbiter prompt: {exc.message}", file=sys.stderr)
        return 2
    try:
        try:
            view = open_prompts(llama, settings, profile)
        except ModelLoadError as exc:
            print(f"arbiter prompt: {exc.message}", file=sys.stderr)
            return 2
        preparer = preparer_for(view, settings.n_ctx)
        lines = list(numbered_lines(Path(args.file)))
        failures = 0
        for start in range(0, len(lines), args.chunk):
            chunk = lines[start : start + args.chunk]
            adaptive = settings.order_policy == "adaptive" and profile.positional_labels
            for record in describe(view, chunk, preparer, adaptive):
                failures += "error" in record
                if args.json:
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                else:
                    _write_text(record, out)
    finally:
        llama.close()
    return 1 if lines and failures == len(lines) else 0


def register(sub: Subcommands) -> None:
    command = sub.add_parser(
        "prompt", help="print each decision's prompt as the model reads it (text, tokens, prefix)"
    )
    command.add_argument("file", help="one decision {id, state, question, options} per line")
    command.add_argument("--model", type=Path, default=None, help="a .gguf (else ARBITER_MODEL...)")
    command.add_argument(
        "--chunk",
        type=chunk_size,
        default=64,
        help="lines grouped by state together (as arbiter decide)",
    )
    command.add_argument(
        "--profile", default=None, help="a prompt profile (file or built-in name; else ARBITER_...)"
    )
    command.add_argument("--json", action="store_true", help="one JSON record per decision")
    command.set_defaults(func=cmd_prompt)
