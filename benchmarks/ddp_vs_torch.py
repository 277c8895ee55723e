"""meshloom's DataParallel vs torch.nn.parallel.DistributedDataParallel, interleaved.

Every rank holds two identical copies of the model (same seed). Steps alternate between the two in
ABBA order (ours, torch, torch, ours, ...) on the same batches, so machine noise and any
first/second-in-a-pair effect hit both equally. A step (forward, backward, gradient sync, AdamW
step, zero_grad) is timed from a barrier; its time is the slowest rank's. At the end both copies
must hold the same parameters: they saw the same data, so a difference means the benchmark compares
two different computations.

    python benchmarks/ddp_vs_torch.py --nproc 2 --preset demo --steps 30
"""

from __future__ import annotations

import argparse
import inspect
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
from meshloom.parallel.ddp import FIRST_BUCKET_BYTES, DataParallel

# benchmarks/ is a folder of scripts, not a package: make its shared module importable however
# this file was loaded (as a script, or by path from a test).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    batch,
    check_common,
    cpu_unless_gpus,
    init_rank,
    launch,
    loss_of,
    parser,
    provenance,
    summary,
    threads_per_rank,
    write_result,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "ddp_vs_torch.json"
# Same-data copies can differ only by float rounding (e.g. torch divides before the all-reduce,
# we divide after); AdamW turns that into relative noise of the update, far below these.
RTOL, ATOL = 1e-4, 1e-5
FAIRNESS = ("torch DDP gets the same bucket caps (a 1 MiB first bucket, then --bucket-mb), "
            "gradient_as_bucket_view=True and no buffer sync (ours syncs none; the only buffer, "
            "the RoPE table, is identical everywhere); both use AdamW(lr=1e-3) and the same data")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, steps=30, warmup=5, out=DEFAULT_OUT)
    args = p.parse_args(argv)
    check_common(p, args)
    return args


# ----------------------------------------------------------------------------- one rank


def _torch_ddp_kwargs(bucket_mb: float) -> dict:
    """Options giving torch DDP our bucket layout and no extra work, on old and new torch."""
    known = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    kw: dict = {"gradient_as_bucket_view": True}
    if "bucket_cap_mb_list" in known:
        # Newer torch keeps its small first bucket only when bucket_cap_mb is left at its default;
        # an explicit 25 puts a 5 MB model in one bucket, so nothing overlaps with backward. Our
        # first bucket is capped at FIRST_BUCKET_BYTES, so ask for exactly that.
        kw["bucket_cap_mb_list"] = [min(FIRST_BUCKET_BYTES / 2**20, bucket_mb), bucket_mb]
    else:
        kw["bucket_cap_mb"] = bucket_mb  # older torch: always a 1 MiB first bucket, like ours
    # Buffer sync is off either way; broadcast_buffers is deprecated where the new name exists.
    kw["forward_sync_buffers" if "forward_sync_buffers" in known else "broadcast_buffers"] = False
    return kw


