"""The environment a test gives a process it starts, less the settings it must not inherit.

A test that strips every ``ARBITER_*`` variable (to show a command's defaults) keeps the tests' own
empty model store (``ARBITER_MODEL_STORE``, set in conftest): a catalog model installed on the
machine (`make run` installs one) would otherwise be every such command's default model. So does
``ARBITER_LOCAL_STATE_DIR``: a stack a test starts keeps its S3 + SQS state there, not in the
user's own `arbiter local` state.
"""

from __future__ import annotations

import os

KEPT = ("ARBITER_MODEL_STORE", "ARBITER_LOCAL_STATE_DIR")


def kept(name: str) -> bool:
    return name in KEPT


def environ_without(*prefixes: str) -> dict[str, str]:
    """``os.environ`` less the variables that start with one of ``prefixes`` (``KEPT`` stays)."""
    return {k: v for k, v in os.environ.items() if kept(k) or not k.startswith(prefixes)}
