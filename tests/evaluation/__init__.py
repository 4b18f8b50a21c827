"""`arbiter eval` and `arbiter calibrate`: task files, metrics, the commands."""
