"""How meshloom starts ranks, and what the user reads when one of them dies.

Launcher side:
- `torchrun(Launch(...))` runs a per-rank module (`meshloom.train`, `meshloom.inference`) on
  every rank through torch's elastic agent (`torch.distributed.run`), restarting them up to
  `max_restarts` times. When a rank dies, the cause is printed first (the rank that died and
  how: signal or exit code, with the line it left in its error file), then what happens next
  ("restarting (1 of 2) from step_0000100"), and only then the other ranks' symptoms (a
  collective that lost its peer), one line each: `failure_report`.
- `run_ranks(fn, world)` forks ranks from a process that has already imported torch and
  collects their return values (the tests' and the benchmarks' harness).
- `free_port()`.

Rank side:
- `join_group()` forms the process group from torchrun's environment.
- `rank_failed(line)` hands a rank's one-line failure to whoever launched it: under an elastic
  agent, through the agent's error file (so that the launcher can print the cause before the
  symptoms, which the ranks would otherwise print first, racing); otherwise on stderr.

This module imports torch only inside functions: the command line imports it before it knows
whether anything will run.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import json
import logging
import os
import pickle
import queue
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 2
# A collective whose peer is gone fails with one of these (Gloo, NCCL, the TCP store): what a
# survivor reports then is a symptom of another rank's death, not a cause.
PEER_LOST = ("closed by peer", "reset by peer", "broken pipe", "connection refused",
             "remote process exited", "communicator was aborted", "failed to recv")


def builtin_config(name: str) -> Path:
    """Path of a config shipped inside the package: what `meshloom train` and a rank started
    without a config run (the demo)."""
    return Path(str(resources.files("meshloom") / "configs" / f"{name}.toml"))


def _ephemeral_low() -> int:
    """The first port of the range the system hands out for outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port that is free now, for a rendezvous a rank will bind a moment later.

    Taken below the ephemeral range: a port the system picks (bind to 0) is an ephemeral one,
    and in the moment before the rank binds it, any outgoing connection on the machine (Gloo
    opens many) may be given the same port: EADDRINUSE, seen when tests ran beside other jobs.
    Below the range only another explicit bind can take it."""
    low = min(_ephemeral_low(), 65536)
    rng = random.Random()  # not the global RNG: training seeds must not move it
    for _ in range(200):
        port = rng.randrange(max(1024, low - 20000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: fall back to the system's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(line: str) -> None:
    """One line to stderr in a single write. Every rank shares the launcher's stderr, and
    print() writes the text and its newline separately (stderr is write-through), so lines that
    ranks print at the same moment came out spliced into one."""
    os.write(2, (line + "\n").encode())


# ---------------------------------------------------------------- rank side


def rank_env() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from torchrun's environment."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local_rank, local_world


def attempt_store(world: int, timeout: datetime.timedelta):
    """Under torchrun, the ranks rendezvous on the agent's store, which outlives a restart: the
    addresses that the killed attempt's ranks published are still in it, and a restarted rank
    that reads one fails to connect. A key prefix per attempt keeps each attempt to its own.
    None outside torchrun (the usual env:// rendezvous)."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=world, is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"meshloom/attempt_{attempt}", store)


_collect_registered = False


def _collect_groups_at_exit() -> None:
    """Collect garbage once more at exit, while the interpreter still runs. Process groups that
    reference cycles keep alive (a model's hooks holding its strategy and mesh) are otherwise
    freed during interpreter finalization, where Gloo's teardown aborted a rank ("terminate
    called without an active exception": 7 of 24 four-rank exits of
    examples/train_custom_model.py here). Best is to collect before `destroy_process_group`, as
    the example and meshloom's loop do (0 of 40); this is the fallback for a script that
    does not (1 of 40)."""
    global _collect_registered
    if not _collect_registered:
        atexit.register(gc.collect)
        _collect_registered = True


def join_group(backend: str, timeout: datetime.timedelta, device: Any = None, *,
               alone: bool = False) -> None:
    """Join the ranks' process group, unless this process is already in one. `device`: the
    rank's GPU, which NCCL binds to. `alone`: one rank forms a group of its own in memory (no
    port, whatever the environment says); otherwise torchrun's environment (RANK, WORLD_SIZE,
    MASTER_*; a lone rank started by hand gets 127.0.0.1:29500)."""
    import torch.distributed as dist

    if not alone:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    if dist.is_initialized():
        return
    _collect_groups_at_exit()
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    if alone:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return
    rank, world, _, _ = rank_env()
    store = attempt_store(world, timeout)
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend, world_size=world, rank=rank, **kwargs)


