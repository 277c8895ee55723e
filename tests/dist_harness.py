"""Run a function on N real Gloo ranks, forked from the test process.

Forking from a process that has already imported torch makes a group form in a fraction of a
second (a fresh interpreter per rank spends seconds importing torch). Each rank's return value
comes back to the test; a rank's exception is re-raised in the test with its traceback; a run
that does not finish within `timeout` seconds is killed, so no test can hang CI.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

# Imported here, in the parent, so that forked ranks start with torch already loaded.
import torch
import torch.distributed as dist


class RankError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, kwargs: dict,
            results: mp.Queue, threads: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    try:
        torch.set_num_threads(threads)
        out = fn(*args, **kwargs)
        # Plain pickle: multiprocessing's own pickler would share tensors through file
        # descriptors that vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              **kwargs: Any) -> list[Any]:
    """fn(*args, **kwargs) on every rank; returns the results in rank order."""
    ctx = mp.get_context("fork")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, fn, args, kwargs, results, threads))
             for r in range(world_size)]
    # Garbage left by earlier in-process work (process groups, stores, tensors of a previous
    # test) is collected here, not by the garbage collector of a freshly forked child, where
    # freeing such objects has crashed or hung.
    gc.collect()
    for p in procs:
        p.start()
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
    return [out[r] for r in range(world_size)]
