"""meshloom's pipeline schedules against torch.distributed.pipelining, interleaved in one run.

Every rank is one pipeline rank (pp = nproc, no data or tensor parallelism) and holds one copy
of its stages per variant, all cut from the same model (same seed) at the same layers, all fed
the same micro-batches. The interleaved schedules give each rank `--virtual-stages` stages
(rank r holds stages r, r + pp, ..., the same on both sides); the others one.
- meshloom_<schedule>: meshloom's `parallelize` with ParallelConfig(pp=nproc,
  pp_schedule=<schedule>, pp_virtual_stages=...): `par.pipeline.train_step` runs the schedule's
  action list;
- torch_<schedule>: torch's `PipelineStage`s (static shapes: no run-time shape inference) around
  modules that hold exactly the same layers (embedding on the first stage, final norm and head on
  the last), driven by torch's schedule of that name: `Schedule1F1B`, `ScheduleGPipe`,
  `ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble` (interleaved_zb), and for zb_h1
  the same `ScheduleInterleavedZeroBubble` over one stage per rank (torch's ZB1P; torch has no
  single-stage zero-bubble class). Their action lists are torch's own, not meshloom's: each is
  recorded and run through meshloom's simulator too, next to meshloom's lists.
Both compute the mean cross-entropy of every micro-batch; ours divides each by the micro-batch
count before its backward, torch's schedules divide the accumulated gradients by it after the last
backward (`scale_grads=True`, their default): the same gradients. Both run AdamW(foreach) with our
groups and settings. Variants take turns step by step in an order that rotates every round (and
runs backwards every other cycle). A step (forward and backward of every micro-batch by the
schedule, AdamW step, zero_grad) is timed from a barrier; its time is the slowest rank's. Every
timed step also records when each rank ran each forward and backward (ours: the runner's
`timeline`; torch's: timers around its stage's forward_one_chunk / backward_one_chunk and the
loss), with each rank's clock set to 0 at the barrier, from which the measured bubble fraction
follows, next to the simulator's prediction. Before the timed steps, one untimed step checks that
every variant computes the same gradients from the same weights (a difference would mean the
benchmark compares different computations; the exit status is then 1).

    python benchmarks/pp_vs_torch.py --nproc 2 --preset demo --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from meshloom.comm import CommCounter
from meshloom.config import ParallelConfig, TrainConfig
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.llama import Llama, LlamaConfig, build_model, config_from_preset
from meshloom.optim import build_optimizer, decay_groups
from meshloom.parallel import Parallelized, PipelineSpec, parallelize, plain_loss
from meshloom.parallel.pipeline_schedule import (
    INTERLEAVED,
    Action,
    Timeline,
    compute_lists,
    simulate,
    with_communication,
)
from meshloom.parallel.pipeline_stage import split_layers

# benchmarks/ is a folder of scripts, not a package: make its shared module importable however
# this file was loaded (as a script, or by path from a test).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    batch,
    comm_since,
    cpu_unless_gpus,
    init_rank,
    launch,
    paired,
    parse_with_variants,
    parser,
    provenance,
    round_order,
    summary,
    threads_per_rank,
    write_result,
)

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "interleaved_zb")
VARIANTS = tuple(f"{side}_{s}" for s in SCHEDULES for side in ("meshloom", "torch"))
TORCH_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                   "interleaved_1f1b": ScheduleInterleaved1F1B,
                   "zb_h1": ScheduleInterleavedZeroBubble,
                   "interleaved_zb": ScheduleInterleavedZeroBubble}
# torch's action types, as meshloom's compute kinds (its other actions are communication,
# gradient reduction or resharding, which this layout has none of).
TORCH_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
               "BACKWARD_WEIGHT": "W"}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pp_vs_torch.json"
TCFG = TrainConfig(lr=1e-3)  # AdamW: betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices
# Same weights, same micro-batches, same module code: the gradients can differ only by rounding
# (ours scales each micro-batch loss by 1/M, torch the summed gradients; exact when M is a power of
# two). Per tensor max|diff| / max|reference|, the worst tensor's: the pass mark.
GRAD_RTOL = 1e-5
FAIRNESS = ("every variant: the same model, seed, layer split (ours: split_layers by training "
            "FLOPs; torch's stage modules hold exactly those layers; the same loop placement of "
            "the interleaved stages), micro-batches, loss "
            "(plain_loss: mean cross-entropy in fp32, averaged over the micro-batches) and AdamW "
            "settings (foreach, weight decay on matrices only); torch: PipelineStage with static "
            "input/output shapes, the schedule's default scale_grads=True, "
            "return_outputs=False (ours returns no logits either), the whole batch prepared "
            "outside the timed region and split by the schedule; ours zero gradients in place, "
            "torch sets them to None (optimizer.zero_grad()); each side runs its own action "
            "lists (torch's multi-stage classes their pipeline_order, recorded under lists); "
            "fp32, no data parallelism")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, steps=20, warmup=3, out=DEFAULT_OUT)
    p.set_defaults(batch=2)  # here: sequences per micro-batch
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--virtual-stages", type=int, default=2,
                   help="stages per rank of the interleaved schedules (both sides)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="ours: seconds a pipeline receive may wait")
    args = parse_with_variants(p, argv, VARIANTS)
    if args.nproc < 2:
        p.error("pipeline parallel needs --nproc >= 2 (one stage per rank)")
    if args.microbatches < args.nproc:
        p.error(f"torch's Schedule1F1B needs --microbatches >= the stage count ({args.nproc})")
    if args.virtual_stages < 2:
        p.error("--virtual-stages must be >= 2 (with 1 the interleaved schedules are 1f1b and "
                "zb_h1, which are variants of their own)")
    if (any(schedule_of(n) in INTERLEAVED for n in args.variants)
            and args.microbatches % args.nproc):
        p.error(f"the interleaved schedules need --microbatches ({args.microbatches}) to be a "
                f"multiple of --nproc ({args.nproc})")
    rounds = max(1, args.microbatches // args.nproc)
    if "torch_zb_h1" in args.variants and args.microbatches % rounds:
        p.error(f"torch's ScheduleInterleavedZeroBubble (torch_zb_h1) needs --microbatches "
                f"({args.microbatches}) to be a multiple of its rounds, --microbatches // "
                f"--nproc = {rounds}")
    stages = args.nproc * max(chunks_of(args, n) for n in args.variants)
    layers = config_from_preset(args.preset).n_layers
    if layers < stages:
        p.error(f"{stages} pipeline stages need at least as many blocks (--preset "
                f"{args.preset} has {layers}); lower --virtual-stages or --nproc")
    if args.batch < 1:
        p.error("--batch (sequences per micro-batch) must be >= 1")
    return args


def schedule_of(name: str) -> str:
    return name.split("_", 1)[1]


def chunks_of(args: argparse.Namespace, name: str) -> int:
    """Stages per rank of this variant's schedule."""
    return args.virtual_stages if schedule_of(name) in INTERLEAVED else 1


