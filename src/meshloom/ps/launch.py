"""Start the servers and trainers of a parameter-server run, watch them, and report.

Processes are forked from a fork server that has imported torch and nothing else of the
launcher's state (launch.run_ranks' server): a process is ready in a fraction of a second (a fresh
interpreter spends seconds importing torch), and it carries none of what the launcher has run
(forked from a pytest process that had run hundreds of tests, a child once hung for good). RPC is
only initialised in each child, which TensorPipe is fine with. RPC ranks: servers
0..S-1 (ps0, ps1, ...), trainers S..S+T-1 (trainer0, ...); RPC and the trainers' Gloo group
rendezvous on two free loopback ports.

Failure: a process that fails prints one line naming itself (a trainer whose servers stop
answering names them) and exits 1; its full log is in RUN_DIR/logs/NAME.log. Once anything has
failed, the launcher gives the other processes a few seconds to end by themselves and then kills
them, so a dead server never leaves a run hanging. Children also die with the launcher, however
it ends (launch.Lifeline), and RUN_DIR/processes.json lists their pids.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from meshloom.config import ConfigError
from meshloom.launch import EXIT_BAD_INPUT, FORKSERVER_PRELOAD, CallerStdio, Lifeline, ended
from meshloom.ps.config import PSConfig, dump_ps_toml, load_ps_config, validate_ps
from meshloom.ps.placement import Piece, dense_widths, draw, place, server_name, trainer_name

GRACE_S = 5.0  # after a failure, how long the other processes get to end by themselves


class LaunchError(RuntimeError):
    """The run failed; the message is one line naming the processes."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or "(no message)"
    return f"{type(e).__name__}: {text[:300]}"


def _process(role: str, index: int, cfg: PSConfig, pieces: list[Piece], ports: tuple[int, int],
             run_dir: Path, results: mp.Queue, collect: bool, threads: int,
             env: dict[str, str], stdio: Any, lifeline: Any) -> None:
    """The body of one server or trainer process."""
    lifeline.hold()
    # The launcher's output files and environment as they are now, not the fork server's.
    stdio.use()
    os.environ.clear()
    os.environ.update(env)
    name = server_name(index) if role == "server" else trainer_name(index)
    log_path = run_dir / "logs" / f"{name}.log"
    terminal = os.fdopen(os.dup(2), "w")  # our one-line messages go to the launcher's stderr
    # Everything else written to stderr (tracebacks, PyTorch's C++ and Python warnings) goes to
    # the log, so a failure shows as one clear line per process, not pages of agent chatter.
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 - open for the process's life
    os.dup2(log.fileno(), 2)
    sys.stderr = log  # also when the launcher's sys.stderr was not fd 2 (e.g. under pytest)
    import torch
    import torch.distributed.rpc as rpc

    from meshloom.ps import server, trainer

    torch.set_num_threads(threads)
    # DistributedOptimizer warns that our optimizer class is not TorchScript; that is intended.
    logging.getLogger("torch.distributed.optim.optimizer").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="You are using a Backend")
    rpc_port, group_port = ports
    # The launcher hosts both rendezvous stores (bound before any child starts, so no port race);
    # this PyTorch switch makes rank 0 a store client like every other rank instead of a host.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    S, T = cfg.ps.servers, cfg.ps.trainers
    rank = index if role == "server" else S + index
    where = "at startup"  # for the failure message
    try:
        if role == "server":
            server.setup(cfg, [p for p in pieces if p.server == index], record=collect)
        # TCP (libuv) only: the shared-memory transport's reactor thread polls, costing an idle
        # process much of a core, while on this path steps are no slower.
        options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}",
                                                  rpc_timeout=cfg.ps.rpc_timeout_s,
                                                  _transports=["uv"])
        rpc.init_rpc(name, rank=rank, world_size=S + T, rpc_backend_options=options)
        if role == "trainer":
            where = "in training setup"
            out = trainer.run_trainer(cfg, index, pieces, f"tcp://127.0.0.1:{group_port}",
                                      run_dir, collect)
            if index == 0:
                results.put(pickle.dumps(out))
        where = "at shutdown"
        # Graceful: waits for every process, so servers keep serving until the trainers are done.
        rpc.shutdown()
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line and exit 1
        traceback.print_exc()
        if isinstance(e, trainer.StepFailed) and e.__cause__ is not None:
            where, e = f"at step {e.step}", e.__cause__
        reason = _one_line(e)
        if role == "trainer" and where != "at startup":
            down = trainer.unreachable_servers(cfg)
            if down:
                reason = (f"parameter server {', '.join(down)} stopped answering (died, hung or "
                          f"unreachable); {reason}")
        print(f"meshloom: {name} failed {where}: {reason} (log: {log_path})", file=terminal,
              flush=True)
        log.flush()
        os._exit(1)  # no graceful RPC shutdown: it would wait for the process that is gone


