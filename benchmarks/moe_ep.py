"""The expert-parallel MoE layer against the same experts computed locally (ep 1), in one run.

One launch of `--nproc` ranks holds two copies of one `meshloom.models.moe.MoE` layer built
from the same weights (`--experts` SwiGLU experts of width `--hidden`, top `--top-k`, dropless):
- ep1: every rank keeps every expert (`LocalDispatch`) and computes its own tokens' assignments;
- epN: `apply_expert_parallel` over a mesh of `ParallelDims.resolve(nproc, ep=nproc)`: each rank
  keeps E/N experts, sends every assignment to the rank holding its expert and gets the outputs
  back (all-to-all dispatch and combine, `comm.all_to_all_rows`).
Each rank routes its own `--tokens` tokens (random hidden states seeded by rank and step; one
sequence, so routing groups are whole). A step is the layer's forward and backward (a fixed
random output gradient), no gradient sync and no optimizer: the two variants differ only in
where the experts run. Variants take turns step by step in an order that rotates every round;
a step is timed from a barrier and its time is the slowest rank's.

Checks, in an untimed step before the timed ones: both variants give the same outputs and input
gradients on every rank, the router's gradient, and epN's expert gradients equal ep1's summed
over the ranks (the same math, summed in another order: within RTOL relative). Over the timed
steps: the token bytes CommCounter recorded under op "all_to_all" on axis "ep" against the
formula 4 x A x dim x 4 bytes per step over the group (dispatch and combine, forward and
backward; A = ranks x tokens x top_k assignments, dropless), every step, equal or not.

    python benchmarks/moe_ep.py --nproc 2 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.moe import MoE, MoESettings
from meshloom.parallel.expert import AXIS, apply_expert_parallel

# benchmarks/ is a folder of scripts, not a package: make its shared modules importable however
# this file was loaded (as a script, or by path from a test).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    check_common,
    comm_since,
    cpu_unless_gpus,
    init_rank,
    launch,
    paired,
    parser,
    provenance,
    round_order,
    summary,
    threads_per_rank,
    write_result,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "moe_ep.json"
# The same products, summed in another order (expert gradients: over ranks, then rows).
RTOL = 1e-5
FP32 = 4
INT64 = 8
INIT_STD = 0.02
TIME_NOTE = (
    "median over the timed steps of the slowest rank's forward + backward of the one layer "
    "(timed from a barrier); no gradient sync, no optimizer step. In training ep1 would also "
    "all-reduce every expert's gradient over the data-parallel ranks, while epN at ep = ranks "
    "has no expert gradient to sync (edp = 1): not timed here. Ranks share the machine's cores "
    "(threads_per_rank), and on CPU the all-to-all runs over loopback Gloo")
BYTES_NOTE = (
    "bytes CommCounter recorded per timed step, summed over the ep group; all_to_all counts "
    "the rows each rank sends, its own included (comm.all_to_all), so dispatch and combine "
    "each move A rows of dim fp32 forward and again backward: 4 x A x dim x 4. "
    "all_to_all_splits: the per-expert counts exchanged before each forward dispatch, "
    "ranks x experts int64 (bookkeeping, counted apart)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--nproc", type=int, default=2, help="ranks = the ep degree of epN")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    p.add_argument("--tokens", type=int, default=2048, help="tokens each rank routes per step")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=None, help="each expert's width (2 x dim)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    check_common(p, args)
    args.hidden = args.hidden or 2 * args.dim
    if min(args.tokens, args.dim, args.hidden, args.experts) < 1:
        p.error("--tokens, --dim, --hidden and --experts must be >= 1")
    if args.experts % args.nproc:
        p.error(f"--experts={args.experts} must divide over --nproc={args.nproc} ranks")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k={args.top_k} must be between 1 and --experts={args.experts}")
    return args


# ----------------------------------------------------------------------------- one rank


def build_moe(args: argparse.Namespace, device: torch.device) -> MoE:
    """The layer, the same weights on every rank (seeded by --seed alone)."""
    moe = MoE(args.dim, MoESettings(n_experts=args.experts, top_k=args.top_k,
                                    hidden=args.hidden))
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * INIT_STD)
    return moe.to(device)


def data(args: argparse.Namespace, rank: int, step: int,
         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [1, tokens, dim], output gradient) of one rank and step."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(2, 1, args.tokens, args.dim, generator=g)
    return x[0].to(device), x[1].to(device)


def forward_backward(moe: MoE, x: torch.Tensor, grad: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step timed: the layer's output and input gradient (detached)."""
    x = x.detach().requires_grad_()
    out = moe(x)
    out.backward(grad)
    return out.detach(), x.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _max_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(values, t.tolist(), strict=True))