def rank_failed(line: str, details: str = "") -> None:
    """A rank's failure, one line that names the rank ("rank 1 failed: ..."). Under an elastic
    agent it goes to the agent's error file (torch's format), and the launcher prints it in
    cause-first order; `details` (a traceback) go with it for torchrun's own report. Otherwise
    the line goes to stderr, the details after it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        record = {"message": {"message": line, "extraInfo": {
            "py_callstack": details or line, "timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w") as f:
                json.dump(record, f)
            return
        except OSError:
            pass  # said below instead
    say(f"meshloom: {line}")
    if details:
        os.write(2, details.encode())


# ---------------------------------------------------------------- what the user reads


@dataclass
class RankEnd:
    """How one rank of a failed attempt ended."""

    rank: int
    exitcode: int  # negative: killed by that signal
    message: str = ""  # the line it left in its error file
    by_itself: bool = True  # False: it was still running when the launcher stopped the others


def ended(exitcode: int) -> str:
    """How a process ended, for a sentence about it: 'was killed by SIGKILL'."""
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _symptom(end: RankEnd) -> bool:
    text = end.message.lower()
    return any(s in text for s in PEER_LOST)


def _stopped(end: RankEnd) -> bool:
    return not end.by_itself and not end.message


def causes(ends: list[RankEnd]) -> list[RankEnd]:
    """The ranks that failed by themselves for a reason of their own: killed, or with an error
    that is not a lost peer. If every failure looks like a lost peer, all of them."""
    own = [e for e in ends if not _symptom(e) and not _stopped(e)]
    return own or [e for e in ends if not _stopped(e)] or list(ends)


def _with_message(end: RankEnd) -> str:
    text = " ".join(end.message.split())
    if not text.startswith(f"rank {end.rank}"):  # an error file that meshloom did not write
        text = f"rank {end.rank} failed: {text}"
    if end.exitcode < 0 and not end.by_itself:  # it said what went wrong, then hung
        how = "then stopped by the launcher"
    else:
        how = ended(end.exitcode).removeprefix("was ").replace("exited with", "exit")
    return f"meshloom: {text} ({how})"


def _bare(ends: list[RankEnd]) -> list[str]:
    """Ranks that left no message, grouped by how they ended: one line per way."""
    groups: dict[int, list[int]] = {}
    for e in ends:
        groups.setdefault(e.exitcode, []).append(e.rank)
    lines = []
    for code, ranks in sorted(groups.items()):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else \
            "ranks " + ", ".join(map(str, ranks))
        lines.append(f"meshloom: {who} {ended(code)}")
    return lines


def _lines(ends: list[RankEnd]) -> list[str]:
    """Killed ranks first, then those that exited; within each, those that left a line."""
    out = []
    for group in ([e for e in ends if e.exitcode < 0], [e for e in ends if e.exitcode >= 0]):
        out += [_with_message(e) for e in group if e.message]
        out += _bare([e for e in group if not e.message])
    return out


def failure_report(ends: list[RankEnd], next_step: str = "") -> list[str]:
    """What the user reads about a failed attempt, in this order: the cause (the ranks that
    died by themselves: killed ones first), what happens next (e.g. the restart), then the
    others' symptoms and the ranks the launcher stopped."""
    first = sorted(causes(ends), key=lambda e: e.rank)
    rest = sorted((e for e in ends if e not in first and not _stopped(e)), key=lambda e: e.rank)
    stopped = [e for e in ends if e not in first and _stopped(e)]
    lines = _lines(first)
    if next_step:
        lines.append(f"meshloom: {next_step}")
    lines += _lines(rest)
    if stopped:
        ranks = ", ".join(str(e.rank) for e in sorted(stopped, key=lambda e: e.rank))
        lines.append(f"meshloom: rank(s) {ranks} stopped by the launcher")
    return lines


