"""meshloom's DDP and ZeRO-1/2/3 against PyTorch's FSDP2 (`fully_shard`), interleaved in one run.

Every rank holds one copy of the same model (same seed) per variant, all fed the same batches:
- ddp: meshloom's DataParallel;       zero1, zero2: meshloom's ZeroDataParallel(stage=1|2);
- zero3: meshloom's FullyShardedDataParallel (reshard after forward);
- fsdp2: torch's fully_shard on every transformer block, then on the root, reshard after
  forward, fp32, over a 1-D DeviceMesh of all ranks, with torch.optim.AdamW(foreach=True).
Variants take turns step by step in an order that rotates every round (and runs backwards every
other cycle), so no variant always goes first or always follows the same one. A step (forward,
backward, gradient sync, AdamW step, after_step, zero_grad) is timed from a barrier; its time is
the slowest rank's. One extra, untimed step per variant measures memory. At the end every
variant's full parameters must agree: they saw the same data, so a difference would mean the
benchmark compares different computations.

    python benchmarks/zero_vs_fsdp2.py --nproc 2 --preset demo --steps 20
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from meshloom.comm import CommCounter
from meshloom.config import TrainConfig
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.llama import LlamaConfig, build_model, config_from_preset
from meshloom.optim import build_optimizer, decay_groups
from meshloom.parallel.ddp import DataParallel
from meshloom.parallel.fsdp import FullyShardedDataParallel
from meshloom.parallel.zero import ZeroDataParallel

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

VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "zero_vs_fsdp2.json"
TCFG = TrainConfig(lr=1e-3)  # AdamW: betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices
# Same-data copies can differ only by float rounding (summation order in the reductions);
# AdamW turns that into relative noise of the update, far below these.
RTOL, ATOL = 1e-4, 1e-5
FAIRNESS = ("every variant: the same model, seed, batches and AdamW settings (foreach, weight "
            "decay on matrices only); FSDP2 wraps each block then the root (torchtitan's "
            "pattern, so its root unit also holds the embedding; ours shards the embedding as "
            "its own unit), reshard_after_forward=True, fp32; ours use build_optimizer")
MEMORY_NOTE = (
    "unique storages on one rank, max over ranks. after_step: after optimizer.step() and "
    "after_step(), before zero_grad(); after_backward: right after loss.backward(), before "
    "finish() (FSDP2 has already reduced its gradients and resharded by then). Kinds: params = "
    "what the optimizer updates (whole for ddp/zero1/zero2, local shards for zero3/fsdp2), "
    "unsharded = gathered whole parameters beyond that, grads, optim = AdamW state, buffers = "
    "any other tensor the strategy holds (flat gradient buckets, collectives in flight). "
    "step_peak: model state at the step's start plus the highest rise of allocated bytes during "
    "one step (CPU: torch.profiler's allocator events; CUDA: max_memory_allocated); it includes "
    "activations, which are the same for every variant")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, steps=20, warmup=3, out=DEFAULT_OUT)
    args = parse_with_variants(p, argv, VARIANTS)
    return args


# ----------------------------------------------------------------------------- variants


class Variant:
    """One copy of the model with its optimizer; `strategy` is ours (None for FSDP2)."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 strategy: object | None = None):
        self.name, self.model, self.optimizer, self.strategy = name, model, optimizer, strategy

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(self.model, x, y)
        loss.backward()
        return loss.detach()

    def sync(self) -> None:
        if self.strategy is not None:  # FSDP2 has reduce-scattered inside backward already
            self.strategy.finish()

    def update(self) -> None:
        self.optimizer.step()
        if self.strategy is not None:
            self.strategy.after_step()

    def zero_grad(self) -> None:
        if self.strategy is not None:
            self.strategy.zero_grad()
        else:
            self.optimizer.zero_grad()  # set_to_none=True, as torchtitan runs it

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.forward_backward(x, y)
        self.sync()
        self.update()
        self.zero_grad()
        return loss

    # -- what it holds, for the memory figures

    def holders(self) -> list[object]:
        """Objects whose tensor attributes are the strategy's own buffers."""
        if self.strategy is not None:
            return [*getattr(self.strategy, "buckets", []), *getattr(self.strategy, "units", [])]
        # FSDP2's parameter groups and parameters (private API: best effort).
        out: list[object] = []
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                state = m._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None) or [
                    getattr(state, "_fsdp_param_group", None)]
                for g in filter(None, groups):
                    out += [g, *g.fsdp_params]
        return out

    def unsharded(self) -> list[torch.Tensor]:
        """Whole working parameters beyond the model's own (FSDP2 keeps them privately)."""
        if self.strategy is not None:
            return []  # ours: the model's parameters are the whole working copies
        return [h._unsharded_param for h in self.holders() if hasattr(h, "_unsharded_param")]

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole and detached (a collective for the sharded variants)."""
        if isinstance(self.strategy, FullyShardedDataParallel):
            return self.strategy.full_state_dict()
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in self.model.named_parameters()}


def _fsdp2(model: nn.Module, dmesh: DeviceMesh) -> Variant:
    for block in model.layers:
        fully_shard(block, mesh=dmesh, reshard_after_forward=True)
    fully_shard(model, mesh=dmesh, reshard_after_forward=True)
    decay, no_decay = decay_groups(model.parameters())
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": TCFG.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=TCFG.lr, betas=(TCFG.beta1, TCFG.beta2), eps=TCFG.eps,
                            foreach=True)
    return Variant("fsdp2", model, opt)


def build_variant(name: str, cfg: LlamaConfig, args: argparse.Namespace, mesh: Mesh,
                  dmesh: DeviceMesh, device: torch.device) -> Variant:
    model = build_model(cfg, args.seed, device)
    if name == "fsdp2":
        return _fsdp2(model, dmesh)
    if name == "ddp":
        strategy = DataParallel(model, mesh, axis="dp", bucket_mb=args.bucket_mb)
    elif name in ("zero1", "zero2"):
        strategy = ZeroDataParallel(model, mesh, stage=int(name[-1]), bucket_mb=args.bucket_mb)
    else:
        strategy = FullyShardedDataParallel(model, mesh, reshard_after_forward=True)
    # fused=False: on CUDA build_optimizer would pick the fused kernel; FSDP2 runs foreach.
    opt = build_optimizer(*strategy.optim_param_groups(), TCFG, fused=False)
    return Variant(name, model, opt, strategy)


# ----------------------------------------------------------------------------- memory


def _tensors_in(objs: list[object]) -> list[torch.Tensor]:
    """Tensors among the attributes of objs, one level into tuples, lists and dicts."""
    out = []
    for obj in objs:
        for value in vars(obj).values():
            inner = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else [value]
            out += [t for t in inner if torch.is_tensor(t)]
    return out


def state_bytes(v: Variant) -> dict[str, int]:
    """Live bytes per kind (see MEMORY_NOTE), each storage counted once, in the first kind
    that reaches it."""
    opt_params = [p for g in v.optimizer.param_groups for p in g["params"]]
    model_params = list(v.model.parameters()) + v.unsharded()
    kinds = {
        "params": opt_params,
        "unsharded": model_params,
        "grads": [p.grad for p in opt_params + model_params],
        "optim": [t for st in v.optimizer.state.values() for t in st.values()
                  if torch.is_tensor(t)],
        "buffers": _tensors_in(v.holders()),
    }
    seen: set[tuple[str, int]] = set()
    out = {}
    for kind, tensors in kinds.items():
        out[kind] = 0
        for t in tensors:
            if t is None:
                continue
            s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            key = (str(s.device), s.data_ptr())
            if s.nbytes() and key not in seen:  # a freed (resized to 0) storage holds nothing
                seen.add(key)
                out[kind] += s.nbytes()
    out["total"] = sum(out.values())
    return out


class PeakRise:
    """The highest rise of allocated bytes above the level at entry, over a block of code."""

    def __init__(self, device: torch.device):
        self.cuda, self.rise = device.type == "cuda", 0

    def __enter__(self) -> PeakRise:
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            # The CPU allocator reports to the profiler only; memory from before the block
            # that is freed inside it is not subtracted (torch warns), so this errs high.
            self.prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.rise = torch.cuda.max_memory_allocated() - self.base
            return
        self.prof.__exit__(*exc)
        from torch._C._profiler import _EventType  # private: the only timeline of allocations

        events, stack = [], list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            stack += node.children
        level = 0
        for _, size in sorted(events):
            level += size
            self.rise = max(self.rise, level)


def measure_memory(v: Variant, x: torch.Tensor, y: torch.Tensor,
                   device: torch.device) -> dict:
    """One untimed step with probes: the byte counts of MEMORY_NOTE for this rank."""
    gc.collect()
    start = state_bytes(v)["total"]
    with PeakRise(device) as peak:
        v.forward_backward(x, y)
        after_backward = state_bytes(v)
        v.sync()
        v.update()
        after_step = state_bytes(v)
        v.zero_grad()
    return {"after_step": after_step, "after_backward": after_backward,
            "step_peak": start + peak.rise}


# ----------------------------------------------------------------------------- one rank


def _agreement(variants: list[Variant], device: torch.device) -> dict:
    """Max abs difference of every variant's parameters from the first one's, and whether
    every pair is allclose (collective: every rank gathers the same things in the same order)."""
    full = {v.name: v.full_params() for v in variants}
    names = list(full)
    diffs = [max((full[n][k] - full[names[0]][k]).abs().max().item() for k in full[n])
             for n in names]
    close = all(full[a].keys() == full[b].keys() and all(
        torch.allclose(full[a][k], full[b][k], rtol=RTOL, atol=ATOL) for k in full[a])
        for a, b in itertools.combinations(names, 2))
    t = torch.tensor([*diffs, 0.0 if close else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"reference": names[0], "max_abs_diff": dict(zip(names, t[:-1].tolist(), strict=True)),
            "allclose": t[-1].item() == 0.0}


def timed_rounds(variants: list[Variant], args: argparse.Namespace, vocab: int, rank: int,
                 device: torch.device, mesh: Mesh,
                 run: Callable[[Variant, torch.Tensor, torch.Tensor], torch.Tensor]
                 ) -> tuple[dict[str, list[float]], dict[str, Counter], dict[str, float]]:
    """`args.warmup + args.steps` rounds, each variant running `run` once a round on the same
    batch, in `round_order`: per variant this rank's timed step seconds, the bytes our counter
    saw per op in the timed steps, and the last loss."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    comm: dict[str, Counter] = {v.name: Counter() for v in variants}
    losses: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        x, y = batch(args, vocab, rank, step, device)
        for v in round_order(variants, step):
            # Collect the last step's garbage now, so that no step pays for another's.
            gc.collect()
            before = mesh.counter.snapshot()
            dist.barrier()
            t0 = time.perf_counter()
            loss = run(v, x, y)
            if device.type == "cuda":
                torch.cuda.synchronize()  # kernels are async: the step ends when they have run
            dt = time.perf_counter() - t0
            losses[v.name] = loss.item()
            if step >= args.warmup:
                times[v.name].append(dt)
                comm[v.name] += comm_since(mesh.counter, before)
    return times, comm, losses


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> dict | None:
    device = init_rank(args, rank, world)
    mesh = Mesh(ParallelDims(dp_shard=world), rank, device.type, CommCounter())
    dmesh = init_device_mesh(device.type, (world,))
    cfg = config_from_preset(args.preset, max_seq_len=max(args.seq, 16))
    variants = [build_variant(n, cfg, args, mesh, dmesh, device) for n in args.variants]
    times, comm, losses = timed_rounds(variants, args, cfg.vocab_size, rank, device, mesh,
                                       lambda v, x, y: v.step(x, y))

    x, y = batch(args, cfg.vocab_size, rank, args.warmup + args.steps, device)
    memory = {v.name: measure_memory(v, x, y, device) for v in variants}
    check = _agreement(variants, device)

    # Outside the timed region: a step lasts as long as its slowest rank.
    local = torch.tensor([times[v.name] for v in variants], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    memories: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(memories, memory)
    if rank != 0:
        return None
    return {"times": {v.name: local[i].tolist() for i, v in enumerate(variants)},
            "memory": {v.name: [m[v.name] for m in memories] for v in variants},
            "comm": {n: {op: b / args.steps for op, b in c.items()} for n, c in comm.items()},
            "loss": losses, "check": check,
            "params": sum(p.numel() for p in build_model(cfg, args.seed, "meta").parameters())}


# ----------------------------------------------------------------------------- report


def _memory_report(per_rank: list[dict]) -> dict:
    """Max over ranks of each figure (shards differ by padding only), and every rank's totals."""
    out: dict = {"per_rank_total": {k: [m[k] if k == "step_peak" else m[k]["total"]
                                        for m in per_rank]
                                    for k in ("after_step", "after_backward", "step_peak")}}
    for k in ("after_step", "after_backward"):
        out[k] = {kind: max(m[k][kind] for m in per_rank) for kind in per_rank[0][k]}
    out["step_peak"] = max(m["step_peak"] for m in per_rank)
    return out


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON to --out and return the same dict."""
    args = parse_args(argv)
    cpu_unless_gpus(args, args.nproc)
    raw = launch(_rank_main, args)
    param_bytes = raw["params"] * 4  # fp32
    variants = {}
    for name in args.variants:
        t = raw["times"][name]
        comm = raw["comm"][name] if name != "fsdp2" else None
        variants[name] = {
            **summary(t),
            "ratio_to_fsdp2": None, "paired_ratio_to_fsdp2": None,
            "ratio_to_ddp": None, "paired_ratio_to_ddp": None,
            "memory_bytes": _memory_report(raw["memory"][name]),
            "comm": None if comm is None else {
                "bytes_per_step": sum(comm.values()), "by_op": comm,
                "over_param_bytes": sum(comm.values()) / param_bytes},
            "final_loss": raw["loss"][name],
        }
    for base in ("fsdp2", "ddp"):
        if base in variants:
            for v in variants.values():
                v[f"ratio_to_{base}"] = v["median_s"] / variants[base]["median_s"]
                v[f"paired_ratio_to_{base}"] = paired(v["times_s"], variants[base]["times_s"])
    result = {
        "config": {"nproc": args.nproc, "preset": args.preset, "steps": args.steps,
                   "warmup": args.warmup, "batch_per_rank": args.batch, "seq": args.seq,
                   "variants": args.variants, "bucket_mb": args.bucket_mb,
                   "device": args.device, "backend": "nccl" if args.device == "cuda" else "gloo",
                   "threads_per_rank": threads_per_rank(args.nproc), "params": raw["params"],
                   "param_bytes": param_bytes, **provenance(),
                   "fairness": FAIRNESS},
        "variants": variants,
        "memory_note": MEMORY_NOTE,
        "comm_note": "bytes our CommCounter recorded per timed step (payload as in "
                     "meshloom.comm); FSDP2's collectives bypass it, so fsdp2 reports none",
        "check": {**raw["check"], "rtol": RTOL, "atol": ATOL},
    }
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    c, mib = r["config"], 2**20
    print(f"{c['preset']} ({c['params'] / 1e6:.2f}M params), {c['nproc']} x {c['backend']} on "
          f"{c['device']}, {c['threads_per_rank']} thread(s)/rank, batch {c['batch_per_rank']}x"
          f"{c['seq']} per rank, {c['steps']} timed steps each after {c['warmup']} warm-up")
    print(f"{'':7}{'median':>9}{'p10':>8}{'p90':>8}{'/fsdp2':>8}{'/ddp':>7}"
          f"{'state':>8}{'bwd':>8}{'peak':>8}{'comm':>8}   (ms; MiB per rank; comm MiB/step)")
    for name, v in r["variants"].items():
        m = v["memory_bytes"]
        ratios = "".join(f"{x:{w}.3f}" if x is not None else f"{'-':>{w}}"
                         for x, w in ((v["ratio_to_fsdp2"], 8), (v["ratio_to_ddp"], 7)))
        comm = f"{v['comm']['bytes_per_step'] / mib:8.2f}" if v["comm"] else f"{'n/a':>8}"
        print(f"{name:7}{v['median_s'] * 1e3:9.1f}{v['p10_s'] * 1e3:8.1f}"
              f"{v['p90_s'] * 1e3:8.1f}{ratios}{m['after_step']['total'] / mib:8.2f}"
              f"{m['after_backward']['total'] / mib:8.2f}{m['step_peak'] / mib:8.2f}{comm}")
    print("state = params+grads+optimizer after the step; bwd = model state right after "
          "backward; peak = state at start + allocator peak rise in a step (see memory_note)")
    k = r["check"]
    diffs = ", ".join(f"{n} {d:.2g}" for n, d in k["max_abs_diff"].items())
    print(f"parameters agree: {k['allclose']} (max abs diff vs {k['reference']}: {diffs})")


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["check"]["allclose"] else 1)
