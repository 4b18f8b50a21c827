"""`make mutate`: undo each named fix, run the tests that guard it, expect them to fail, restore.

A test that passes with its fix removed guards nothing (issue 22 found three: JSON Lines' in-band
path, an SSE test that only hung, a surrogate test that needed both layers gone). Each mutation
below names the fix as the exact text it adds, the text the code would read without it, and the
tests that must then fail. The file is restored however the run ends.

    .venv/bin/python scripts/mutate.py              # every mutation
    .venv/bin/python scripts/mutate.py NAME ...     # some of them; --list names them all

Exit status 0 when every mutation was caught; 1 when one survived (or its text is gone: a fix
that moved must move here too).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    fix: str  # exactly once in the file
    without: str  # what the code reads without the fix
    tests: tuple[str, ...]


BUDGET = "tests/arbiter/test_budget.py::"
BUDGETS = "tests/adapter/test_budgets.py::"
HOSTILE = "tests/adapter/test_hostile.py::"
FAULTS = "tests/arbiter/test_engine_faults.py::"

MUTATIONS = (
    Mutation(
        "floor-from-bytes",
        "arbiter/engine/preparing.py",
        "parts = self.cost.check_decision(request, Parts.of(request, state_bytes))",
        "parts = Parts.of(request, state_bytes)",
        (BUDGET + "test_a_5_mb_state_is_refused_from_its_bytes_without_tokenizing",),
    ),
    Mutation(
        "tokenized-once",
        "arbiter/engine/preparing.py",
        "fixed = self.prompts.fixed_tokens(content.layout)",
        "fixed = self.prompts.fixed_tokens(content.layout) + 0 * len(self.prompts.tokens(content))",
        (BUDGET + "test_a_too_long_prompt_is_tokenized_once_and_names_its_largest_part",),
    ),
    Mutation(
        "options-named",
        "arbiter/engine/cost.py",
        'sizes = {"state": self.state, "question": self.question, "options": options}',
        'sizes = {"state": self.state, "question": self.question, "options": max(self.options)}',
        (
            BUDGET + "test_many_short_options_name_the_options_not_the_state",
            "tests/arbiter/test_many_options.py::"
            "test_the_context_check_counts_the_code_branches_before_llama_cpp",
        ),
    ),
    Mutation(
        "refused-before-admission",
        "adapter/budgets.py",
        "            cost.check_decision(request)\n",
        "",
        (BUDGETS + "test_what_cannot_fit_is_refused_before_admission",),
    ),
    Mutation(
        "chat-floor",
        "adapter/chat.py",
        "    engine.cost.check_chat([m.text for m in chat_request.messages])",
        "    pass",
        (BUDGETS + "test_what_cannot_fit_is_refused_before_admission",),
    ),
    Mutation(
        "chat-tokenized-in-slot",
        "adapter/chat.py",
        "    async with state.admission.slot() as slot:\n        tokens = await slot.run(prompt)",
        "    early = await asyncio.to_thread(prompt)\n"
        "    async with state.admission.slot() as slot:\n"
        "        tokens = early",
        (BUDGETS + "test_a_prompt_is_tokenized_in_its_slot_not_while_it_waits[chat]",),
    ),
    Mutation(
        "completion-tokenized-in-slot",
        "adapter/text_completions.py",
        "    async with state.admission.slot() as slot:\n"
        "        # Tokenized, and the grammar compiled, within the in-flight bound (as chat is).\n"
        "        tokens = await slot.run(engine.encode_segments, [(body.prompt, True)])",
        "    early = await asyncio.to_thread(engine.encode_segments, [(body.prompt, True)])\n"
        "    async with state.admission.slot() as slot:\n"
        "        tokens = early",
        (BUDGETS + "test_a_prompt_is_tokenized_in_its_slot_not_while_it_waits[completion]",),
    ),
    Mutation(
        "token-budget",
        "arbiter/engine/budget.py",
        "if self.max_tokens is not None and tokens > self.max_tokens:",
        "if False:",
        (
            BUDGET + "test_a_request_over_its_token_budget_is_refused_before_any_decode",
            BUDGETS + "test_a_request_over_its_token_budget_is_413_before_the_engine",
        ),
    ),
    Mutation(
        "tokenizing-stops-over-budget",
        "arbiter/engine/scoring.py",
        "                if budget is not None:  # over already: the rest is not tokenized\n"
        "                    budget.check_tokens(tokens, None, floor=True)\n",
        "",
        (BUDGET + "test_tokenizing_stops_once_a_request_is_over_its_budget",),
    ),
    Mutation(
        "time-budget",
        "arbiter/engine/budget.py",
        "if estimate > remaining:",
        "if False:",
        (BUDGET + "test_the_time_budget_refuses_by_estimate_and_stops_at_a_group",),
    ),
    Mutation(
        "cancel-between-decodes",
        "arbiter/engine/llama.py",
        "            if self._interrupt is not None:\n                self._interrupt()\n",
        "",
        (
            BUDGET + "test_a_cancelled_request_stops_at_the_next_decode_and_leaves_nothing_behind",
            BUDGET + "test_a_cancelled_generation_stops_between_decodes",
        ),
    ),
    Mutation(
        "cancel-ends-the-call",
        "arbiter/engine/preparing.py",
        "    if isinstance(exc, RequestCancelled):\n        raise exc\n",
        "",
        (BUDGET + "test_a_cancelled_request_stops_at_the_next_decode_and_leaves_nothing_behind",),
    ),
    Mutation(
        "abandoned-slot-cancels",
        "adapter/admission.py",
        "                slot.cancel.set()\n",
        "",
        (
            BUDGETS + "test_a_disconnected_request_stops_its_work_and_frees_its_slot",
            BUDGETS + "test_a_disconnected_256_decision_request_frees_the_engine_within_one_"
            "decision",
        ),
    ),
    Mutation(
        "in-band-after-start",
        "adapter/middleware.py",
        "if stream is not None and stream.response.prepared:",
        "if False:",
        (
            HOSTILE + "test_a_fault_after_a_jsonl_stream_started_ends_it_with_one_error_record",
            HOSTILE + "test_a_fault_mid_sse_stream_is_an_error_event_then_done",
        ),
    ),
    Mutation(
        "client-gone-mid-stream",
        "adapter/middleware.py",
        "    except ConnectionResetError:\n",
        "    except ZeroDivisionError:\n",
        (BUDGETS + "test_a_client_that_leaves_a_stream_is_499_not_an_internal_error",),
    ),
    Mutation(
        "jsonl-chunk-fault",
        "adapter/jsonlines.py",
        "    except Exception as exc:  # a fault outside any one decision",
        "    except ZeroDivisionError as exc:  # a fault outside any one decision",
        (HOSTILE + "test_a_fault_outside_any_decision_makes_each_line_of_its_chunk_an_error",),
    ),
    Mutation(
        "jsonl-lines-before-the-stop",
        "adapter/jsonlines.py",
        "        except (PayloadTooLarge, RequestTimeout) as exc:",
        "        except ZeroDivisionError as exc:",
        (
            HOSTILE + "test_a_client_that_stalls_mid_stream_gets_its_lines_then_the_timeout",
            HOSTILE + "test_lines_read_before_the_body_limit_still_get_their_output",
        ),
    ),
    Mutation(
        "jsonl-chunk-in-hand-answered",
        "adapter/jsonlines.py",
        "        except Exception:\n            if not started:",
        "        except ZeroDivisionError:\n            if not started:",
        (HOSTILE + "test_a_fault_after_a_jsonl_stream_started_ends_it_with_one_error_record",),
    ),
    Mutation(
        "surrogate-schema",
        "arbiter/schema.py",
        '        value.encode("utf-8")\n    except UnicodeEncodeError as exc:',
        '        value.encode("utf-8", "surrogatepass")\n    except UnicodeEncodeError as exc:',
        (
            "tests/worker/test_jobs.py::"
            "test_a_lone_surrogate_line_is_one_error_line_with_the_real_engine",
            "tests/arbiter/test_schema.py",
        ),
    ),
    Mutation(
        "surrogate-tokenizer",
        "arbiter/engine/llama.py",
        '            data = text.encode("utf-8")\n        except UnicodeEncodeError as exc:',
        '            data = text.encode("utf-8")\n        except ZeroDivisionError as exc:',
        (FAULTS + "test_a_lone_surrogate_fails_only_its_own_decision",),
    ),
    Mutation(
        "surrogate-last-layer",
        "arbiter/engine/preparing.py",
        "    if isinstance(exc, UnicodeError):",
        "    if isinstance(exc, ZeroDivisionError):",
        (FAULTS + "test_a_unicode_error_from_anywhere_in_a_decision_is_its_invalid_text",),
    ),
    Mutation(
        "calibration-range",
        "arbiter/engine/calibration.py",
        "if not usable or not (MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):",
        "if not usable or not (0 < value):",
        ("tests/arbiter/test_calibration.py::test_file_round_trip_and_refusals",),
    ),
    Mutation(
        "prefix-copied-once",
        "arbiter/engine/llama.py",
        "            del state[written:]\n        return state\n",
        "            del state[written:]\n        return bytearray(bytes(state))\n",
        (BUDGET + "test_a_saved_prefix_state_is_copied_once",),
    ),
    Mutation(
        "systemone-state-at-the-top",
        "arbiter/systemone.py",
        '    if parts[0] == "state":\n        return ["state"]',
        '    if parts[0] == "state":\n        return ["questions", qid, "state"]',
        (
            "tests/arbiter/test_systemone.py::"
            "test_a_state_too_long_for_every_question_is_named_once_at_body_state",
            "tests/arbiter/test_systemone.py::test_a_bad_state_is_named_at_body_state",
        ),
    ),
    Mutation(
        "loopback-by-default",
        "arbiter/settings.py",
        '        default="127.0.0.1",',
        '        default="0.0.0.0",',
        ("tests/arbiter/test_settings.py::test_the_server_listens_on_loopback_unless_told",),
    ),
    Mutation(
        "container-listens-everywhere",
        "adapter/entrypoint.py",
        '        env.setdefault("ARBITER_HOST", "0.0.0.0")',
        "        pass",
        (
            "tests/adapter/test_entrypoint.py::"
            "test_serve_listens_on_every_interface_in_a_container_unless_told",
        ),
    ),
    Mutation(
        "late-outcome-is-nobodys",
        "worker/fanout/outcome.py",
        "        await delete_quietly(s3, bucket, outcome.output)\n        return None",
        "        await delete_quietly(s3, bucket, outcome.output)\n        return outcome, False",
        (
            "tests/worker/test_fanout_faults.py::"
            "test_a_shard_failed_as_its_job_ends_sends_no_dlq_record",
        ),
    ),
)


def run_tests(tests: tuple[str, ...], timeout_s: float) -> tuple[int, float]:
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    command += ["--timeout", str(int(timeout_s)), *tests]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    return done.returncode, time.perf_counter() - started


def mutate(mutation: Mutation, timeout_s: float) -> tuple[str, float]:
    path = ROOT / mutation.path
    original = path.read_bytes()
    text = original.decode()
    if text.count(mutation.fix) != 1:
        return f"GONE (its text is in {mutation.path} {text.count(mutation.fix)} times)", 0.0
    try:
        path.write_text(text.replace(mutation.fix, mutation.without))
        code, seconds = run_tests(mutation.tests, timeout_s)
    finally:
        path.write_bytes(original)
    # pytest: 1 some test failed (the mutation is caught); 0 all passed (it survived); others:
    # the run itself broke (a test not found, an import error), which proves nothing.
    verdict = {0: "SURVIVED", 1: "caught"}.get(code, f"BROKEN (pytest exit {code})")
    return verdict, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="name every mutation and its tests")
    parser.add_argument("--timeout", type=float, default=300, help="pytest --timeout per test")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:32} {m.path}  ->  {', '.join(t.split('::')[-1] for t in m.tests)}")
        return 0
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutations: {', '.join(unknown)} (see --list)")
    chosen = [known[n] for n in args.names] if args.names else list(MUTATIONS)
    # A SIGTERM (a CI timeout) still restores the file being mutated.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    failed = 0
    for m in chosen:
        verdict, seconds = mutate(m, args.timeout)
        failed += verdict != "caught"
        print(f"{m.name:32} {verdict:10} {seconds:6.1f} s  {m.path}", flush=True)
    print(f"{len(chosen) - failed} of {len(chosen)} mutations caught by their tests")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
