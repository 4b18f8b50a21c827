"""``python -m arbiter``: the same command as the ``arbiter`` console script."""

from arbiter.cli import main

raise SystemExit(main())
