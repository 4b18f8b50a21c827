"""`arbiter eval` and `arbiter calibrate`: labeled decisions scored one at a time, then measured.

``tasks`` reads labeled task files (Arbiter's format and JevBench's), ``backends`` answers a decision
(the in-process engine, or a running endpoint over HTTP), ``run`` scores every item into records,
``metrics`` holds the formulas (accuracy, Brier, ECE, latency), ``report`` the summaries and
Markdown, ``calibrate`` fits temperatures and measures them on held-out items, ``cli`` the commands.
"""