# ----------------------------------------------------------------------------- variants


class StepData:
    """One step's micro-batches, in both forms, made before the timed region: ours takes the
    list of (x, y); torch's schedules take the whole batch and split it back along dim 0."""

    def __init__(self, args: argparse.Namespace, vocab: int, step: int, device: torch.device):
        # Micro-batch k of a step is seeded as `rank` k of _launch.batch: every pipeline rank
        # builds the same list (the first stage reads x, the last y).
        self.mbs = [batch(args, vocab, k, step, device) for k in range(args.microbatches)]
        self.x = torch.cat([x for x, _ in self.mbs])
        self.y = torch.cat([y for _, y in self.mbs])


class TorchStageModule(nn.Module):
    """What torch's PipelineStage wraps: blocks [lo, hi) of `full` under their names in the
    full model, the embedding if it is the first stage, final norm + head if the last."""

    def __init__(self, full: Llama, lo: int, hi: int):
        super().__init__()
        self.cfg = full.cfg
        first, last = lo == 0, hi == full.cfg.n_layers
        self.tok_embeddings = full.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in range(lo, hi)})
        self.norm = full.norm if last else None
        self.output = full.output if last else None
        self.register_buffer("freqs_cis", full.freqs_cis, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rope = Llama.rope(self, x.shape[1])
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h)) if self.output is not None else h


