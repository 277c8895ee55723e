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


_CALLER = """
import os, sys, time
from meshloom.launch import run_ranks

def sleeper(folder):
    open(os.path.join(folder, os.environ["RANK"]), "w").write(str(os.getpid()))
    time.sleep(3600)

if __name__ == "__main__":
    run_ranks(sleeper, 2, sys.argv[1], timeout=3600)
"""


def test_ranks_die_with_a_killed_caller(tmp_path):
    """SIGKILL of the process that called run_ranks (a CI job's time-out, say): its ranks are
    the fork server's children, not its own, and die through the lifeline. Without it they
    slept on for an hour, and this test waited for them until pytest's time-out."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    try:
        while not all((tmp_path / r).exists() and (tmp_path / r).read_text() for r in "01"):
            assert caller.poll() is None, f"the caller ended (exit {caller.returncode})"
            time.sleep(0.05)
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    for r in "01":
        pid = int((tmp_path / r).read_text())
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
