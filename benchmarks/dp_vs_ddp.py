"""meshloom's single-process DataParallel (parallel.mode=dp) vs meshloom's DDP, interleaved.

Same model (same seed), same global batch of `nproc x --batch` sequences, same AdamW:
- dp: one process (rank 0) runs `ReplicatedModule` with `nproc` replicas, one thread each, over
  `nproc` devices (GPUs, or the CPU `nproc` times), every core's torch threads to itself;
- ddp: `nproc` processes, one replica each (`parallel/ddp.py`), `cores // nproc` threads each;
- single: one process (rank 0), the plain model on the whole batch, every core: the floor that
  says whether dp's threads gain anything at all over not splitting the batch.
Variants take turns step by step in an order that rotates every round; while rank 0 runs dp or
single, the other ranks wait in a barrier. A step (forward, loss, backward, gradient sync, AdamW
step, zero_grad) is timed from a barrier; ddp's time is the slowest rank's. The phases (forward
+ loss, backward + sync, optimizer) are timed too. The first (untimed) step compares every
variant's gradients, after the sync and before the optimizer, with ddp's: they must agree to
rounding, or the script fails, since it would be timing different computations. The final
parameters are compared too, but only reported: AdamW turns rounding differences of gradient
entries near zero into O(lr) updates, which grow over the steps.

    python benchmarks/dp_vs_ddp.py --nproc 2 --preset demo --steps 20
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.llama import build_model, config_from_preset
from meshloom.parallel.ddp import DataParallel
from meshloom.parallel.single_process_dp import AXIS, ReplicatedModule

# benchmarks/ is a folder of scripts, not a package: make its shared module importable however
# this file was loaded (as a script, or by path from a test).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    batch,
    comm_since,
    cpu_unless_gpus,
    init_rank,
    launch,
    loss_of,
    paired,
    parse_with_variants,
    parser,
    provenance,
    round_order,
    summary,
    threads_per_rank,
    write_result,
)

VARIANTS = ("dp", "ddp", "single")
PHASES = ("forward", "backward", "optimizer")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "dp_vs_ddp.json"
GRAD_RTOL = 1e-5  # first-step gradients: largest difference / largest reference entry
RTOL, ATOL = 1e-4, 1e-5  # final parameters: reported only
FAIRNESS = ("the same model, seed, global batch and AdamW(lr=1e-3, foreach) for all; each "
            "process gets the machine's cores as torch threads shared out among its processes "
            "(dp and single: all of them; ddp: cores // nproc each); the ranks that dp and "
            "single leave idle wait in a barrier")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, steps=20, warmup=3, out=DEFAULT_OUT)
    return parse_with_variants(p, argv, VARIANTS)


def _sync(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)  # kernels are async: a phase ends when they have run


class _Variant:
    """One model copy, its step and its timings."""

    def __init__(self, model: nn.Module, step_model: nn.Module, devices: list[torch.device],
                 finish=lambda: None, zero_grad=None):
        self.model, self.step_model, self.devices = model, step_model, devices
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        self.finish = finish
        self.zero_grad = zero_grad or (lambda: model.zero_grad(set_to_none=False))
        self.times: list[float] = []
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.loss = float("nan")
        self.first_grads: list[torch.Tensor] | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        marks = [time.perf_counter()]
        loss = loss_of(self.step_model, x, y)
        _sync(self.devices)
        marks.append(time.perf_counter())
        loss.backward()
        self.finish()
        _sync(self.devices)
        marks.append(time.perf_counter())
        if self.first_grads is None:  # the untimed first step: kept for the check
            self.first_grads = [p.grad.detach().clone() for p in self.model.parameters()]
        self.opt.step()
        self.zero_grad()
        _sync(self.devices)
        marks.append(time.perf_counter())
        self.loss = loss.item()
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> dict | None:
    device = init_rank(args, rank, world)
    cuda = device.type == "cuda"
    mesh = Mesh(ParallelDims(dp_replicate=world), rank, device.type, CommCounter())
    cfg = config_from_preset(args.preset, max_seq_len=max(args.seq, 16))
    cores = len(os.sched_getaffinity(0))
    threads = {"dp": cores, "single": cores, "ddp": threads_per_rank(world)}

    variants: dict[str, _Variant] = {}
    if "ddp" in args.variants:
        model = build_model(cfg, args.seed, device)
        ddp = DataParallel(model, mesh, axis="dp", bucket_mb=args.bucket_mb)
        variants["ddp"] = _Variant(model, model, [device], ddp.finish, ddp.zero_grad)
    dp_counter = CommCounter()
    replicas = [torch.device("cuda", i) for i in range(world)] if cuda \
        else [torch.device("cpu")] * world
    if rank == 0 and "dp" in args.variants:
        model = build_model(cfg, args.seed, replicas[0])
        rep = ReplicatedModule(model, replicas, dp_counter)
        variants["dp"] = _Variant(model, rep, replicas, rep.release)
    if rank == 0 and "single" in args.variants:
        model = build_model(cfg, args.seed, replicas[0])
        variants["single"] = _Variant(model, model, replicas[:1])

    comm_before: dict = {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            comm_before = {"dp": dp_counter.snapshot(), "ddp": mesh.counter.snapshot()}
        # Every rank's share of the global batch; dp and single take all of it, in rank order.
        shares = [batch(args, cfg.vocab_size, r, step, device) for r in range(world)]
        whole = [torch.cat([s[i] for s in shares]).to(replicas[0]) for i in (0, 1)]
        for name in round_order(args.variants, step):
            torch.set_num_threads(threads[name])
            gc.collect()  # untimed: no step pays for another variant's garbage
            dist.barrier()
            if name == "ddp":
                t0 = time.perf_counter()
                phases = variants[name].step(*shares[rank])
            elif rank == 0:
                t0 = time.perf_counter()
                phases = variants[name].step(*whole)
            if rank == 0 or name == "ddp":
                dt = time.perf_counter() - t0
                if step >= args.warmup:
                    variants[name].times.append(dt)
                    for p, t in zip(PHASES, phases, strict=True):
                        variants[name].phases[p].append(t)
            dist.barrier()  # the idle ranks wait here while rank 0 runs dp or single
    steps = args.steps
    comm = {"dp": comm_since(dp_counter, comm_before.get("dp", {})),
            "ddp": comm_since(mesh.counter, comm_before.get("ddp", {}))}

    # Outside the timed region: a ddp step lasts as long as its slowest rank.
    if "ddp" in variants:
        v = variants["ddp"]
        local = torch.tensor([v.times, *v.phases.values()], dtype=torch.float64, device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        v.times, *rows = local.tolist()
        v.phases = dict(zip(PHASES, rows, strict=True))
    if rank != 0:
        return None
    ref_name = "ddp" if "ddp" in variants else next(iter(variants))
    ref = variants[ref_name]
    grad_diff, diffs, close = {}, {}, True
    for name, v in variants.items():
        pairs = list(zip(ref.first_grads, v.first_grads, strict=True))
        grad_diff[name] = max(((a - b.to(a.device)).abs().max() / a.abs().max()).item()
                              for a, b in pairs)
        pairs = [(a, b.to(a.device)) for a, b in zip(ref.model.parameters(),
                                                     v.model.parameters(), strict=True)]
        diffs[name] = max((a - b).abs().max().item() for a, b in pairs)
        close = close and all(torch.allclose(b, a, rtol=RTOL, atol=ATOL) for a, b in pairs)
    n_params = sum(p.numel() for p in next(iter(variants.values())).model.parameters())
    m = next(iter(variants.values())).model
    return {
        "variants": {name: {**summary(v.times), "final_loss": v.loss,
                            "phase_median_s": {p: statistics.median(ts)
                                               for p, ts in v.phases.items()}}
                     for name, v in sorted(variants.items(),
                                           key=lambda kv: args.variants.index(kv[0]))},
        "comm": {name: {"bytes_per_step": sum(c.values()) / steps,
                        "by_op": {op: n / steps for op, n in c.items()}}
                 for name, c in comm.items() if name in variants},
        "check": {"grads": {"reference": ref_name, "max_rel_diff": grad_diff,
                            "ok": max(grad_diff.values()) < GRAD_RTOL, "rtol": GRAD_RTOL},
                  "params": {"reference": ref_name, "max_abs_diff": diffs, "allclose": close,
                             "rtol": RTOL, "atol": ATOL}},
        "sizes": {"params": n_params, "param_bytes": n_params * 4,
                  "buffer_bytes": sum(b.numel() * b.element_size() for b in m.buffers()),
                  "vocab": cfg.vocab_size},
        "threads": threads,
    }


def dp_bytes_per_step(replicas: int, global_batch: int, seq: int, vocab: int, param_bytes: int,
                      buffer_bytes: int) -> int:
    """What dp copies per step (one micro-batch): parameters and buffers out to the k-1 other
    devices, the moved rows' token ids out and fp32 logits back, the logits' gradient out,
    and k-1 gradients back (docs/data-parallel.md)."""
    k = min(replicas, global_batch)
    moved = global_batch - -(-global_batch // k)
    return (2 * (k - 1) * param_bytes + (k - 1) * buffer_bytes + moved * seq * 8
            + 2 * moved * seq * vocab * 4)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON to --out and return the same dict."""
    args = parse_args(argv)
    cpu_unless_gpus(args, args.nproc)
    raw = launch(_rank_main, args)
    v = raw["variants"]
    for s in v.values():
        for other in ("ddp", "single"):
            s[f"ratio_to_{other}"] = s["median_s"] / v[other]["median_s"] if other in v else None
            s[f"paired_ratio_to_{other}"] = (paired(s["times_s"], v[other]["times_s"])
                                             if other in v else None)
    sizes = raw["sizes"]
    global_batch = args.nproc * args.batch
    result = {
        "config": {"nproc": args.nproc, "preset": args.preset, "steps": args.steps,
                   "warmup": args.warmup, "global_batch": global_batch, "seq": args.seq,
                   "device": args.device, "backend": "nccl" if args.device == "cuda" else "gloo",
                   "threads": raw["threads"], "cores": len(os.sched_getaffinity(0)),
                   "variants": args.variants, **sizes, **provenance(),
                   "fairness": FAIRNESS},
        "variants": v,
        "ratio": v["dp"]["ratio_to_ddp"] if "dp" in v else None,
        "comm": {**raw["comm"],
                 "dp_expected_bytes_per_step": dp_bytes_per_step(
                     args.nproc, global_batch, args.seq, sizes["vocab"], sizes["param_bytes"],
                     sizes["buffer_bytes"]),
                 "ddp_expected_bytes_per_step": sizes["param_bytes"], "axis_dp": AXIS},
        "check": raw["check"],
    }
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    c = r["config"]
    print(f"{c['preset']} ({c['params'] / 1e6:.2f}M params), global batch {c['global_batch']}x"
          f"{c['seq']}, {c['nproc']} replicas on {c['device']} ({c['cores']} cores, threads "
          f"{c['threads']}), {c['steps']} timed steps each after {c['warmup']} warm-up")
    print(f"{'':8}{'median ms':>11}{'p10 ms':>9}{'p90 ms':>9}{'fwd ms':>9}{'bwd ms':>9}"
          f"{'opt ms':>9}{'vs ddp':>8}{'paired':>8}")
    for name, s in r["variants"].items():
        ph = s["phase_median_s"]
        ratio = s["ratio_to_ddp"]
        pr = s["paired_ratio_to_ddp"]
        print(f"{name:8}{s['median_s'] * 1e3:11.2f}{s['p10_s'] * 1e3:9.2f}"
              f"{s['p90_s'] * 1e3:9.2f}{ph['forward'] * 1e3:9.2f}{ph['backward'] * 1e3:9.2f}"
              f"{ph['optimizer'] * 1e3:9.2f}{ratio or float('nan'):8.3f}"
              f"{pr or float('nan'):8.3f}")
    m = r["comm"]
    for name in ("dp", "ddp"):
        if name in m:
            ops = ", ".join(f"{op} {n / 2**20:.2f}" for op, n in m[name]["by_op"].items())
            print(f"{name} moves {m[name]['bytes_per_step'] / 2**20:.2f} MiB per step ({ops})")
    print(f"parameters {c['param_bytes'] / 2**20:.2f} MiB; dp formula "
          f"{m['dp_expected_bytes_per_step'] / 2**20:.2f} MiB, ddp formula "
          f"{m['ddp_expected_bytes_per_step'] / 2**20:.2f} MiB (all-reduce payload)")
    g, k = r["check"]["grads"], r["check"]["params"]
    print(f"first-step gradients agree with {g['reference']}: {g['ok']} (max relative diff "
          f"{max(g['max_rel_diff'].values()):.3g}); final parameters: max abs diff "
          f"{max(k['max_abs_diff'].values()):.3g} (reported only)")


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["check"]["grads"]["ok"] else 1)