class Variant:
    """One copy of this rank's stages with its optimizer: ours (`par`) or torch's (`schedule`
    over `stages`, one module each). `timeline` holds the last step's compute spans (start_s,
    end_s, kind, stage, mb), relative to `t0` (the moment the step's barrier returned on this
    rank)."""

    def __init__(self, name: str, modules: list[nn.Module], optimizer: torch.optim.Optimizer,
                 n_micro: int, par: Parallelized | None = None, schedule=None,
                 stages: list | None = None):
        self.name, self.modules, self.optimizer, self.m = name, modules, optimizer, n_micro
        self.par, self.schedule, self.stages = par, schedule, stages or []
        self.t0 = 0.0
        self.timeline: list[tuple[float, float, str, int, int]] = []
        self.sent_bytes = 0  # torch: payload of the sends its stages issued (ours: the counter)
        for stage in self.stages:
            self._instrument_torch(stage)
        if self.stages:
            self._instrument_loss()

    @property
    def first(self) -> bool:
        """Whether this rank feeds the tokens (holds stage 0)."""
        return any(st.is_first for st in self.stages)

    # -- torch's stages, observed from outside: timers around compute, bytes of the sends

    def _instrument_torch(self, stage) -> None:
        def timed(fn, kind):
            def run(chunk, *a, **kw):
                # One method runs both a whole backward and an input-gradient pass.
                k = kind if kw.get("full_backward", True) else "I"
                start = time.perf_counter()
                try:
                    return fn(chunk, *a, **kw)
                finally:
                    self.timeline.append((start - self.t0, time.perf_counter() - self.t0, k,
                                          stage.stage_index, chunk))
            return run

        stage.forward_one_chunk = timed(stage.forward_one_chunk, "F")
        stage.backward_one_chunk = timed(stage.backward_one_chunk, "B")
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "W")
        stage.get_fwd_send_ops = self._counted(stage.get_fwd_send_ops)
        stage.get_bwd_send_ops = self._counted(stage.get_bwd_send_ops)

    def _counted(self, fn):
        def run(chunk):
            ops = fn(chunk)
            self.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size()
                                   for op in ops if op.op is dist.isend)
            return ops
        return run

    def _instrument_loss(self) -> None:
        sched = self.schedule

        def loss(fn):  # runs right after the last stage's forward: part of its F, as in ours
            def run(*a, **kw):
                try:
                    return fn(*a, **kw)
                finally:
                    s, _, kind, st, mb = self.timeline[-1]
                    if kind == "F":
                        self.timeline[-1] = (s, time.perf_counter() - self.t0, kind, st, mb)
            return run

        sched._compute_loss = loss(sched._compute_loss)

    def torch_lists(self) -> list[list[Action]] | None:
        """The compute actions torch's schedule runs, per rank, as meshloom Actions; None for
        ours and for torch's single-stage classes (they run 1F1B and GPipe as loops in code; the
        list they also describe is not what runs)."""
        if not isinstance(self.schedule, (ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)):
            return None
        order = self.schedule.pipeline_order
        return [[Action(TORCH_KINDS[a.computation_type.name], a.stage_index, a.microbatch_index)
                 for a in order[r] if a is not None and a.computation_type.name in TORCH_KINDS]
                for r in sorted(order)]

    # -- one step

    def forward_backward(self, data: StepData, device: torch.device) -> float:
        """Every micro-batch forward and backward by the schedule; this rank's loss (the mean
        of the micro-batch losses on the last stage, 0 elsewhere)."""
        if self.par is not None:
            return self.par.pipeline.train_step(data.mbs, self.par.grads, device,
                                                contextlib.nullcontext(), 1.0)
        self.timeline = []
        losses: list[torch.Tensor] = []
        args = (data.x,) if self.first else ()
        self.schedule.step(*args, target=data.y, losses=losses, return_outputs=False)
        return sum(t.item() for t in losses) / self.m if losses else 0.0

    def sync(self) -> None:
        if self.par is not None:  # nothing to reduce without data parallelism; kept as in train
            self.par.grads.finish()

    def update(self) -> None:
        self.optimizer.step()
        if self.par is not None:
            self.par.grads.after_step()

    def zero_grad(self) -> None:
        if self.par is not None:
            self.par.grads.zero_grad()
        else:
            self.optimizer.zero_grad()  # set_to_none=True

    def step(self, data: StepData, device: torch.device) -> float:
        loss = self.forward_backward(data, device)
        self.sync()
        self.update()
        self.zero_grad()
        return loss

    def spans(self) -> list[tuple[float, float, str, int, int]]:
        """The last step's compute spans, relative to this rank's barrier."""
        if self.par is not None:
            # The runner's clock starts when train_step is entered, microseconds after t0.
            return list(self.par.pipeline.timeline)
        return list(self.timeline)

    def grads(self) -> dict[str, torch.Tensor]:
        # torch's stage modules keep the full model's names (layers.<i>, ...): no two clash.
        return {n: p.grad.detach().clone() for mod in self.modules
                for n, p in mod.named_parameters()}