def launch(cfg: PSConfig, run_dir: Path, *, collect: bool = False) -> dict[str, Any]:
    """Run servers and trainers to the end; trainer 0's result (see trainer.run_trainer).
    Raises LaunchError after every process has ended or been killed."""
    from torch.distributed import TCPStore

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    pieces = place(cfg)
    S, T = cfg.ps.servers, cfg.ps.trainers
    threads = cfg.run.threads or max(1, len(os.sched_getaffinity(0)) // (S + T))
    # Garbage of the launcher's (e.g. an earlier run's stores, kept by an exception's frames)
    # must be freed here: a child's garbage collector would run its destructors without the
    # threads they join, which never returns.
    gc.collect()
    # Two stores, one for RPC's rendezvous and one for the trainers' Gloo group, bound here on
    # ports the system picks (no race for a "free" port).
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    try:
        return _run(cfg, run_dir, pieces, (stores[0].port, stores[1].port), collect, threads)
    finally:
        del stores  # promptly, and never kept alive by a LaunchError's traceback


def _run(cfg: PSConfig, run_dir: Path, pieces: list[Piece], ports: tuple[int, int],
         collect: bool, threads: int) -> dict[str, Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    results = ctx.Queue()
    lifeline = Lifeline()
    roles = [("server", i) for i in range(cfg.ps.servers)]
    roles += [("trainer", i) for i in range(cfg.ps.trainers)]
    procs = {}
    for role, i in roles:
        name = server_name(i) if role == "server" else trainer_name(i)
        procs[name] = ctx.Process(target=_process, name=name, daemon=True,
                                  args=(role, i, cfg, pieces, ports, run_dir, results, collect,
                                        threads, dict(os.environ), CallerStdio(),
                                        lifeline.end()))
    for p in procs.values():
        p.start()
    lifeline.started()
    (run_dir / "processes.json").write_text(json.dumps({n: p.pid for n, p in procs.items()}))
    try:
        result, failures = _watch(procs, results)
    except BaseException:  # e.g. Ctrl-C: nothing outlives the launcher
        for p in procs.values():
            p.kill()
            p.join()
        raise
    finally:
        lifeline.close()
    if failures:
        raise LaunchError("; ".join(f"{n} {text}" for n, text in failures.items()))
    if result is None:
        raise LaunchError("trainer0 ended without a result")
    return result


def _watch(procs: dict[str, mp.Process], results: mp.Queue) -> tuple[dict | None, dict[str, str]]:
    """Wait for every process; after the first failure, kill whatever is left after GRACE_S."""
    result, failures, deadline = None, {}, None
    running = dict(procs)
    while running:
        try:  # reading as we go: a large result would otherwise block its sender's exit
            result = pickle.loads(results.get(timeout=0.1))
        except queue.Empty:
            pass
        for name, p in list(running.items()):
            if p.exitcode is not None:
                del running[name]
                if p.exitcode != 0:
                    failures[name] = ended(p.exitcode)
                    deadline = deadline or time.monotonic() + GRACE_S
        trainers_done = not any(n.startswith("trainer") for n in running)
        if failures and running and (trainers_done or time.monotonic() > deadline):
            # Servers with no trainer left, or anything still stuck after the grace period.
            for name, p in running.items():
                p.kill()
                p.join()
                failures[name] = "was stopped by the launcher"
            running.clear()
    if result is None and not failures:
        try:
            result = pickle.loads(results.get(timeout=5))
        except queue.Empty:
            pass
    return result, failures


# ---------------------------------------------------------------- `meshloom train CONFIG`


def _resolve_run_dir(cfg: PSConfig) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir)
    return Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_cli(args: argparse.Namespace) -> int:
    """`meshloom train` with a parameter-server config (one with a [ps] section)."""
    try:
        for flag, default in (("--nproc", 0), ("--resume", False), ("--nnodes", 1),
                              ("--rdzv-endpoint", ""), ("--max-restarts", 0)):
            if getattr(args, flag[2:].replace("-", "_"), default) != default:
                raise ConfigError(f"{flag}: not supported by parameter-server runs (processes "
                                  "come from ps.servers and ps.trainers, on this machine)")
        cfg = load_ps_config(args.config, args.overrides)
        validate_ps(cfg)
    except ConfigError as e:
        print(f"meshloom: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = _resolve_run_dir(cfg)
    cfg.run.dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_ps_toml(cfg))
    pieces = place(cfg)
    print(draw(cfg, pieces), flush=True)
    t0 = time.perf_counter()
    try:
        out = launch(cfg, run_dir)
    except LaunchError as e:
        print(f"meshloom: parameter-server run failed: {e} (logs in {run_dir / 'logs'})",
              file=sys.stderr)
        return 1
    summary = _summary(cfg, pieces, run_dir, out, time.perf_counter() - t0)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
          f"{summary['samples_per_s']:.0f} samples/s", flush=True)
    print(f"run directory: {run_dir}", flush=True)
    return 0


def _summary(cfg: PSConfig, pieces: list[Piece], run_dir: Path, out: dict[str, Any],
             wall: float) -> dict[str, Any]:
    widths = dense_widths(cfg)
    return {
        "run_dir": str(run_dir), "steps": cfg.train.steps, "mode": "parameter_server",
        "first_loss": out["losses"][0], "final_loss": out["losses"][-1],
        "samples_per_s": out["samples_per_s"], "train_time_s": out["train_time_s"],
        "wall_time_s": wall,
        "layout": {"servers": cfg.ps.servers, "trainers": cfg.ps.trainers,
                   "sharding": cfg.ps.sharding},
        "placement": [{"table": p.table, "server": server_name(p.server), "rows": [p.lo, p.hi]}
                      for p in pieces],
        "params": {"tables": cfg.model.tables * cfg.model.rows * cfg.model.dim,
                   "dense": sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))},
        "comm_bytes": out["comm_bytes"],
    }