# ---------------------------------------------------------------- launcher side (torchrun)


@dataclass
class Launch:
    """One torchrun launch of a per-rank module."""

    module: str  # run on every rank as `python -m MODULE ARGS`
    args: list[str]
    nproc: int  # ranks on this node
    what: str = "training"  # for the last line: "training failed on rank 1"
    max_restarts: int = 0
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = "meshloom"
    # Where restarted ranks will resume from (a checkpoint's name), None: from the start.
    resume_point: Callable[[], str | None] | None = None
    on_signal: str = ""  # said after "stopped by signal SIGTERM" when the launcher gets one


def _torchrun_argv(launch: Launch) -> list[str]:
    argv = ["--nproc-per-node", str(launch.nproc)]
    if launch.nnodes > 1 or launch.rdzv_endpoint:
        argv += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank),
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", launch.rdzv_endpoint,
                 "--rdzv-id", launch.rdzv_id]
    else:
        argv += ["--standalone"]
    return argv + ["--max-restarts", str(launch.max_restarts), "-m", launch.module,
                   *launch.args]


class _Outcome:
    """What the agent saw of the last failed attempt (for the launcher's last line)."""

    def __init__(self) -> None:
        self.reported = False
        self.causes: list[RankEnd] = []
        self.bad_input = False

    def record(self, ends: list[RankEnd]) -> None:
        self.reported = True
        self.causes = causes(ends)
        self.bad_input = all(e.exitcode == EXIT_BAD_INPUT for e in self.causes)


def _message(failure: Any) -> str:
    """The line a failed rank left in its error file; "" if it left none (torch then makes one
    up, "Signal 9 received by PID ...", which says less than our own line)."""
    if not os.path.isfile(failure.error_file):
        return ""
    m = failure.message
    if isinstance(m, dict):  # torch's error-file format: {"message": ..., "extraInfo": ...}
        m = m.get("message", "")
    return str(m)


