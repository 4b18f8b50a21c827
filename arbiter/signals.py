"""The signals that stop a long-running command (`arbiter serve`, `work`, `runtime`, `local`).

SIGTERM (SageMaker, ECS, `kill`), SIGINT (Ctrl-C) and SIGHUP (the terminal or SSH session closed:
the shell passes it to each of its jobs) all mean the same: stop taking work and hand back what is
held. SIGHUP's default action kills at once, so a closed terminal lost what `arbiter local` had
accepted; handled like the others, it drains and keeps it.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
