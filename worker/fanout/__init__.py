"""The fan-out: a job too large for one worker is split into shards that any worker scores, and
merged back, in input order, into the single path's records.

Every step is idempotent by construction, so no step depends on who won a race or on whether an
answer arrived (docs/batch-jobs.md, "Exactly once, step by step", names the faults each survives
and the test that proves it):

- :mod:`.keys`: one folder per input version, named by a hash; :mod:`.plan`: the cut, named by what
  determines it, written once; :mod:`.split` cuts, :mod:`.frames` is the shard input format;
- :mod:`.messages`: shard and merge messages; :mod:`.runner`: what each message does
  (:mod:`.job` for job messages: split, repair, or run whole);
- :mod:`.shard` scores or fails a shard; :mod:`.outcome`: its one outcome, first write wins;
- :mod:`.merge`: results and summary from the outcomes, and the job's end; :mod:`.parts`: the
  upload's part plan; :mod:`.summary`; :mod:`.status`: progress for ``arbiter submit``.
"""

from worker.fanout.runner import FanOut

__all__ = ["FanOut"]