def stage_bounds(cfg: LlamaConfig, n_stages: int, seq: int) -> list[tuple[int, int]]:
    """The [lo, hi) blocks of every stage, as parallelize() cuts them (balanced training FLOPs,
    embedding on the first stage, the head counted on the last)."""
    if cfg.n_layers < n_stages:
        raise ValueError(f"{n_stages} pipeline stages need at least as many blocks (the preset "
                         f"has {cfg.n_layers}); lower --virtual-stages or --nproc")
    costs, head = cfg.layer_costs(seq)
    return split_layers(cfg.n_layers, n_stages, costs, head)


def build_variant(name: str, cfg: LlamaConfig, args: argparse.Namespace, mesh: Mesh,
                  device: torch.device) -> Variant:
    model = build_model(cfg, args.seed, device)
    rank, pp, m, v = mesh.rank, args.nproc, args.microbatches, chunks_of(args, name)
    n_stages = pp * v
    bounds = stage_bounds(cfg, n_stages, args.seq)
    mine = [c * pp + rank for c in range(v)]  # loop placement, as both sides place them
    if name.startswith("meshloom"):
        pcfg = ParallelConfig(pp=pp, dp_shard=1, pp_schedule=schedule_of(name),
                              pp_virtual_stages=v)
        par = parallelize(model, mesh, pcfg, pipeline=PipelineSpec(
            microbatches=m, seq_len=args.seq, timeout_s=args.timeout))
        if par.model.bounds != [bounds[i] for i in mine]:
            raise RuntimeError(f"ours cut rank {rank}'s stages at {par.model.bounds}, expected "
                               f"{[bounds[i] for i in mine]}")
        # fused=False: on CUDA build_optimizer would pick the fused kernel; torch's runs foreach.
        opt = build_optimizer(*par.grads.optim_param_groups(), TCFG, fused=False)
        return Variant(name, [par.model], opt, m, par=par)
    # Static shapes: what each stage receives and sends for one micro-batch.
    b, s = args.batch, args.seq
    hidden = torch.empty(b, s, cfg.dim, device="meta", requires_grad=True)
    modules, stages = [], []
    for i in mine:
        modules.append(TorchStageModule(model, *bounds[i]))
        inputs = torch.empty(b, s, dtype=torch.long, device="meta") if i == 0 else hidden
        outputs = (torch.empty(b, s, cfg.vocab_size, device="meta", requires_grad=True)
                   if i == n_stages - 1 else hidden)
        stages.append(PipelineStage(modules[-1], i, n_stages, device, input_args=inputs,
                                    output_args=outputs))
    del model  # the stage modules keep their layers; the rest is dropped
    cls = TORCH_SCHEDULES[schedule_of(name)]
    # The single-stage classes take a stage, the multi-stage ones a list (zb_h1: of one).
    sched = cls(stages if cls is ScheduleInterleavedZeroBubble or v > 1 else stages[0], m,
                loss_fn=plain_loss)
    decay, no_decay = decay_groups(p for mod in modules for p in mod.parameters())
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": TCFG.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=TCFG.lr, betas=(TCFG.beta1, TCFG.beta2), eps=TCFG.eps,
                            foreach=True)
    return Variant(name, modules, opt, m, schedule=sched, stages=stages)


# ----------------------------------------------------------------------------- one rank