def _agent_class(launch: Launch, outcome: _Outcome):
    """torch's LocalElasticAgent, reporting each failed attempt as it happens (before the
    restart), in cause-first order."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class ReportingAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            ended_first = self._ended_ranks(worker_group)
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED:
                # Nothing had ended at our look (the poll raced us): all ended by themselves.
                ends = [RankEnd(r, f.exitcode, _message(f), not ended_first or r in ended_first)
                        for r, f in sorted(result.failures.items())]
                self._report(ends)
            return result

        def _ended_ranks(self, worker_group) -> set[int]:
            """Global ranks whose process has ended, before the agent's poll stops the rest
            (Popen.poll keeps the exit status for the agent)."""
            handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
            done = {lr for lr, h in handlers.items() if h.proc.poll() is not None}
            return {w.global_rank for w in worker_group.workers if w.local_rank in done}

        def _report(self, ends: list[RankEnd]) -> None:
            outcome.record(ends)
            if outcome.bad_input:  # the ranks said what is wrong; a restart would not help
                self._remaining_restarts = 0
                return
            next_step = ""
            if self._remaining_restarts > 0:  # the agent restarts right after this
                attempt = launch.max_restarts - self._remaining_restarts + 1
                point = launch.resume_point() if launch.resume_point else None
                next_step = (f"restarting ({attempt} of {launch.max_restarts}) from "
                             f"{point or 'the start'}")
            for line in failure_report(ends, next_step):
                say(line)

    return ReportingAgent


def torchrun(launch: Launch) -> int:
    """Run `launch.module` on every rank through torch's elastic agent; the exit status:
    0 done, 2 bad input (the ranks said what), 128 + N stopped by signal N, 1 anything else."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher_api
    from torch.distributed.run import get_args_parser, run

    # Each rank gets its share of the cores (torchrun would otherwise set 1 thread and warn).
    threads = max(1, len(os.sched_getaffinity(0)) // launch.nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # The elastic agent logs each failure with its own tables; ours are one line per rank.
    os.environ.setdefault("LOGLEVEL", "CRITICAL")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    outcome = _Outcome()
    # torch.distributed.run builds its agent by this module-level name; ours reports failures
    # as they happen. Put back afterwards: this process may launch again (tests do).
    standard = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _agent_class(launch, outcome)
    try:
        run(get_args_parser().parse_args(_torchrun_argv(launch)))
    except ChildFailedError as e:
        if not outcome.reported:  # torch built its own agent after all: report at the end
            ends = [RankEnd(r, f.exitcode, _message(f)) for r, f in sorted(e.failures.items())]
            outcome.record(ends)
            if not outcome.bad_input:
                for line in failure_report(ends):
                    say(line)
        if outcome.bad_input:
            return EXIT_BAD_INPUT
        ranks = sorted(c.rank for c in outcome.causes)
        used = (f"; the {launch.max_restarts} restart(s) of --max-restarts are used up"
                if launch.max_restarts else "")
        say(f"meshloom: {launch.what} failed on rank {', '.join(map(str, ranks))}{used}")
        return 1
    except SignalException as e:  # e.g. preemption: the ranks got the signal too
        say(f"meshloom: stopped by signal {e.sigval.name}"
            + (f"; {launch.on_signal}" if launch.on_signal else ""))
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 - e.g. a rendezvous that never completes
        say(f"meshloom: launch failed: {type(e).__name__}: {e}")
        return 1
    finally:
        launcher_api.LocalElasticAgent = standard
    return 0


def exit_rank(code: int) -> None:
    """End a rank process whose work is done and whose files are closed, skipping interpreter
    teardown: that tears down c10d and Gloo objects (stores, groups still referenced by meshes)
    in no particular order, and has aborted two finished ranks in CI with "terminate called
    without an active exception"."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def rank_entry() -> None:
    """What every rank's `__main__` does first: a crash (SIGSEGV, SIGABRT, ...) prints every
    thread's Python stack to the rank's stderr, so its cause is in the launcher's report."""
    import faulthandler

    faulthandler.enable()


# ---------------------------------------------------------------- forked ranks (tests, benchmarks)


class RankError(RuntimeError):
    """A forked rank raised (its traceback is in the message) or died."""


class CallerStdio:
    """Stands for the caller's stdout and stderr as they are now (pytest's capture files, say):
    pickled for a fork-server or spawned rank, it arrives as duplicates of the caller's fds."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (_Stdio, (reduction.DupFd(1), reduction.DupFd(2)))


class _Stdio:
    def __init__(self, out: Any, err: Any) -> None:
        self.fds = (out.detach(), err.detach())

    def use(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), self.fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)


class Lifeline:
    """A pipe whose write end only the launching process holds. A fork-server (or spawned) child
    given `end()` dies as soon as the launcher ends, however it ends, SIGKILL included. Such a
    child is the fork server's, not the launcher's, so PR_SET_PDEATHSIG cannot do this, and the
    fork server itself lives as long as any child it forked."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()  # both close-on-exec: no other program inherits them

    def end(self) -> Any:
        """For a child's arguments: arrives there as a _LifelineEnd holding a duplicate of the
        read end (only while the child is being started)."""
        return _LifelineHandOver(self._read)

    def started(self) -> None:
        """Every child has its duplicate: the launcher's read end is no longer needed."""
        if self._read >= 0:
            os.close(self._read)
            self._read = -1

    def close(self) -> None:
        """The children are done: any still running now die."""
        self.started()
        if self._write >= 0:
            os.close(self._write)
            self._write = -1


class _LifelineHandOver:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (_LifelineEnd, (reduction.DupFd(self.fd),))


class _LifelineEnd:
    def __init__(self, fd: Any) -> None:
        self.fd = fd.detach()

    def hold(self) -> None:
        """Die (SIGKILL) when the launcher's end closes: a thread waits for end-of-file."""
        import threading

        def watch() -> None:
            while os.read(self.fd, 1):
                pass
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="meshloom-lifeline", daemon=True).start()


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, kwargs: dict,
            results: Any, threads: int, env: dict[str, str], stdio: Any,
            lifeline: Any) -> None:
    import torch
    import torch.distributed as dist

    # The caller's output files and environment as they are now (a fork server's are those it
    # started with; a forked rank has them already).
    if isinstance(stdio, _Stdio):
        stdio.use()
    if isinstance(lifeline, _LifelineEnd):
        lifeline.hold()
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    try:
        torch.set_num_threads(threads)
        out = fn(*args, **kwargs)
        # Plain pickle: multiprocessing's own pickler would share tensors through file
        # descriptors that vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


