"""`arbiter decide` end to end: one output line per input line, errors beside results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import ROOT


def test_decide_writes_one_line_per_input_line(tmp_path: Path) -> None:
    good = json.loads((ROOT / "examples" / "decisions.jsonl").read_text().splitlines()[0])
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({**good, "id": "dup", "options": [good["options"][0], good["options"][0]]}),
        json.dumps({**good, "id": "second", "question": "Is the customer on enterprise?"}),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "arbiter", "decide", str(source), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={
            **{k: v for k, v in os.environ.items() if k != "ARBITER_MODEL"},
            "ARBITER_MODEL_DIR": str(tmp_path / "none"),
        },
    )
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [o["line"] for o in out] == [1, 2, 3, 4]
    assert out[0]["result"]["choice"] in {o["id"] for o in good["options"]}
    assert out[1]["error"]["code"] == "invalid_json" and out[1]["id"] is None
    assert out[2]["error"]["param"] == "options" and out[2]["id"] == "dup"
    assert out[3]["id"] == "second" and "result" in out[3]
    # Both scored decisions share the ticket state: the second reused the first's prefix.
    assert (
        out[3]["result"]["prompt"]["prefix_tokens"] == out[0]["result"]["prompt"]["prefix_tokens"]
    )