def check_grads(variants: list[Variant], data: StepData, device: torch.device) -> dict:
    """One untimed step from the common initial weights, comparing every variant's gradients of
    the whole model (after the schedule and sync, before the optimizer; gathered from every
    rank, since the interleaved variants hold other layers per rank) with the first one's: per
    tensor the largest difference over the largest reference entry, the worst tensor's. Every
    variant then takes its optimizer step, so all go on from the same state. Also warms every
    variant up (torch's first step sets its stages up)."""
    got = {}
    for v in variants:
        dist.barrier()
        v.forward_backward(data, device)
        v.sync()
        got[v.name] = {k: t.cpu() for k, t in v.grads().items()}
        v.update()
        v.zero_grad()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, got)
    whole = {n: {k: t for part in everyone for k, t in part[n].items()} for n in got}
    ref = whole[variants[0].name]
    rel = {n: max(((g[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)).item()
                  for k in ref) if g.keys() == ref.keys() else float("inf")
           for n, g in whole.items()}
    return {"reference": variants[0].name, "max_rel_diff": rel,
            "ok": max(rel.values()) <= GRAD_RTOL, "rtol": GRAD_RTOL,
            "tensors": len(ref)}


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> dict | None:
    device = init_rank(args, rank, world)
    cuda = device.type == "cuda"
    mesh = Mesh(ParallelDims(pp=world), rank, device.type, CommCounter())
    cfg = config_from_preset(args.preset, max_seq_len=max(args.seq, 16))
    if cfg.tie_embeddings:
        raise ValueError("this benchmark cuts untied models only (the torch side would need "
                         "its own tied-table handling)")
    variants = [build_variant(n, cfg, args, mesh, device) for n in args.variants]

    # The gradient check's step also warms every variant up; no other step sees its batch.
    grads = check_grads(variants, StepData(args, cfg.vocab_size, args.warmup + args.steps,
                                           device), device)

    times: dict[str, list[float]] = {v.name: [] for v in variants}
    spans: dict[str, list[list]] = {v.name: [] for v in variants}
    clocks: list[float] = []  # when each timed step's barrier returned (this host's clock)
    comm: dict[str, Counter] = {v.name: Counter() for v in variants}
    sent_before = {}
    losses: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        data = StepData(args, cfg.vocab_size, step, device)
        timed = step >= args.warmup
        if step == args.warmup:
            sent_before = {v.name: v.sent_bytes for v in variants}
        for v in round_order(variants, step):
            # Collect the last step's garbage now, so that no step pays for another's.
            gc.collect()
            before = mesh.counter.snapshot()
            dist.barrier()
            t0 = v.t0 = time.perf_counter()
            loss = v.step(data, device)
            if cuda:
                torch.cuda.synchronize()  # kernels are async: the step ends when they have run
            dt = time.perf_counter() - t0
            losses[v.name] = loss
            if timed:
                times[v.name].append(dt)
                spans[v.name].append(v.spans())
                comm[v.name] += comm_since(mesh.counter, before)
                clocks.append(t0)

    mine = {"times": times, "spans": spans, "clocks": clocks, "loss": losses,
            "comm": {n: dict(c) for n, c in comm.items()},
            "torch_sent": {v.name: v.sent_bytes - sent_before[v.name] for v in variants
                           if v.stages}}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)  # outside the timed region
    if rank != 0:
        return None
    torch_lists = {v.name: [[tuple(a) for a in acts] for acts in lists]
                   for v in variants if (lists := v.torch_lists()) is not None}
    bounds = {v: stage_bounds(cfg, world * v, args.seq)
              for v in sorted({chunks_of(args, n) for n in args.variants})}
    return {"ranks": everyone, "bounds": bounds, "torch_lists": torch_lists,
            "check": {"grads": grads},
            "params": sum(p.numel() for p in build_model(cfg, args.seed, "meta").parameters()),
            "dim": cfg.dim}


# ----------------------------------------------------------------------------- report


def bubble_of(per_rank: list[list[tuple[float, float, str, int, int]]]) -> dict:
    """Idle fraction of one measured step, as the simulator defines it: 1 - busy / (ranks x
    makespan), the makespan from the first compute start to the last compute end on any rank."""
    tl = Timeline([[(s, e, Action(kind, st, mb)) for s, e, kind, st, mb in spans]
                   for spans in per_rank])
    return {"bubble": tl.bubble(), "makespan_s": tl.makespan,
            "busy_s": [sum(e - s for s, e, _ in r) for r in tl.spans]}


def variant_lists(name: str, pp: int, m: int, v: int,
                  torch_lists: dict[str, list]) -> tuple[list[list[Action]], str]:
    """The compute actions this variant runs, per rank, and where they come from."""
    if name in torch_lists:
        return [[Action(*a) for a in acts] for acts in torch_lists[name]], "torch's pipeline_order"
    return compute_lists(schedule_of(name), pp, m, v), (
        "meshloom's" if name.startswith("meshloom") else
        "meshloom's lists of the same schedule (torch runs it as a loop)")