def check(args: argparse.Namespace, local: MoE, ep: MoE, mesh: Mesh, rank: int,
          device: torch.device) -> dict:
    """One untimed step of both from the same input: what differs, max over ranks."""
    x, grad = data(args, rank, -1, device)
    out1, gx1 = forward_backward(local, x, grad)
    outn, gxn = forward_backward(ep, x, grad)
    lo, n = mesh.coord(AXIS) * ep.experts.n_local, ep.experts.n_local
    diffs = {"output": _rel(outn, out1), "input_grad": _rel(gxn, gx1),
             "router_grad": _rel(ep.router.weight.grad, local.router.weight.grad)}
    for name in ("w1", "w3", "w2"):
        # ep1's expert gradient holds this rank's tokens only; epN's, every rank's.
        whole = getattr(local.experts, name).grad.clone()
        dist.all_reduce(whole)
        diffs[f"expert_grad_{name}"] = _rel(getattr(ep.experts, name).grad, whole[lo:lo + n])
    # Assignments per expert over every rank's tokens: what decides each epN rank's work.
    load = local.reset_stats().load.clone().to(device)
    dist.all_reduce(load)
    ep.reset_stats()
    for m in (local, ep):
        m.zero_grad(set_to_none=True)
    diffs = _max_over_ranks(diffs, device)
    return {"max_rel_diff": diffs, "rtol": RTOL, "ok": max(diffs.values()) <= RTOL,
            "expert_load": load.tolist()}


