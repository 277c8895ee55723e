"""meshloom's tensor parallel against PyTorch's DTensor tensor parallel, interleaved in one run.

Every rank holds one copy of the same model (same seed) per variant, all fed the same batches
(every rank of a tensor-parallel group sees the same batch):
- meshloom_tp, meshloom_tp_sp: meshloom's `parallelize` over a tp mesh (Llama.TP_PLAN: vocab-
  parallel embedding, q/k/v/w1/w3 column-parallel, wo/w2 row-parallel, the head column-parallel
  over the vocabulary, vocab-parallel cross-entropy), without and with sequence parallel;
- dtensor_tp: torch's `parallelize_module` over a 1-D DeviceMesh of the same ranks: the embedding
  RowwiseParallel (replicated output), attention and MLP entered once through PrepareModuleInput
  (Replicate -> Replicate, so each region all-reduces its input gradient once, as ours does),
  wq/wk/wv/w1/w3 ColwiseParallel, wo/w2 RowwiseParallel, the head ColwiseParallel with
  vocabulary-split DTensor logits and `loss_parallel` cross-entropy; the norms stay plain;
- dtensor_tp_sp: torchtitan's Llama plan: as above, plus SequenceParallel on the norms, the
  embedding, wo and w2 returning sequence-split outputs, PrepareModuleInput gathering the
  sequence at the entry of attention and MLP, the head entered from sequence-split input.
DTensor runs torch.optim.AdamW(foreach=True) over its parameters with our groups and settings;
ours use build_optimizer. Variants take turns step by step in an order that rotates every round
(and runs backwards every other cycle). A step (forward, backward, gradient sync, AdamW step,
after_step, zero_grad) is timed from a barrier; its time is the slowest rank's. Before the
timed steps, one untimed step checks that every variant computes the same whole gradients from
the same weights (a difference would mean the benchmark compares different computations; the
exit status is then 1); after them, one untimed step per variant counts its collectives, and the
final parameters are compared and reported (AdamW and random tokens let rounding differences
grow over a long run, so they are not the pass mark: see GRAD_RTOL).

    python benchmarks/tp_vs_dtensor.py --nproc 2 --preset demo --steps 20
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from meshloom.comm import CommCounter
from meshloom.config import ParallelConfig, TrainConfig
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.llama import LlamaConfig, build_model, config_from_preset
from meshloom.optim import build_optimizer, decay_groups
from meshloom.parallel import Parallelized, parallelize

# benchmarks/ is a folder of scripts, not a package: make its shared modules importable however
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

VARIANTS = ("meshloom_tp", "meshloom_tp_sp", "dtensor_tp", "dtensor_tp_sp")
BASES = ("dtensor_tp", "dtensor_tp_sp")  # ratio_to_dtensor, ratio_to_dtensor_sp
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "tp_vs_dtensor.json"
TCFG = TrainConfig(lr=1e-3)  # AdamW: betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices
# Same-data copies differ only by float rounding: the tensor-parallel reductions (and the
# vocab-parallel loss) sum in a different order in each implementation. The first step's
# gradients agree to ~1e-6 of each tensor's largest entry (GRAD_RTOL: the pass mark). The final
# parameters are compared too (RTOL, ATOL), but only reported: AdamW divides each gradient
# entry by its own running magnitude, so entries that cancel to ~eps make O(lr) differences
# from rounding alone, and training on random tokens then amplifies them step after step.
GRAD_RTOL = 1e-5
RTOL, ATOL = 1e-4, 2e-5
FAIRNESS = ("every variant: the same model, seed, batches and AdamW settings (foreach, weight "
            "decay on matrices only); both sides keep the logits split over the vocabulary "
            "(ours: vocab_parallel_cross_entropy, DTensor: loss_parallel) and enter attention "
            "and MLP once (ours: the plan's 'input' hooks, DTensor: PrepareModuleInput); the "
            "SP variants follow torchtitan's plan; fp32; ours zero gradients in place, DTensor "
            "sets them to None (optimizer.zero_grad(), as torchtitan runs it)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, steps=20, warmup=3, out=DEFAULT_OUT)
    args = parse_with_variants(p, argv, VARIANTS)
    if args.nproc < 2:
        p.error("tensor parallel needs --nproc >= 2")
    if any(v.endswith("_sp") for v in args.variants) and args.seq % args.nproc:
        p.error(f"sequence parallel needs --seq divisible by --nproc={args.nproc}")
    return args


# ----------------------------------------------------------------------------- variants


class Variant:
    """One copy of the model with its optimizer; `par` is ours (None for DTensor)."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 par: Parallelized | None = None):
        self.name, self.model, self.optimizer, self.par = name, model, optimizer, par

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.par is not None:
            loss = self.par.loss(self.par.model(x), y)
            loss.backward()
            return loss.detach()
        # The head returns vocabulary-split DTensor logits; the loss and its backward must both
        # run inside loss_parallel.
        with loss_parallel():
            loss = loss_of(self.model, x, y)
            loss.backward()
        return loss.detach().to_local()

    def sync(self) -> None:
        if self.par is not None:  # sums the sequence-parallel norm gradients over tp
            self.par.grads.finish()

    def update(self) -> None:
        self.optimizer.step()
        if self.par is not None:
            self.par.grads.after_step()

    def zero_grad(self) -> None:
        if self.par is not None:
            self.par.grads.zero_grad()
        else:
            self.optimizer.zero_grad()  # set_to_none=True, as torchtitan runs it

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.forward_backward(x, y)
        self.sync()
        self.update()
        self.zero_grad()
        return loss

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient whole, after sync() (a collective over tp)."""
        if self.par is not None:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            # Cloned: gather_full hands back the unsplit ones as they are, and zero_grad()
            # zeroes ours in place.
            return self.par.tp.gather_full({n: p.grad.clone() for n, p in params.items()},
                                           params)
        return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for n, p in self.model.named_parameters()}

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole and detached (a collective over tp)."""
        if self.par is not None:
            return self.par.grads.full_state_dict()
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in self.model.named_parameters()}


