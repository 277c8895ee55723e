"""ZeRO-3 under gradient accumulation: reduce-scatter every micro-batch, or sum whole gradients
and reduce once a step, meshloom's and PyTorch FSDP2's, interleaved in one run.

Every rank holds one copy of the same model (same seed) per variant, all fed the same batches,
each step `--micro-batches` micro-batches of the rank's batch:
- zero3: meshloom's FullyShardedDataParallel, each micro-batch's gradients reduce-scattered;
- zero3_once: the same with `reduce_once` (`parallel.reduce_once`): whole fp32 sums inside
  `no_sync()`, one reduce-scatter a unit on the last micro-batch;
- fsdp2: torch's fully_shard on every block, then on the root, each micro-batch reduce-scattered;
- fsdp2_once: the same with `set_requires_gradient_sync(False)` for every micro-batch but the
  last (FSDP2's no_sync: unsharded gradients kept and reduced once).
Steps are timed from a barrier, variants taking turns in a rotating order (zero_vs_fsdp2.py's
harness); a step's time is the slowest rank's. One more untimed step per variant measures the
model state and the step's peak. At the end every variant's whole parameters must agree.

    python benchmarks/zero3_accumulation.py --nproc 2 --preset demo --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.llama import build_model, config_from_preset
from meshloom.optim import build_optimizer
from meshloom.parallel.fsdp import FullyShardedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    batch,
    cpu_unless_gpus,
    init_rank,
    launch,
    loss_of,
    paired,
    parse_with_variants,
    parser,
    provenance,
    summary,
    threads_per_rank,
    write_result,
)
from zero_vs_fsdp2 import (  # noqa: E402
    ATOL,
    RTOL,
    TCFG,
    PeakRise,
    Variant,
    _agreement,
    _fsdp2,
    state_bytes,
    timed_rounds,
)

VARIANTS = ("zero3", "zero3_once", "fsdp2", "fsdp2_once")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "zero3_accumulation.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, steps=20, warmup=3, out=DEFAULT_OUT)
    p.add_argument("--micro-batches", type=int, default=4,
                   help="micro-batches a step (each of batch / micro-batches sequences)")
    args = parse_with_variants(p, argv, VARIANTS)
    if args.micro_batches < 2 or args.batch % args.micro_batches:
        p.error(f"--micro-batches={args.micro_batches} must be 2 or more and divide "
                f"--batch={args.batch}")
    return args


def build_variant(name: str, cfg, args: argparse.Namespace, mesh: Mesh, dmesh,
                  device: torch.device) -> Variant:
    model = build_model(cfg, args.seed, device)
    if name.startswith("fsdp2"):
        v = _fsdp2(model, dmesh)
        v.name = name
        return v
    strategy = FullyShardedDataParallel(model, mesh, reduce_once=name == "zero3_once")
    # fused=False: on CUDA build_optimizer would pick the fused kernel; FSDP2 runs foreach.
    return Variant(name, model, build_optimizer(*strategy.optim_param_groups(), TCFG,
                                                fused=False), strategy)


def forward_backward(v: Variant, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    """The step's m micro-batches, each loss divided by m; all but the last without the
    data-parallel sync where the variant defers it."""
    total = torch.zeros(())
    for k, (xk, yk) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
        last = k == m - 1
        if v.strategy is None:
            v.model.set_requires_gradient_sync(last or v.name == "fsdp2")
        ctx = v.strategy.no_sync() if v.strategy is not None and not last else \
            contextlib.nullcontext()
        with ctx:
            loss = loss_of(v.model, xk, yk) / m
            loss.backward()
        total += loss.detach().cpu()
    return total


def step(v: Variant, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    loss = forward_backward(v, x, y, m)
    v.sync()
    v.update()
    v.zero_grad()
    return loss


def measure_memory(v: Variant, x: torch.Tensor, y: torch.Tensor, m: int,
                   device: torch.device) -> dict:
    """The model state before a step and its peak during it (zero_vs_fsdp2.MEMORY_NOTE)."""
    gc.collect()
    start = state_bytes(v)["total"]
    with PeakRise(device) as peak:
        step(v, x, y, m)
    return {"state": start, "step_peak": start + peak.rise}


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> dict | None:
    device = init_rank(args, rank, world)
    mesh = Mesh(ParallelDims(dp_shard=world), rank, device.type, CommCounter())
    dmesh = init_device_mesh(device.type, (world,))
    cfg = config_from_preset(args.preset, max_seq_len=max(args.seq, 16))
    variants = [build_variant(n, cfg, args, mesh, dmesh, device) for n in args.variants]
    m = args.micro_batches
    times, comm, losses = timed_rounds(variants, args, cfg.vocab_size, rank, device, mesh,
                                       lambda v, x, y: step(v, x, y, m))
    x, y = batch(args, cfg.vocab_size, rank, args.warmup + args.steps, device)
    memory = {v.name: measure_memory(v, x, y, m, device) for v in variants}
    check = _agreement(variants, device)
    local = torch.tensor([times[v.name] for v in variants], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    memories: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(memories, memory)
    if rank != 0:
        return None
    return {"times": {v.name: local[i].tolist() for i, v in enumerate(variants)},
            "memory": {v.name: {k: max(mm[v.name][k] for mm in memories)
                                for k in ("state", "step_peak")} for v in variants},
            "comm": {n: {op: b / args.steps for op, b in c.items()} for n, c in comm.items()},
            "loss": losses, "check": check,
            "params": sum(p.numel() for p in build_model(cfg, args.seed, "meta").parameters())}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON to --out and return the same dict."""
    args = parse_args(argv)
    cpu_unless_gpus(args, args.nproc)
    raw = launch(_rank_main, args)
    variants = {}
    for name in args.variants:
        comm = raw["comm"][name] if name.startswith("zero3") else None
        variants[name] = {**summary(raw["times"][name]), "memory_bytes": raw["memory"][name],
                          "comm": None if comm is None else {
                              "bytes_per_step": sum(comm.values()), "by_op": comm},
                          "final_loss": raw["loss"][name]}
    for name, base in (("zero3_once", "zero3"), ("fsdp2_once", "fsdp2"), ("zero3", "fsdp2"),
                       ("zero3_once", "fsdp2_once")):
        if name in variants and base in variants:
            variants[name][f"ratio_to_{base}"] = (variants[name]["median_s"]
                                                  / variants[base]["median_s"])
            variants[name][f"paired_ratio_to_{base}"] = paired(variants[name]["times_s"],
                                                               variants[base]["times_s"])
    result = {
        "config": {"nproc": args.nproc, "preset": args.preset, "steps": args.steps,
                   "warmup": args.warmup, "batch_per_rank": args.batch, "seq": args.seq,
                   "micro_batches": args.micro_batches, "variants": args.variants,
                   "device": args.device, "backend": "nccl" if args.device == "cuda" else "gloo",
                   "threads_per_rank": threads_per_rank(args.nproc), "params": raw["params"],
                   **provenance()},
        "variants": variants,
        "memory_note": "bytes on one rank, max over ranks: state = unique storages the variant "
                       "holds between steps; step_peak = state plus the highest rise of "
                       "allocated bytes during one whole accumulated step (zero_vs_fsdp2.py)",
        "comm_note": "bytes our CommCounter recorded per timed step; FSDP2's collectives "
                     "bypass it, so the fsdp2 variants report none",
        "check": {**raw["check"], "rtol": RTOL, "atol": ATOL},
    }
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    c, mib = r["config"], 2**20
    print(f"{c['preset']} ({c['params'] / 1e6:.2f}M params), {c['nproc']} x {c['backend']}, "
          f"batch {c['batch_per_rank']}x{c['seq']} per rank in {c['micro_batches']} "
          f"micro-batches, {c['steps']} timed steps each")
    print(f"{'':11}{'median':>9}  {'paired ratio to':<32}{'state':>8}{'peak':>8}{'comm':>8}"
          "   (ms; MiB per rank; comm MiB/step)")
    for name, v in r["variants"].items():
        pairs = [(k[len("paired_ratio_to_"):], x) for k, x in v.items()
                 if k.startswith("paired_ratio_to_")]
        ratio = " ".join(f"{b} {x:.3f}" for b, x in pairs) or "-"
        comm = f"{v['comm']['bytes_per_step'] / mib:8.2f}" if v["comm"] else f"{'n/a':>8}"
        m = v["memory_bytes"]
        print(f"{name:11}{v['median_s'] * 1e3:9.1f}  {ratio:<32}{m['state'] / mib:8.2f}"
              f"{m['step_peak'] / mib:8.2f}{comm}")
    ch = r["check"]
    print(f"parameters agree (rtol {ch['rtol']}, atol {ch['atol']}): {ch['allclose']}")


if __name__ == "__main__":
    main()