def expert_bytes(moe: MoE) -> int:
    return sum(p.numel() * p.element_size() for p in moe.experts.parameters())


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> dict | None:
    device = init_rank(args, rank, world)
    cuda = device.type == "cuda"
    mesh = Mesh(ParallelDims.resolve(world, ep=world), rank, device.type, CommCounter())
    local = build_moe(args, device)
    ep = copy.deepcopy(local)
    apply_expert_parallel(ep, mesh)
    variants = {"ep1": local, "epN": ep}
    checked = check(args, local, ep, mesh, rank, device)

    times: dict[str, list[float]] = {name: [] for name in variants}
    comm: dict[str, list[Counter]] = {name: [] for name in variants}
    for step in range(args.warmup + args.steps):
        x, grad = data(args, rank, step, device)
        for name in round_order(list(variants), step):
            moe = variants[name]
            gc.collect()  # no step pays for another's garbage
            before = mesh.counter.snapshot()
            dist.barrier()
            t0 = time.perf_counter()
            forward_backward(moe, x, grad)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            moe.zero_grad(set_to_none=True)
            moe.reset_stats()
            if step >= args.warmup:
                times[name].append(dt)
                comm[name].append(comm_since(mesh.counter, before))

    # Outside the timed region: a step lasts as long as its slowest rank; bytes add up.
    names, ops = list(variants), ("all_to_all", "all_to_all_splits")
    t = torch.tensor([times[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mine = torch.tensor([[[c[op] for c in comm[n]] for op in ops] for n in names],
                        dtype=torch.int64, device=device)
    ranks = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(ranks, mine)
    per_rank = torch.stack(ranks).cpu()  # [rank, variant, op, step]
    params = [expert_bytes(m) for m in variants.values()]
    every = [None] * world
    dist.all_gather_object(every, params)
    if rank != 0:
        return None
    return {
        "times": {n: t[i].tolist() for i, n in enumerate(names)},
        "bytes": {n: {op: {"group_per_step": per_rank[:, i, j].sum(0).tolist(),
                           "by_rank_per_step": per_rank[:, i, j].tolist()}
                      for j, op in enumerate(ops)} for i, n in enumerate(names)},
        "expert_param_bytes": {n: [p[i] for p in every] for i, n in enumerate(names)},
        "router_param_bytes": local.router.weight.numel() * FP32,
        "check": checked,
    }


# ----------------------------------------------------------------------------- report


def formula(args: argparse.Namespace) -> dict:
    """Bytes per step over the ep group, dropless: every assignment crosses once each way."""
    assignments = args.nproc * args.tokens * args.top_k
    return {"assignments": assignments,
            "all_to_all": 4 * assignments * args.dim * FP32,
            "all_to_all_splits": args.nproc * args.experts * INT64}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON to --out and return the same dict."""
    args = parse_args(argv)
    cpu_unless_gpus(args, args.nproc)
    raw = launch(_rank_main, args)
    expected = formula(args)
    variants = {n: {**summary(ts)} for n, ts in raw["times"].items()}
    for n, v in variants.items():
        v["ratio_to_ep1"] = v["median_s"] / variants["ep1"]["median_s"]
        v["paired_ratio_to_ep1"] = paired(v["times_s"], variants["ep1"]["times_s"])
        v["expert_param_bytes_per_rank"] = raw["expert_param_bytes"][n]
    comm = {}
    for op in ("all_to_all", "all_to_all_splits"):
        measured = raw["bytes"]["epN"][op]
        steps = measured["group_per_step"]
        comm[op] = {"formula_per_step": expected[op], "measured_per_step": steps[0],
                    "equal": all(s == expected[op] for s in steps),
                    "group_per_step": steps, "by_rank_per_step": measured["by_rank_per_step"],
                    "ep1_per_step": raw["bytes"]["ep1"][op]["group_per_step"][0]}
    ep1_bytes = raw["expert_param_bytes"]["ep1"][0]
    result = {
        "config": {"nproc": args.nproc, "ep": args.nproc, "tokens_per_rank": args.tokens,
                   "dim": args.dim, "experts": args.experts, "hidden": args.hidden,
                   "top_k": args.top_k, "capacity": "dropless", "steps": args.steps,
                   "warmup": args.warmup, "device": args.device,
                   "backend": "nccl" if args.device == "cuda" else "gloo",
                   "threads_per_rank": threads_per_rank(args.nproc), **provenance()},
        "variants": variants,
        "time_note": TIME_NOTE,
        "comm": {"assignments_per_step": expected["assignments"], **comm},
        "comm_note": BYTES_NOTE,
        "expert_param_bytes": {"ep1_per_rank": ep1_bytes,
                               "epN_per_rank": max(raw["expert_param_bytes"]["epN"]),
                               "epN_over_ep1": max(raw["expert_param_bytes"]["epN"]) / ep1_bytes,
                               "router_per_rank": raw["router_param_bytes"]},
        "check": raw["check"],
        "check_note": "one untimed step before the timed ones, from the same input on both: "
                      "outputs, input and router gradients per rank, and epN's expert "
                      "gradients against ep1's summed over the ranks (its slice); max|diff| / "
                      "max|ep1|, worst rank. expert_load: assignments per expert over every "
                      "rank's tokens in that step",
    }
    result["ok"] = result["check"]["ok"] and all(c["equal"] for c in comm.values())
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    c, mib = r["config"], 2**20
    print(f"MoE layer: dim {c['dim']}, {c['experts']} experts of width {c['hidden']}, top "
          f"{c['top_k']}, {c['tokens_per_rank']} tokens/rank; {c['nproc']} ranks x "
          f"{c['threads_per_rank']} thread(s), {c['backend']} on {c['device']}; "
          f"{c['steps']} timed steps each after {c['warmup']} warm-up")
    print(f"{'':6}{'median':>9}{'p10':>9}{'p90':>9}{'/ep1':>8}{'paired':>8}{'experts':>10}"
          "   (ms; expert MiB/rank)")
    for name, v in r["variants"].items():
        label = name if name == "ep1" else f"ep{c['ep']}"
        print(f"{label:6}{v['median_s'] * 1e3:9.1f}{v['p10_s'] * 1e3:9.1f}"
              f"{v['p90_s'] * 1e3:9.1f}{v['ratio_to_ep1']:8.3f}{v['paired_ratio_to_ep1']:8.3f}"
              f"{max(v['expert_param_bytes_per_rank']) / mib:10.2f}")
    for op in ("all_to_all", "all_to_all_splits"):
        x = r["comm"][op]
        print(f"{op} bytes/step over the group: measured {x['measured_per_step']}, formula "
              f"{x['formula_per_step']}: {'equal' if x['equal'] else 'NOT EQUAL'}")
    ch = r["check"]
    diffs = ", ".join(f"{k} {d:.2g}" for k, d in ch["max_rel_diff"].items())
    print(f"ep{c['ep']} agrees with ep1 within {ch['rtol']:g}: {ch['ok']} ({diffs})")


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["ok"] else 1)
