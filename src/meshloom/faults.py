"""Surviving faults: preemption (SIGTERM), stalled ranks, and the test hook that injects faults.

- `Preemption` turns SIGTERM into a request that the training loop honours at the end of the
  step: every rank agrees on it (one tiny all-reduce), saves a checkpoint and exits cleanly.
- `Watchdog` is a thread per rank. It publishes the rank's progress (step, last collective) to
  the rendezvous store every few seconds. When its own rank has made no progress for
  `run.timeout_s` it reads everyone's progress, names the stalled rank (the one whose progress
  is oldest, or whose heartbeat stopped) and the collective its own rank is stuck in, and ends
  the process: a rank blocked inside a collective cannot be interrupted any other way. The
  process group's own time-out is set later than the watchdog's, as a backstop.
- `step_started` / `gradients_ready` are the seam where tests inject faults (kill, stall, raise,
  SIGTERM, NaN gradients: tests/fault_injection.py): the training loop calls them at two fixed
  points and they call whatever hooks are installed, none outside tests.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from meshloom.comm import CommCounter
from meshloom.launch import rank_failed

EXIT_STALLED = 3


# ---------------------------------------------------------------- preemption


class Preemption:
    """SIGTERM sets a flag instead of killing the process (main thread only)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: Any = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)

    @property
    def requested(self) -> bool:
        return self.signal is not None


def process_group_timeout(timeout_s: float) -> datetime.timedelta:
    """The process group's time-out: later than the watchdog's, so that the watchdog (which
    can name the stalled rank) speaks first."""
    return datetime.timedelta(seconds=timeout_s * 2 + 30)


# ---------------------------------------------------------------- stall watchdog