def _torch_bucket_bytes(model: nn.parallel.DistributedDataParallel) -> list[int] | None:
    """The layout torch DDP settled on after its first step (private API, so best effort)."""
    try:
        data = model._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data["bucket_sizes"]
        return [int(s) for s in str(sizes).split(",")]
    except Exception:  # noqa: BLE001 - only informational
        return None


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> dict | None:
    device = init_rank(args, rank, world)
    cuda = device.type == "cuda"
    mesh = Mesh(ParallelDims(dp_replicate=world), rank, device.type, CommCounter())
    cfg = config_from_preset(args.preset, max_seq_len=max(args.seq, 16))

    ours = build_model(cfg, args.seed, device)
    ddp = DataParallel(ours, mesh, axis="dp", bucket_mb=args.bucket_mb)
    theirs_model = build_model(cfg, args.seed, device)
    theirs = nn.parallel.DistributedDataParallel(
        theirs_model, device_ids=[rank] if cuda else None, **_torch_ddp_kwargs(args.bucket_mb))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_theirs = torch.optim.AdamW(theirs_model.parameters(), lr=1e-3)

    def step_ours(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(ours, x, y)
        loss.backward()
        ddp.finish()
        opt_ours.step()
        ddp.zero_grad()
        return loss

    def step_theirs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(theirs, x, y)
        loss.backward()  # torch DDP's backward returns with every bucket reduced and averaged
        opt_theirs.step()
        opt_theirs.zero_grad()  # the default set_to_none=True: what torch users run
        return loss

    def timed(fn, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
        dist.barrier()
        t0 = time.perf_counter()
        loss = fn(x, y)
        if cuda:
            torch.cuda.synchronize()  # kernels are async: the step ends when they have run
        return time.perf_counter() - t0, loss

    times: dict[str, list[float]] = {"ours": [], "torch": []}
    losses = {}
    comm_before = 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            comm_before = mesh.counter.total(axis="dp", op="all_reduce")
        x, y = batch(args, cfg.vocab_size, rank, step, device)
        order = [("ours", step_ours), ("torch", step_theirs)]
        for name, fn in order if step % 2 == 0 else order[::-1]:  # ABBA: no favoured slot
            dt, losses[name] = timed(fn, x, y)
            if step >= args.warmup:
                times[name].append(dt)
    comm_bytes = mesh.counter.total(axis="dp", op="all_reduce") - comm_before

    # Outside the timed region: a step lasts as long as its slowest rank.
    local = torch.tensor([times["ours"], times["torch"]], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    diff = max((a - b).abs().max().item()
               for a, b in zip(ours.parameters(), theirs_model.parameters(), strict=True))
    close = all(torch.allclose(a, b, rtol=RTOL, atol=ATOL)
                for a, b in zip(ours.parameters(), theirs_model.parameters(), strict=True))
    check = torch.tensor([diff, 0.0 if close else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    return {
        "times": {"ours": local[0].tolist(), "torch": local[1].tolist()},
        "loss": {k: v.detach().item() for k, v in losses.items()},
        "max_abs_diff": check[0].item(), "allclose": check[1].item() == 0.0,
        "comm_bytes_per_step": comm_bytes / args.steps,
        "grad_bytes": ddp.grad_bytes,
        "buckets": {"ours": [b.buffer.numel() * b.buffer.element_size() for b in ddp.buckets],
                    "torch": _torch_bucket_bytes(theirs)},
        "params": sum(p.numel() for p in ours.parameters()),
    }


# ----------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON to --out and return the same dict."""
    args = parse_args(argv)
    cpu_unless_gpus(args, args.nproc)
    raw = launch(_rank_main, args)
    ours, theirs = summary(raw["times"]["ours"]), summary(raw["times"]["torch"])
    # Paired: each "ours" step against the torch step of the same pair, immune to slow drift.
    paired = [a / b for a, b in zip(ours["times_s"], theirs["times_s"], strict=True)]
    result = {
        "config": {"nproc": args.nproc, "preset": args.preset, "steps": args.steps,
                   "warmup": args.warmup, "batch_per_rank": args.batch, "seq": args.seq,
                   "bucket_mb": args.bucket_mb, "device": args.device,
                   "backend": "nccl" if args.device == "cuda" else "gloo",
                   "threads_per_rank": threads_per_rank(args.nproc),
                   "params": raw["params"], **provenance(), "fairness": FAIRNESS},
        "ours": ours,
        "torch": theirs,
        "ratio": ours["median_s"] / theirs["median_s"],
        "paired_ratio_median": statistics.median(paired),
        "ours_faster_fraction": sum(r < 1.0 for r in paired) / len(paired),
        "bucket_bytes": {**raw["buckets"],
                         "same_layout": raw["buckets"]["ours"] == raw["buckets"]["torch"]},
        "comm": {"bytes_per_step": raw["comm_bytes_per_step"], "grad_bytes": raw["grad_bytes"],
                 "bytes_over_grad_bytes": raw["comm_bytes_per_step"] / raw["grad_bytes"]},
        "check": {"max_abs_diff": raw["max_abs_diff"], "allclose": raw["allclose"],
                  "rtol": RTOL, "atol": ATOL, "final_loss": raw["loss"]},
    }
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    c = r["config"]
    print(f"{c['preset']} ({c['params'] / 1e6:.2f}M params), {c['nproc']} x {c['backend']} on "
          f"{c['device']}, {c['threads_per_rank']} thread(s)/rank, batch {c['batch_per_rank']}x"
          f"{c['seq']} per rank, {c['steps']} timed steps each after {c['warmup']} warm-up")
    print(f"fairness: {c['fairness']}")
    print(f"{'':8}{'median ms':>11}{'mean ms':>10}{'p10 ms':>9}{'p90 ms':>9}")
    for name in ("ours", "torch"):
        s = r[name]
        print(f"{name:8}{s['median_s'] * 1e3:11.2f}{s['mean_s'] * 1e3:10.2f}"
              f"{s['p10_s'] * 1e3:9.2f}{s['p90_s'] * 1e3:9.2f}")
    print(f"ratio ours/torch (medians): {r['ratio']:.3f}   paired median: "
          f"{r['paired_ratio_median']:.3f}   ours faster in "
          f"{r['ours_faster_fraction']:.0%} of pairs")
    b = r["bucket_bytes"]
    print(f"buckets (bytes): ours {b['ours']}, torch {b['torch']} -> same: {b['same_layout']}")
    m = r["comm"]
    print(f"comm: {m['bytes_per_step'] / 2**20:.2f} MiB all-reduced per step for "
          f"{m['grad_bytes'] / 2**20:.2f} MiB of gradients ({m['bytes_over_grad_bytes']:.3f}x)")
    k = r["check"]
    print(f"parameters agree: {k['allclose']} (max abs diff {k['max_abs_diff']:.3g})")


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["check"]["allclose"] else 1)