def dtensor_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, object]:
    """torchtitan's Llama plan (sequence parallel), or its plain tensor-parallel counterpart."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                  use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan.update({
            p + "attention": PrepareModuleInput(input_layouts=(seq, None),
                                                desired_input_layouts=(Replicate(), None)),
            p + "attention.wq": ColwiseParallel(),
            p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(),
            p + "attention.wo": RowwiseParallel(output_layouts=seq),
            p + "feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                                   desired_input_layouts=(Replicate(),)),
            p + "feed_forward.w1": ColwiseParallel(),
            p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        })
        if sequence_parallel:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
    return plan


def _dtensor(name: str, model: nn.Module, dmesh: DeviceMesh) -> Variant:
    parallelize_module(model, dmesh, dtensor_plan(model, name.endswith("_sp")))
    decay, no_decay = decay_groups(model.parameters())
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": TCFG.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=TCFG.lr, betas=(TCFG.beta1, TCFG.beta2), eps=TCFG.eps,
                            foreach=True)
    return Variant(name, model, opt)


def build_variant(name: str, cfg: LlamaConfig, args: argparse.Namespace, mesh: Mesh,
                  dmesh: DeviceMesh, device: torch.device) -> Variant:
    model = build_model(cfg, args.seed, device)
    if name.startswith("dtensor"):
        return _dtensor(name, model, dmesh)
    pcfg = ParallelConfig(tp=args.nproc, dp_shard=1, sequence_parallel=name.endswith("_sp"))
    par = parallelize(model, mesh, pcfg)
    # fused=False: on CUDA build_optimizer would pick the fused kernel; DTensor runs foreach.
    opt = build_optimizer(*par.grads.optim_param_groups(), TCFG, fused=False)
    return Variant(name, par.model, opt, par)


# ----------------------------------------------------------------------------- one rank


def count_collectives(v: Variant, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """Collectives of one untimed step, by op, as torch's CommDebugMode sees them (c10d calls
    for ours, DTensor's functional collectives for torch's)."""
    with warnings.catch_warnings(), CommDebugMode() as mode:
        # Its module tracker hooks the backward of modules whose inputs need no gradient.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        v.step(x, y)
    return {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items() if n}


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def check_grads(variants: list[Variant], x: torch.Tensor, y: torch.Tensor,
                device: torch.device) -> dict:
    """One untimed step from the common initial weights, comparing every variant's whole
    gradients (after sync, before the optimizer) with the first one's: per tensor the largest
    difference over the largest reference entry, the worst tensor's. Normwise, so that it does
    not depend on entries that cancel to nearly zero (collective over tp)."""
    full = {}
    for v in variants:
        v.forward_backward(x, y)
        v.sync()
        full[v.name] = v.full_grads()
        v.update()
        v.zero_grad()
    ref = full[variants[0].name]
    if any(g.keys() != ref.keys() for g in full.values()):
        raise RuntimeError("the variants' parameters have different names")
    rel = _max_over_ranks([max(((g[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30))
                                .item() for k in ref) for g in full.values()], device)
    return {"reference": variants[0].name, "max_rel_diff": dict(zip(full, rel, strict=True)),
            "ok": max(rel) <= GRAD_RTOL, "rtol": GRAD_RTOL}


def check_params(variants: list[Variant], device: torch.device) -> dict:
    """Max abs difference of every variant's final parameters from the first one's, and whether
    every pair is allclose (collective: every rank gathers the same things in the same order)."""
    full = {v.name: v.full_params() for v in variants}
    names = list(full)
    diffs = [max((full[n][k] - full[names[0]][k]).abs().max().item() for k in full[n])
             for n in names]
    close = all(full[a].keys() == full[b].keys() and all(
        torch.allclose(full[a][k], full[b][k], rtol=RTOL, atol=ATOL) for k in full[a])
        for a, b in itertools.combinations(names, 2))
    *diffs, far = _max_over_ranks([*diffs, 0.0 if close else 1.0], device)
    return {"reference": names[0], "max_abs_diff": dict(zip(names, diffs, strict=True)),
            "allclose": far == 0.0, "rtol": RTOL, "atol": ATOL}


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> dict | None:
    device = init_rank(args, rank, world)
    cuda = device.type == "cuda"
    mesh = Mesh(ParallelDims(tp=world), rank, device.type, CommCounter())
    dmesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    cfg = config_from_preset(args.preset, max_seq_len=max(args.seq, 16))
    variants = [build_variant(n, cfg, args, mesh, dmesh, device) for n in args.variants]

    # The gradient check's step also warms every variant up; no other step sees its batch.
    x, y = batch(args, cfg.vocab_size, 0, args.warmup + args.steps + 1, device)
    grads = check_grads(variants, x, y, device)

    times: dict[str, list[float]] = {v.name: [] for v in variants}
    comm: dict[str, Counter] = {v.name: Counter() for v in variants}
    losses: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        # One batch for the whole tp group: its ranks hold slices of one model replica.
        x, y = batch(args, cfg.vocab_size, 0, step, device)
        for v in round_order(variants, step):
            # Collect the last step's garbage now, so that no step pays for another's.
            gc.collect()
            before = mesh.counter.snapshot()
            dist.barrier()
            t0 = time.perf_counter()
            loss = v.step(x, y)
            if cuda:
                torch.cuda.synchronize()  # kernels are async: the step ends when they have run
            dt = time.perf_counter() - t0
            losses[v.name] = loss.item()
            if step >= args.warmup:
                times[v.name].append(dt)
                comm[v.name] += comm_since(mesh.counter, before)

    x, y = batch(args, cfg.vocab_size, 0, args.warmup + args.steps, device)
    collectives = {}
    for v in variants:
        dist.barrier()
        collectives[v.name] = count_collectives(v, x, y)
    params = check_params(variants, device)

    # Outside the timed region: a step lasts as long as its slowest rank.
    local = torch.tensor([times[v.name] for v in variants], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    return {"times": {v.name: local[i].tolist() for i, v in enumerate(variants)},
            "comm": {n: {op: b / args.steps for op, b in c.items()} for n, c in comm.items()},
            "collectives": collectives, "loss": losses,
            "check": {"grads": grads, "params": params},
            "params": sum(p.numel() for p in build_model(cfg, args.seed, "meta").parameters())}


# ----------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON to --out and return the same dict."""
    args = parse_args(argv)
    cpu_unless_gpus(args, args.nproc)
    raw = launch(_rank_main, args)
    param_bytes = raw["params"] * 4  # fp32
    variants = {}
    for name in args.variants:
        comm = raw["comm"][name] if name.startswith("meshloom") else None
        variants[name] = {
            **summary(raw["times"][name]),
            **{f"{k}{suffix}": None for suffix in ("", "_sp") for k in
               ("ratio_to_dtensor", "paired_ratio_to_dtensor")},
            "comm": None if comm is None else {
                "bytes_per_step": sum(comm.values()), "by_op": comm,
                "over_param_bytes": sum(comm.values()) / param_bytes},
            "collectives_per_step": raw["collectives"][name],
            "final_loss": raw["loss"][name],
        }
    for base, suffix in zip(BASES, ("", "_sp"), strict=True):
        if base in variants:
            for v in variants.values():
                v[f"ratio_to_dtensor{suffix}"] = v["median_s"] / variants[base]["median_s"]
                v[f"paired_ratio_to_dtensor{suffix}"] = paired(v["times_s"],
                                                                variants[base]["times_s"])
    result = {
        "config": {"nproc": args.nproc, "tp": args.nproc, "preset": args.preset,
                   "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
                   "seq": args.seq, "variants": args.variants, "device": args.device,
                   "backend": "nccl" if args.device == "cuda" else "gloo",
                   "threads_per_rank": threads_per_rank(args.nproc), "params": raw["params"],
                   "param_bytes": param_bytes, **provenance(),
                   "fairness": FAIRNESS},
        "variants": variants,
        "comm_note": "bytes our CommCounter recorded per timed step, by op (payload as in "
                     "meshloom.comm: all-reduce tensor, all-gather output, reduce-scatter "
                     "input); DTensor's collectives bypass it, so dtensor_* report none. "
                     "collectives_per_step: calls in one extra untimed step, by op, from "
                     "torch's CommDebugMode (for every variant)",
        "check": raw["check"],
        "check_note": "grads: one untimed step from the common initial weights before the "
                      "timed ones; each variant's whole gradients after sync against the "
                      "reference's, per tensor max|diff| / max|reference|, worst tensor; the "
                      "exit status is 1 if it exceeds rtol. params: the final parameters, "
                      "reported only: AdamW turns rounding differences in gradient entries "
                      "that cancel to ~eps into O(lr) updates, and training on random tokens "
                      "amplifies them, so long runs drift apart without any error",
    }
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    c, mib = r["config"], 2**20
    print(f"{c['preset']} ({c['params'] / 1e6:.2f}M params), tp={c['tp']} x {c['backend']} on "
          f"{c['device']}, {c['threads_per_rank']} thread(s)/rank, batch {c['batch']}x"
          f"{c['seq']} (the same on every rank), {c['steps']} timed steps each after "
          f"{c['warmup']} warm-up")
    print(f"{'':15}{'median':>9}{'p10':>8}{'p90':>8}{'/dt':>8}{'/dt_sp':>8}{'comm':>8}"
          f"{'colls':>7}   (ms; comm MiB/step; collectives/step)")
    for name, v in r["variants"].items():
        ratios = "".join(f"{x:8.3f}" if x is not None else f"{'-':>8}"
                         for x in (v["ratio_to_dtensor"], v["ratio_to_dtensor_sp"]))
        comm = f"{v['comm']['bytes_per_step'] / mib:8.2f}" if v["comm"] else f"{'n/a':>8}"
        print(f"{name:15}{v['median_s'] * 1e3:9.1f}{v['p10_s'] * 1e3:8.1f}"
              f"{v['p90_s'] * 1e3:8.1f}{ratios}{comm}"
              f"{sum(v['collectives_per_step'].values()):7d}")
    print("/dt, /dt_sp = median / dtensor_tp's, dtensor_tp_sp's median (below 1: faster)")
    g, k = r["check"]["grads"], r["check"]["params"]
    diffs = ", ".join(f"{n} {d:.2g}" for n, d in g["max_rel_diff"].items())
    print(f"first-step gradients agree: {g['ok']} (max rel diff vs {g['reference']}: {diffs})")
    diffs = ", ".join(f"{n} {d:.2g}" for n, d in k["max_abs_diff"].items())
    print(f"final parameters allclose: {k['allclose']} (max abs diff vs {k['reference']}: "
          f"{diffs}; reported only, see check_note)")


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["check"]["grads"]["ok"] else 1)
