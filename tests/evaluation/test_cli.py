"""`arbiter eval` / `arbiter calibrate` end to end: in-process engine and a --url endpoint."""

from __future__ import annotations

import io
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from arbiter.cli import build_parser, main
from evaluation.backends import HttpBackend
from evaluation.cli import cmd_calibrate, cmd_eval
from tests import DATA
from tests.fakes import decision


class _Fake(BaseHTTPRequestHandler):
    """A stand-in endpoint: the longest description wins; id "route-2" gets a typed 422."""

    seen: ClassVar[list[dict[str, object]]] = []

    def do_GET(self) -> None:
        self._send(404, {"error": {"type": "not_found_error", "code": "x", "message": "no"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        refused = {"error": {"type": "invalid_request_error", "code": "x", "message": "no"}}
        if "decisions" in body:
            _Fake.seen.extend(body["decisions"])
            results = [
                refused | {"id": d["id"]} if d["id"].startswith("route-2") else _Fake.result(d)
                for d in body["decisions"]
            ]
            self._send(200, {"results": results})
            return
        decision = body["decision"]
        _Fake.seen.append(decision)
        if self.path != "/invocations" or decision["id"] == "route-2":
            self._send(422, refused)
            return
        self._send(200, {"result": _Fake.result(decision)})

    @staticmethod
    def result(decision: dict[str, Any]) -> dict[str, Any]:
        options = decision["options"]
        # The longest description wins, ties broken by the id (never by position).
        logits = [
            len(o["description"]) / 10 + (sum(map(ord, o["id"])) % 97) * 1e-4 for o in options
        ]
        total = sum(math.exp(z) for z in logits)
        probs = [math.exp(z) / total for z in logits]
        ids = [o["id"] for o in options]
        return {
            "id": decision["id"],
            "option_ids": ids,
            "probabilities": probs,
            "option_logits": logits,
            "choice": ids[probs.index(max(probs))],
            "allowed_mass": 0.9,
            "probability_status": "raw",
            "prompt": {"version": "fake-v1"},
            "model": {"file": "fake.gguf", "sha256": "cd" * 32},
        }

    def _send(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def fake_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Fake.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _args(*argv: str) -> object:
    return build_parser().parse_args(list(argv))


def test_eval_against_an_endpoint_counts_failures_as_wrong(fake_url: str, tmp_path: Path) -> None:
    out = io.StringIO()
    args = _args(
        "eval",
        str(DATA / "labeled-mini.jsonl"),
        str(DATA / "jevbench-mini.jsonl"),
        "--url",
        fake_url,
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert cmd_eval(args, out) == 0
    report = json.loads((tmp_path / "eval-report.json").read_text())
    overall = report["overall"]
    assert (overall["n"], overall["failures"], overall["n_scored"]) == (9, 1, 8)
    assert report["backend"] == fake_url
    assert report["prompt_version"] == "fake-v1"
    assert set(report["by_file"]) == {"labeled-mini.jsonl", "jevbench-mini.jsonl"}
    assert set(report["by_question_type"]) == {"decision", "noul", "choice", "score"}
    assert set(report["by_tier"]) == {"-", "easy", "hard"}
    assert report["by_question_type"]["noul"]["n"] == 2
    records = [json.loads(x) for x in (tmp_path / "eval-records.jsonl").read_text().splitlines()]
    failed = next(r for r in records if r["id"] == "route-2")
    assert failed["correct"] is False and failed["error"]["status"] == 422
    # The endpoint saw what /v1/systemone would send the engine, typed.
    sent = {d["id"]: d for d in _Fake.seen}
    assert sent["jb-score-1"]["question_type"] == "score"
    assert "order_samples" not in sent["jb-score-1"]
    assert len(_Fake.seen) == 18  # each item again with its options reversed
    assert report["order"]["compared"] == 8 and report["order"]["flips"] == 0
    assert (tmp_path / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "risk-coverage.png").read_bytes()[:4] == b"\x89PNG"
    assert "| overall | 9 | 1 |" in out.getvalue()
    assert "| type: noul | 2 |" in out.getvalue()


def test_eval_order_samples_are_sent_and_compared(fake_url: str, tmp_path: Path) -> None:
    args = _args(
        "eval",
        str(DATA / "labeled-mini.jsonl"),
        "--url",
        fake_url,
        "--order-samples",
        "3",
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert cmd_eval(args, io.StringIO()) == 0
    assert [d.get("order_samples") for d in _Fake.seen] == [3] * 6
    report = json.loads((tmp_path / "eval-report.json").read_text())
    assert report["order_samples"] == 3
    assert (report["order"]["compared"], report["order"]["flips"]) == (2, 0)


def test_unreachable_endpoint_is_a_failure_not_a_crash() -> None:
    outcome = HttpBackend("http://127.0.0.1:9", timeout=2).decide(decision())
    assert outcome[0] is None and outcome[1]["type"] == "connection_error"  # type: ignore[index]


def test_bad_task_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    assert main(["eval", str(bad), "--out", str(tmp_path)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_calibrate_against_an_endpoint_writes_a_loadable_file(
    fake_url: str, tmp_path: Path
) -> None:
    from arbiter.engine.calibration import Calibration

    target = tmp_path / "cal.json"
    out = io.StringIO()
    args = _args(
        "calibrate",
        str(DATA / "jevbench-mini.jsonl"),
        "--url",
        fake_url,
        "--holdout-split",
        "test",
        "--output",
        str(target),
        "--quiet",
    )
    assert cmd_calibrate(args, out) == 0
    loaded = Calibration.load(target)
    assert loaded.model_sha256 == "cd" * 32
    raw = json.loads(target.read_text())
    assert raw["report"]["fit_items"] == 3 and raw["report"]["held_out_items"] == 3
    assert target.with_suffix(".png").exists()
    assert "| before (raw, one read) |" in out.getvalue()
    # Every read is one order of one item, raw, sent with the item's other orders together.
    assert all(d["order_samples"] == 1 and d["temperature"] == 1.0 for d in _Fake.seen)


def test_eval_in_process_with_order_samples(tmp_path: Path) -> None:
    """The real engine: two JevBench items, K=2 orders, flips counted, report and PNGs written."""
    lines = (DATA / "jevbench-mini.jsonl").read_text().splitlines()[:2]
    task = tmp_path / "two.jsonl"
    task.write_text("\n".join(lines) + "\n")
    out = io.StringIO()
    args = _args("eval", str(task), "--order-samples", "2", "--out", str(tmp_path / "o"), "--quiet")
    assert cmd_eval(args, out) == 0
    report = json.loads((tmp_path / "o" / "eval-report.json").read_text())
    assert report["overall"]["failures"] == 0
    assert report["prompt_version"].endswith("+order-2")
    assert report["order"]["compared"] == 2
    assert 0 <= report["order"]["flips"] <= 2
    assert report["model"]["file"].endswith(".gguf")
    assert (tmp_path / "o" / "reliability.png").exists()
    assert "answer changes when the options are reversed" in out.getvalue()


def test_two_profiles_are_compared_on_one_labeled_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`arbiter eval --profile`: the same items under the built-in and a profile of one's own; each
    report names its profile (version and sha256)."""
    import hashlib

    from arbiter.profiles import builtin_bytes

    mine = (
        builtin_bytes("arbiter-letters-v1")
        .decode()
        .replace('name = "arbiter-letters-v1"', 'name = "terse-v1"')
        .replace("You are a careful decision maker. ", "")
    )
    profile = tmp_path / "terse.toml"
    profile.write_text(mine)
    task = DATA / "labeled-mini.jsonl"
    reports = {}
    for name, value in (("builtin", "arbiter-letters-v1"), ("mine", str(profile))):
        out = tmp_path / name
        argv = [
            "eval",
            str(task),
            "--profile",
            value,
            "--out",
            str(out),
            "--quiet",
            "--no-reversed",
        ]
        assert cmd_eval(_args(*argv), io.StringIO()) == 0
        reports[name] = json.loads((out / "eval-report.json").read_text())
    assert reports["builtin"]["prompt_version"] == "arbiter-letters-v1/plain"
    digest = hashlib.sha256(mine.encode()).hexdigest()
    # A profile of one's own carries its file's digest, so a file named like a built-in is told apart.
    assert reports["mine"]["prompt_version"] == f"terse-v1@{digest[:12]}/plain"
    assert reports["mine"]["prompt_profile_sha256"] == digest
    assert reports["builtin"]["prompt_profile_sha256"] != reports["mine"]["prompt_profile_sha256"]
    assert reports["mine"]["overall"]["n"] == reports["builtin"]["overall"]["n"] == 3
    # An endpoint serves the profile it was started with: --profile with --url is refused.
    assert main(["eval", str(task), "--url", "http://127.0.0.1:9", "--profile", "x"]) == 2
    assert "applies to the in-process engine" in capsys.readouterr().err


def test_two_configurations_side_by_side(tmp_path: Path) -> None:
    """`--compare ARBITER_...=...`: the same items under a second in-process configuration, both
    reports written, the headline figures side by side; a setting that is not one is refused."""
    out = io.StringIO()
    task = DATA / "labeled-mini.jsonl"
    args = _args(
        "eval",
        str(task),
        "--out",
        str(tmp_path),
        "--quiet",
        "--compare",
        "ARBITER_ORDER_POLICY=single,ARBITER_SHIPPED_CALIBRATION=false",
    )
    assert cmd_eval(args, out) == 0
    ours = json.loads((tmp_path / "eval-report.json").read_text())
    other = json.loads((tmp_path / "compare" / "eval-report.json").read_text())
    assert ours["order"]["flips"] == 0  # the canonical first order: reversing changes nothing
    assert ours["overall"]["mean_orders_read"] >= 1
    assert other["overall"]["mean_orders_read"] == 1
    assert other["probability_status"] == "raw"
    printed = out.getvalue()
    assert "Side by side:" in printed
    assert "| answer changes when the options are reversed |" in printed
    bad = _args("eval", str(task), "--compare", "ARBITER_NOT_A_SETTING=1", "--out", str(tmp_path))
    assert cmd_eval(bad, io.StringIO()) == 2
