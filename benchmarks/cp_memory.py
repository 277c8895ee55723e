"""Peak memory and step time per rank of meshloom's context parallel at cp = 1, 2, 4, in one run.

Every cp degree trains the same model (same seed) on the same batches of whole sequences (the same
total tokens per step: `--batch` sequences of `--seq` tokens), each degree in its own launch of cp
ranks, one after the other:
- cp=1: one rank, `parallelize(..., ParallelConfig(dp_shard=1))`, the whole sequence;
- cp=N: N ranks, `ParallelConfig(cp=N, dp_shard=1)`; each rank takes its zigzag slice of every
  sequence (`par.context.local`) and attends over the ring; gradients are averaged over cp.
A step (slicing, forward, loss, backward, gradient sync, AdamW step, after_step, zero_grad) is timed
from a barrier; its time is the slowest rank's. One extra, untimed step after the warm-up measures
memory on every rank: the model state at the step's start (parameters, gradients, AdamW state)
plus the highest rise of allocated bytes during the step (zero_vs_fsdp2.PeakRise: torch.profiler's
allocator events on CPU). The first step's loss (mean over all tokens) must agree at every cp.

    python benchmarks/cp_memory.py --seq 4096 --steps 5
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshloom.comm import CommCounter
from meshloom.config import ParallelConfig, TrainConfig
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.llama import build_model, config_from_preset
from meshloom.optim import build_optimizer
from meshloom.parallel import Parallelized, parallelize

# benchmarks/ is a folder of scripts, not a package: make its shared modules importable however
# this file was loaded (as a script, or by path from a test).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    batch,
    check_common,
    cpu_unless_gpus,
    init_rank,
    launch,
    parser,
    provenance,
    summary,
    threads_per_rank,
    write_result,
)
from zero_vs_fsdp2 import PeakRise  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cp_memory.json"
TCFG = TrainConfig(lr=1e-3)
# The same tokens, split differently: the losses differ only by the summation order.
LOSS_RTOL = 1e-5
MEMORY_NOTE = (
    "per rank, max over ranks, one untimed step after the warm-up: state = unique storages of "
    "parameters, gradients and AdamW state at the step's start; peak = state + the highest rise "
    "of allocated bytes during the step (CPU: torch.profiler's allocator events, which err high "
    "when memory allocated before the step is freed inside it; CUDA: max_memory_allocated). "
    "Weights, gradients and optimizer state are replicated over cp: only the activations "
    "(the rise) can shrink, ideally as 1/cp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, steps=5, warmup=1, out=DEFAULT_OUT)
    p.set_defaults(preset="tiny", batch=1, seq=4096)
    p.add_argument("--cps", default="1,2,4", help="comma-separated cp degrees, run in order")
    args = p.parse_args(argv)
    check_common(p, args)
    try:
        args.cps = [int(c) for c in args.cps.split(",") if c]
    except ValueError:
        p.error("--cps: comma-separated integers")
    if not args.cps or len(set(args.cps)) != len(args.cps) or min(args.cps) < 1:
        p.error("--cps: give distinct degrees >= 1")
    for cp in args.cps:
        if args.seq % (2 * cp):
            p.error(f"--seq must be divisible by 2 x cp (zigzag halves): {args.seq} by {2 * cp}")
    return args


# ----------------------------------------------------------------------------- one rank


def state_bytes(par: Parallelized, optimizer: torch.optim.Optimizer) -> int:
    """Unique storages of the parameters, their gradients and the optimizer state."""
    params = list(par.model.parameters())
    tensors = [*params, *(p.grad for p in params if p.grad is not None),
               *(t for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t))]
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def train_step(par: Parallelized, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> torch.Tensor:
    """One step; the local mean loss (over this rank's tokens), detached."""
    if par.context is not None:
        x, y, pos = par.context.local(x, y)
    else:
        pos = None
    loss = par.loss(par.model(x, pos), y)
    loss.backward()
    par.grads.finish()
    optimizer.step()
    par.grads.after_step()
    par.grads.zero_grad()
    return loss.detach()


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> dict:
    device = init_rank(args, rank, world)
    cuda = device.type == "cuda"
    mesh = Mesh(ParallelDims(cp=world), rank, device.type, CommCounter())
    cfg = config_from_preset(args.preset, max_seq_len=args.seq)
    model = build_model(cfg, args.seed, device)
    pcfg = ParallelConfig(cp=world, dp_shard=1) if world > 1 else ParallelConfig(dp_shard=1)
    par = parallelize(model, mesh, pcfg)
    optimizer = build_optimizer(*par.grads.optim_param_groups(), TCFG)

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Seeded as _launch.batch's rank 0 on every rank: all cp ranks see the same sequences,
        # and every cp degree the same ones.
        return batch(args, cfg.vocab_size, 0, step, device)

    def mean_loss(local: torch.Tensor) -> float:
        # Every rank holds as many tokens of each sequence: the mean of the local means.
        t = local.double().clone()
        dist.all_reduce(t)
        return t.item() / world

    losses, times = [], []
    step = 0
    for _ in range(args.warmup):
        losses.append(mean_loss(train_step(par, optimizer, *data(step))))
        step += 1
    gc.collect()
    dist.barrier()
    start = state_bytes(par, optimizer)
    x, y = data(step)
    with PeakRise(device) as peak:
        losses.append(mean_loss(train_step(par, optimizer, x, y)))
    step += 1
    for _ in range(args.steps):
        x, y = data(step)
        gc.collect()  # no step pays for another's garbage
        dist.barrier()
        t0 = time.perf_counter()
        loss = train_step(par, optimizer, x, y)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(mean_loss(loss))
        step += 1
    return {"times": times, "losses": losses, "state": start, "rise": peak.rise,
            "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_rank": args.batch * args.seq // world}


def _gathered(args: argparse.Namespace, rank: int, world: int) -> dict:
    """rank_main's result on every rank, gathered to rank 0 (launch returns rank 0's)."""
    mine = _rank_main(args, rank, world)
    out: list = [None] * world
    dist.all_gather_object(out, mine)
    return {"ranks": out}


# ----------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> dict:
    """Run every cp degree, print a table, write the JSON to --out and return the same dict."""
    args = parse_args(argv)
    cpu_unless_gpus(args, max(args.cps))
    runs = {}
    for cp in args.cps:
        a = copy.copy(args)
        a.nproc = cp
        ranks = launch(_gathered, a)["ranks"]
        times = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
        runs[cp] = {
            "ranks": cp, "threads_per_rank": threads_per_rank(cp),
            "tokens_per_rank": ranks[0]["tokens_per_rank"],
            **summary(times),
            "peak_bytes": max(r["state"] + r["rise"] for r in ranks),
            "peak_bytes_by_rank": [r["state"] + r["rise"] for r in ranks],
            "state_bytes": max(r["state"] for r in ranks),
            "rise_bytes": max(r["rise"] for r in ranks),
            "first_loss": ranks[0]["losses"][0],
            "losses": ranks[0]["losses"],
            "params": ranks[0]["params"],
        }
    base = runs[args.cps[0]]
    for r in runs.values():
        r["peak_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        r["rise_ratio"] = r["rise_bytes"] / base["rise_bytes"]
        r["time_ratio"] = r["median_s"] / base["median_s"]
    ref = base["first_loss"]
    rel = {cp: abs(r["first_loss"] - ref) / abs(ref) for cp, r in runs.items()}
    result = {
        "config": {"cps": args.cps, "preset": args.preset, "batch": args.batch, "seq": args.seq,
                   "tokens_per_step": args.batch * args.seq, "steps": args.steps,
                   "warmup": args.warmup, "device": args.device,
                   "backend": "nccl" if args.device == "cuda" else "gloo",
                   "params": base["params"], **provenance()},
        "runs": {str(cp): r for cp, r in runs.items()},
        "reference_cp": args.cps[0],
        "memory_note": MEMORY_NOTE,
        "time_note": "median over the timed steps of the slowest rank's step time; ranks share "
                     "the machine's cores (threads_per_rank), so on a machine with fewer cores "
                     "than ranks the step time also measures oversubscription",
        "check": {"first_loss": {str(cp): r["first_loss"] for cp, r in runs.items()},
                  "max_rel_diff": max(rel.values()), "rtol": LOSS_RTOL,
                  "ok": max(rel.values()) <= LOSS_RTOL},
    }
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    c, mib = r["config"], 2**20
    print(f"{c['preset']} ({c['params'] / 1e6:.3f}M params), {c['batch']}x{c['seq']} tokens per "
          f"step, {c['backend']} on {c['device']}, {c['steps']} timed steps after "
          f"{c['warmup']} warm-up + 1 memory step")
    print(f"{'cp':>4}{'thr':>5}{'tok/rank':>10}{'median':>10}{'p10':>9}{'p90':>9}{'t/cp1':>8}"
          f"{'peak':>9}{'state':>8}{'rise':>9}{'peak/1':>8}{'rise/1':>8}   (ms; MiB)")
    for cp, v in r["runs"].items():
        print(f"{cp:>4}{v['threads_per_rank']:>5}{v['tokens_per_rank']:>10}"
              f"{v['median_s'] * 1e3:10.1f}{v['p10_s'] * 1e3:9.1f}{v['p90_s'] * 1e3:9.1f}"
              f"{v['time_ratio']:8.3f}{v['peak_bytes'] / mib:9.1f}{v['state_bytes'] / mib:8.2f}"
              f"{v['rise_bytes'] / mib:9.1f}{v['peak_ratio']:8.3f}{v['rise_ratio']:8.3f}")
    ch = r["check"]
    losses = ", ".join(f"cp{cp} {x:.6f}" for cp, x in ch["first_loss"].items())
    print(f"first-step loss agrees: {ch['ok']} ({losses}; max rel diff "
          f"{ch['max_rel_diff']:.2g})")


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["check"]["ok"] else 1)