def _store() -> dist.Store | None:
    """A client of its own on the rendezvous store (the main thread keeps the default one)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    try:
        if addr and port:
            return dist.TCPStore(addr, int(port), is_master=False,
                                 timeout=datetime.timedelta(seconds=10))
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - without a store the watchdog still times out, unnamed
        return None


class Watchdog:
    def __init__(self, counter: CommCounter, rank: int, groups: dict[str, list[list[int]]],
                 timeout_s: float, run_dir: Path | None = None) -> None:
        """`groups`: every group of every mesh axis (ParallelDims.group_ranks), so that the
        collective counts of ranks that share a group can be compared."""
        self.counter, self.rank, self.groups = counter, rank, groups
        self.world = len(groups["world"][0])
        self.timeout_s, self.run_dir = timeout_s, run_dir
        self.interval = max(0.2, min(2.0, timeout_s / 5))
        self.step = 0
        self._beat_time = time.monotonic()
        self._stop = threading.Event()
        self._store = _store() if self.world > 1 else None
        self._thread = threading.Thread(target=self._run, name="meshloom-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.world > 1 and self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        # Joined, not left running as a daemon: a publish in flight is a C++ store call, and a
        # process that exits (or destroys its groups) under it can abort ("terminate called
        # without an active exception", once, in a rank that had just finished its run).
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._store = None

    def beat(self, step: int) -> None:
        """The main thread made progress outside any collective (a step began or ended)."""
        self.step = step
        self._beat_time = time.monotonic()

    def _progress(self) -> tuple[float, dict[str, Any]]:
        last = max(self.counter.last_time, self._beat_time)
        axis, op = self.counter.last
        idle = time.monotonic() - last
        counts: dict[str, int] = {}
        for (a, _), n in list(self.counter.calls.items()):
            counts[a] = counts.get(a, 0) + n
        return idle, {"step": self.step, "axis": axis, "op": op, "since": time.time() - idle,
                      "beat": time.time(), "counts": counts}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            idle, me = self._progress()
            self._publish(me)
            if idle > self.timeout_s:
                self._fire(idle, me)

    def _publish(self, me: dict[str, Any]) -> None:
        if self._store is not None:
            try:
                self._store.set(f"meshloom/progress/{self.rank}", json.dumps(me))
            except Exception:  # noqa: BLE001 - the store's host may be gone: keep watching
                self._store = None

    def _others(self) -> dict[int, dict[str, Any]]:
        out = {}
        if self._store is None:
            return out
        for r in range(self.world):
            key = f"meshloom/progress/{r}"
            try:
                if self._store.check([key]):
                    out[r] = json.loads(self._store.get(key))
            except Exception:  # noqa: BLE001
                return out
        return out

    def _fire(self, idle: float, me: dict[str, Any]) -> None:
        others, stale_after = self._others(), 3 * self.interval + 2
        message = stall_message(self.rank, me, idle, self.timeout_s, others, self.groups,
                                stale_after)
        rank_failed(message)
        if self.run_dir is not None:
            try:
                (self.run_dir / f"error_rank{self.rank}.txt").write_text(message + "\n")
            except OSError:
                pass
        self._say_fired()
        # The stalled rank itself lets the ranks blocked on it speak first: once it exits, their
        # collectives fail with "connection closed" instead of their watchdogs naming it. They
        # entered those collectives at most a step's compute after it stalled.
        waiting = waiting_for(self.rank, me, others, self.groups, stale_after)
        self._await_fired(waiting, time.monotonic() + self.timeout_s + 2 * self.interval + 2)
        os._exit(EXIT_STALLED)

    def _say_fired(self) -> None:
        if self._store is not None:
            try:
                self._store.set(f"meshloom/fired/{self.rank}", "1")
            except Exception:  # noqa: BLE001 - the store's host may be gone
                self._store = None

    def _await_fired(self, ranks: list[int], deadline: float) -> None:
        keys = [f"meshloom/fired/{r}" for r in ranks]
        while keys and self._store is not None and time.monotonic() < deadline:
            try:
                if self._store.check(keys):
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.2)


def axis_groups(dims: Any) -> dict[str, list[list[int]]]:
    """Every group of every named axis of a ParallelDims (the watchdog compares counts within
    them)."""
    from meshloom.mesh import AXES, FLAT_AXES

    return {a: dims.group_ranks(a) for a in ("world", *AXES, *FLAT_AXES)}


def _where(p: dict[str, Any]) -> str:
    if not p.get("op"):
        return f"step {p['step'] + 1}, before its first collective"
    return f"step {p['step'] + 1}, last collective {p['op']} on '{p['axis']}'"


def _peers(rank: int, axis: str, groups: dict[str, list[list[int]]]) -> list[int]:
    return next((g for g in groups.get(axis, []) if rank in g), [])


def _silent(rank: int, others: dict[int, dict[str, Any]], groups: dict[str, list[list[int]]],
            stale_after: float) -> set[int]:
    """Peers whose heartbeat stopped (or never came)."""
    now = time.time()
    return {r for r in range(len(groups["world"][0])) if r != rank
            and (r not in others or now - others[r]["beat"] > stale_after)}


def _ahead_of(rank: int, me: dict[str, Any], others: dict[int, dict[str, Any]],
              groups: dict[str, list[list[int]]], silent: set[int]) -> list[int]:
    """Live peers that issued more collectives than this rank on an axis they share: they wait
    for it."""
    mine = me.get("counts", {})
    return sorted({r for r, p in others.items() if r != rank and r not in silent
                   for axis, n in p.get("counts", {}).items()
                   if rank in _peers(r, axis, groups) and n > mine.get(axis, 0)})


def _behind(rank: int, me: dict[str, Any], others: dict[int, dict[str, Any]],
            groups: dict[str, list[list[int]]]) -> list[int]:
    """Peers of the axis this rank waits on that have not reached its collective."""
    axis, mine = me.get("axis", ""), me.get("counts", {})
    return sorted(r for r in _peers(rank, axis, groups) if r != rank and r in others
                  and others[r].get("counts", {}).get(axis, 0) < mine.get(axis, 0))


def waiting_for(rank: int, me: dict[str, Any], others: dict[int, dict[str, Any]],
                groups: dict[str, list[list[int]]], stale_after: float) -> list[int]:
    """The ranks blocked on this one, when this one is the stalled rank (none behind it)."""
    if _behind(rank, me, others, groups):
        return []
    return _ahead_of(rank, me, others, groups, _silent(rank, others, groups, stale_after))


def stall_message(rank: int, me: dict[str, Any], idle: float, timeout_s: float,
                  others: dict[int, dict[str, Any]], groups: dict[str, list[list[int]]],
                  stale_after: float) -> str:
    """One line: what this rank waited in and for how long, and which rank stalled.

    Ranks that share a group issue the same collectives on it in the same order, so their
    counts on that axis say who is behind: a peer with fewer collectives on the axis this rank
    waits in has not reached it (it stalled); a peer with more is waiting for this rank."""
    now = time.time()
    others = {r: p for r, p in others.items() if r != rank}
    silent = _silent(rank, others, groups, stale_after)
    waiting_for_me = _ahead_of(rank, me, others, groups, silent)
    axis = me.get("axis", "")
    behind = _behind(rank, me, others, groups)
    if waiting_for_me and not behind:
        return (f"rank {rank} stalled: no progress for {idle:.0f} s (run.timeout_s="
                f"{timeout_s:g}) at {_where(me)}; rank(s) "
                f"{', '.join(map(str, sorted(set(waiting_for_me))))} wait for it")
    if behind:
        r = behind[0]
        state = "not responding" if r in silent else \
            f"no progress for {now - others[r]['since']:.0f} s"
        culprit = f"stalled rank: {r} ({state}, at {_where(others[r])})"
    elif not others:
        culprit = "the other ranks' progress could not be read from the rendezvous store"
    elif silent:
        r = min(silent)
        culprit = f"stalled rank: {r} (not responding" + \
            (f"; last seen at {_where(others[r])})" if r in others else ")")
    else:
        r = min(others, key=lambda q: (others[q]["since"], q))
        culprit = (f"stalled rank: unclear; the longest without progress is {r} "
                   f"({now - others[r]['since']:.0f} s, at {_where(others[r])})")
    waiting = f"{me['op']} on axis '{axis}'" if me.get("op") else "its first collective"
    return (f"rank {rank}: {waiting} at step {me['step'] + 1} timed out after {idle:.0f} s "
            f"(run.timeout_s={timeout_s:g}); {culprit}")


# ---------------------------------------------------------------- the test seam


class StepHook(Protocol):
    """Called by the training loop at two fixed points of every step (tests install these)."""

    def step_started(self, rank: int, step: int) -> None: ...

    def gradients_ready(self, rank: int, step: int, params: list[torch.Tensor]) -> None: ...


_hooks: list[StepHook] = []


def install(hook: StepHook) -> Callable[[], None]:
    """Install a step hook in this process; returns the function that removes it."""
    _hooks.append(hook)
    return lambda: _hooks.remove(hook)


def step_started(rank: int, step: int) -> None:
    """A (0-based) step begins on this rank."""
    for hook in list(_hooks):
        hook.step_started(rank, step)


def gradients_ready(rank: int, step: int, params: list[torch.Tensor]) -> None:
    """The step's gradients are complete, before the norm is taken and the verdict agreed."""
    for hook in list(_hooks):
        hook.gradients_ready(rank, step, params)
