"""Run a function on N real Gloo ranks, forked from the test process: meshloom.launch.run_ranks
(each rank's return value comes back in rank order; a rank's exception is re-raised here with its
traceback; a run that does not finish within `timeout` seconds is killed, so no test can hang).
"""

from __future__ import annotations

from meshloom.launch import RankError, free_port, run_ranks

__all__ = ["RankError", "free_port", "run_ranks"]