def bubbles(name: str, lists: list[list[Action]], ranks: list[dict], steps: int) -> dict:
    """Measured bubble of every timed step, and the simulator's prediction for this variant's
    lists: with unit costs (F = B = I = W = 1), and with each (kind, stage) costing its median
    measured duration in this variant's timed steps."""
    pp = len(lists)
    measured = [bubble_of([r["spans"][name][i] for r in ranks]) for i in range(steps)]
    durations: dict[tuple[str, int], list[float]] = {}
    for r in ranks:
        for step in r["spans"][name]:
            for s, e, kind, st, _ in step:
                durations.setdefault((kind, st), []).append(e - s)
    cost = {k: statistics.median(d) for k, d in durations.items()}
    return {"measured_median": statistics.median(s["bubble"] for s in measured),
            "measured_per_step": [s["bubble"] for s in measured],
            "predicted_unit_cost": simulate(lists).bubble(),
            "predicted_measured_costs":
                simulate(lists, lambda a: cost[(a.kind, a.stage)]).bubble(),
            "makespan_median_s": statistics.median(s["makespan_s"] for s in measured),
            "busy_median_s": [statistics.median(s["busy_s"][r] for s in measured)
                              for r in range(pp)],
            "compute_median_s": {f"{k}{st}": c for (k, st), c in sorted(cost.items())}}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON to --out and return the same dict."""
    args = parse_args(argv)
    cpu_unless_gpus(args, args.nproc)
    raw = launch(_rank_main, args)
    ranks, pp, m = raw["ranks"], args.nproc, args.microbatches
    # Each step's time is its slowest rank's.
    times = {n: [max(r["times"][n][i] for r in ranks) for i in range(args.steps)]
             for n in args.variants}
    boundary_bytes = args.batch * args.seq * raw["dim"] * 4  # fp32
    variants = {}
    for name in args.variants:
        v = chunks_of(args, name)
        # Activations forward and their gradients backward, over each of the pp x v - 1 stage
        # boundaries (consecutive stages sit on different ranks).
        expected = 2 * (pp * v - 1) * m * boundary_bytes
        compute, source = variant_lists(name, pp, m, v, raw["torch_lists"])
        if name.startswith("meshloom"):
            by_op = Counter()
            for r in ranks:
                by_op.update(r["comm"][name])
            comm = {"bytes_per_step": sum(by_op.values()) / args.steps,
                    "by_op": {op: b / args.steps for op, b in by_op.items()},
                    "by_rank": [sum(r["comm"][name].values()) / args.steps for r in ranks],
                    "source": "our CommCounter"}
        else:
            sent = [r["torch_sent"][name] / args.steps for r in ranks]
            comm = {"bytes_per_step": sum(sent), "by_op": {"send": sum(sent)},
                    "by_rank": sent, "source": "the isend ops of its stage's send lists"}
        comm["expected_bytes_per_step"] = expected
        base = f"torch_{schedule_of(name)}"
        ours = compute_lists(schedule_of(name), pp, m, v)
        variants[name] = {
            "schedule": schedule_of(name),
            "virtual_stages": v,
            **summary(times[name]),
            "torch_baseline": base,
            "ratio_to_torch": None, "paired_ratio_to_torch": None,
            "lists": {"source": source, "same_as_meshloom": compute == ours,
                      "compute": [" ".join(map(str, acts)) for acts in compute]},
            "bubble": bubbles(name, with_communication(compute, pp, pp * v), ranks, args.steps),
            "comm": comm,
            "final_loss": sum(r["loss"][name] for r in ranks),  # only the last stage's is > 0
        }
    for v in variants.values():
        base = variants.get(v["torch_baseline"])
        if base is not None:
            v["ratio_to_torch"] = v["median_s"] / base["median_s"]
            v["paired_ratio_to_torch"] = paired(v["times_s"], base["times_s"])
    skew = [max(c) - min(c) for c in zip(*(r["clocks"] for r in ranks), strict=True)]
    result = {
        "config": {"nproc": args.nproc, "pp": pp, "preset": args.preset, "steps": args.steps,
                   "warmup": args.warmup, "microbatches": m, "batch": args.batch,
                   "seq": args.seq, "variants": args.variants, "device": args.device,
                   "backend": "nccl" if args.device == "cuda" else "gloo",
                   "threads_per_rank": threads_per_rank(args.nproc), "params": raw["params"],
                   "param_bytes": raw["params"] * 4,
                   "virtual_stages": args.virtual_stages,
                   "stage_layers": {str(v): [list(b) for b in bounds]
                                    for v, bounds in raw["bounds"].items()},
                   **provenance(), "fairness": FAIRNESS},
        "variants": variants,
        "bubble_note": "bubble = 1 - busy / (ranks x makespan) of one timed step, busy = the "
                       "sum of the forward (with the loss on the last stage) and backward spans "
                       "on every rank, makespan = first compute start to last compute end on any "
                       "rank, each rank's clock set to 0 when the step's barrier returned there "
                       "(ours: when train_step was entered, microseconds later); "
                       "measured_median over the timed steps. predicted_unit_cost: "
                       "pipeline_schedule.simulate of the variant's lists (lists.source: ours, "
                       "or torch's pipeline_order for its multi-stage classes) on F = B = I = W "
                       "= 1; predicted_measured_costs: the "
                       "same lists with each (kind, stage) costing its median measured duration "
                       "(what the schedule alone would leave idle, without waiting on messages "
                       "or Python overheads between actions)",
        "clock_skew_s": {"median": statistics.median(skew), "max": max(skew),
                         "note": "spread of the ranks' barrier return times on this host's "
                                 "monotonic clock (one host only): the error of the alignment"},
        "comm_note": "bytes a step sends between stages, summed over ranks: ours from our "
                     "CommCounter (every SEND_F / SEND_B, counted as its payload), torch's from "
                     "the isend ops its stages return for the schedule to fire; expected = 2 x "
                     "(pp x virtual stages - 1) x micro-batches x batch x seq x dim x 4 (fp32 "
                     "activations forward, their gradients backward)",
        "check": raw["check"],
        "check_note": "grads: one untimed step from the common initial weights before the "
                      "timed ones; each variant's gradients of the whole model (gathered from "
                      "every rank) after the schedule against the reference's, per tensor "
                      "max|diff| / max|reference|, worst tensor; the exit status is 1 if it "
                      "exceeds rtol",
    }
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    c, kib = r["config"], 2**10
    print(f"{c['preset']} ({c['params'] / 1e6:.2f}M params), pp={c['pp']} x {c['backend']} on "
          f"{c['device']}, {c['threads_per_rank']} thread(s)/rank, layers per stage "
          f"{c['stage_layers']}, {c['microbatches']} micro-batches of {c['batch']}x{c['seq']}, "
          f"{c['steps']} timed steps each after {c['warmup']} warm-up")
    print(f"{'':24}{'median':>9}{'p10':>8}{'p90':>8}{'/torch':>8}{'paired':>8}{'bubble':>8}"
          f"{'sim1':>7}{'simM':>7}{'comm':>8}   (ms; bubble fractions; comm KiB/step)")
    for name, v in r["variants"].items():
        ratios = "".join(f"{x:8.3f}" if x is not None else f"{'-':>8}"
                         for x in (v["ratio_to_torch"], v["paired_ratio_to_torch"]))
        b = v["bubble"]
        print(f"{name:24}{v['median_s'] * 1e3:9.1f}{v['p10_s'] * 1e3:8.1f}"
              f"{v['p90_s'] * 1e3:8.1f}{ratios}{b['measured_median']:8.3f}"
              f"{b['predicted_unit_cost']:7.3f}{b['predicted_measured_costs']:7.3f}"
              f"{v['comm']['bytes_per_step'] / kib:8.0f}")
    print("/torch, paired = median / torch's median of the same schedule, median of the "
          "step-by-step ratios (below 1: ours faster); bubble: measured median; sim1, simM: "
          "simulator with unit costs, with the measured costs")
    print(f"clock alignment error (median barrier spread): "
          f"{r['clock_skew_s']['median'] * 1e6:.0f} us")
    g = r["check"]["grads"]
    diffs = ", ".join(f"{n} {d:.2g}" for n, d in g["max_rel_diff"].items())
    print(f"first-step gradients agree: {g['ok']} (max rel diff vs {g['reference']}: {diffs})")


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["check"]["grads"]["ok"] else 1)
