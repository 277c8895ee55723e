"""The multi-process harness itself: results in rank order, errors re-raised, hangs bounded."""

from __future__ import annotations

import os
import time

import pytest
from dist_harness import RankError, run_ranks


def _rank_id():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _fail_on_one():
    if os.environ["RANK"] == "1":
        raise ValueError("boom on rank 1")
    return "ok"


def _hang_on_one():
    if os.environ["RANK"] == "1":
        time.sleep(600)
    return "ok"


def _die_on_one():
    if os.environ["RANK"] == "1":
        os._exit(7)
    time.sleep(600)


def test_results_in_rank_order():
    assert run_ranks(_rank_id, 3) == [(0, 3), (1, 3), (2, 3)]


def test_rank_exception_is_reraised_with_traceback():
    with pytest.raises(RankError, match="rank 1 raised:(.|\n)*boom on rank 1"):
        run_ranks(_fail_on_one, 2)


def test_hung_rank_fails_within_the_timeout():
    # The message is the time-out's own; a harness that waited for the hung rank instead would
    # run into pytest's time-out (the rank sleeps 600 s). No wall-clock bound needed.
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 3s"):
        run_ranks(_hang_on_one, 2, timeout=3)


def test_dead_rank_is_reported_without_waiting_for_the_timeout():
    # A time-out far beyond pytest's own (300 s): only noticing the death can pass this.
    with pytest.raises(RankError, match="rank 1 died with exit code 7"):
        run_ranks(_die_on_one, 2, timeout=3600)


_set_in_this_process: list[int] = []


def _rank_and_inherited():
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), bool(_set_in_this_process),
            os.environ.get("MESHLOOM_TEST_MARK"))


def test_ranks_get_a_clean_interpreter_and_this_environment(monkeypatch):
    """The default ranks come from a fork server (and "spawn" ranks, which the benchmarks use on
    CUDA, are fresh interpreters): neither sees what this process changed in its modules, both
    see its environment as it is now. Only start_method="fork" copies this process."""
    _set_in_this_process.append(1)
    monkeypatch.setenv("MESHLOOM_TEST_MARK", "now")
    try:
        clean = [(0, 2, False, "now"), (1, 2, False, "now")]
        assert run_ranks(_rank_and_inherited, 2) == clean
        assert run_ranks(_rank_and_inherited, 2, start_method="spawn", timeout=300) == clean
        assert run_ranks(_rank_and_inherited, 2, start_method="fork") == \
            [(0, 2, True, "now"), (1, 2, True, "now")]
    finally:
        _set_in_this_process.clear()
