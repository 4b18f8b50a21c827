"""Arbiter's tests: one folder per package, shared fakes (``fakes``), S3 and SQS on a local moto
server (``aws``), generated input (``strategies``), a live server on loopback (``live_server``)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DATA = ROOT / "tests" / "data"