# What a fork server imports once, so that each rank forked from it starts in milliseconds.
# torch._dynamo is what the first torch.optim optimizer imports (0.5 s here), inductor what
# the first compiled block imports (0.7 s; importing it starts no thread or process, so the
# fork stays safe); the parameter server's processes come from the same server.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
                      "meshloom.train", "meshloom.ps.server", "meshloom.ps.trainer"]


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              start_method: str = "forkserver", **kwargs: Any) -> list[Any]:
    """fn(*args, **kwargs) on `world_size` ranks (RANK, WORLD_SIZE, MASTER_* set, the cores
    shared out, the caller's environment); their return values in rank order. A rank's exception
    is raised here as RankError with its traceback; a rank that dies is RankError at once; a run
    that does not finish within `timeout` seconds is TimeoutError. On any failure every rank is
    killed.

    The ranks are forked from a fork server that imported torch once and has run nothing else
    (the default): as cheap as forking the caller once the server is up (about 0.1 s for two
    ranks), and nothing of the caller's state comes along. Forking the caller itself
    (start_method="fork") copies whatever it has run: forked from a pytest process that had run
    hundreds of tests, ranks whose replicas run matmuls in threads (single-process DP) crashed
    with SIGSEGV (in two of seven fresh-clone CI runs). `fn` and the arguments are pickled, so
    `fn` must be a module-level function (of an importable module or of a script's
    `__main__`)."""
    import multiprocessing as mp

    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    results = ctx.Queue()
    port = free_port()
    threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    # Forked ranks are the caller's own children and inherit everything, the lifeline's write
    # end included; the others get the caller's stdio and a lifeline passed explicitly.
    forked = start_method == "fork"
    lifeline = Lifeline()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, fn, args, kwargs, results, threads,
                               dict(os.environ), None if forked else CallerStdio(),
                               None if forked else lifeline.end()))
             for r in range(world_size)]
    # Garbage left by earlier in-process work (process groups, stores, tensors of a previous
    # run) is collected here, not by the garbage collector of a freshly forked child, where
    # freeing such objects has crashed or hung.
    gc.collect()
    for p in procs:
        p.start()
    lifeline.started()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None) and r not in out]
                if dead:
                    raise RankError(f"rank {dead[0]} died with exit code "
                                    f"{procs[dead[0]].exitcode}") from None
                continue
            if status == "error":
                raise RankError(f"rank {rank} raised:\n{value}")
            out[rank] = pickle.loads(value)
    except BaseException:
        for p in procs:  # a failed or hung run: no rank is waited for
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        lifeline.close()
    return [out[r] for r in range(world_size)]
