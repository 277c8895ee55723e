"""Evaluate one layout, or search all valid layouts and rank them by predicted step time.

The search enumerates every layout the training code accepts for this model and cluster (TP
that divides the heads and stays inside a node, CP with the zigzag split, PP up to one layer per
stage, DDP and ZeRO-1/2/3 (HSDP when `dp_replicate` is pinned), micro-batch size, recompute
mode and pipeline schedule, and for a mixture-of-experts model expert parallel `ep` (each divisor
of dp_shard x cp that divides the experts; a dense model is only ever planned at ep = 1);
"accepts" is asked of the training code's own rules, the ones
`meshloom train` checks before launch), keeps what `--fix` pins, and ranks in two passes: all
candidates with the closed-form bubble, then the fastest few again with the pipeline simulator,
whose numbers are the ones reported.
"""

from __future__ import annotations

import functools
import gc
import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from meshloom.config import (
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from meshloom.mesh import ParallelDims
from meshloom.models.llama import LlamaConfig
from meshloom.parallel.pipeline_schedule import INTERLEAVED, SCHEDULES
from meshloom.plan import PlanError
from meshloom.plan.compute import block_cost, rates_for
from meshloom.plan.hardware import Cluster
from meshloom.plan.implementation import MESHLOOM, Implementation, split_fix
from meshloom.plan.layout import RECOMPUTE, Layout
from meshloom.plan.memory import Memory, act_elem_bytes, memory_per_gpu, rank_param_split
from meshloom.plan.models import ModelShape
from meshloom.plan.moe import expert_tp
from meshloom.plan.moe import summary as moe_summary
from meshloom.plan.stages import rank_layers, stage_layers
from meshloom.plan.timing import Timing, step_time
from meshloom.validation import layout_problem

MAX_MICRO_BATCH = 16
MAX_CP = 16
EXACT_PASS = 8  # candidates re-ranked with the pipeline simulator


@dataclass
class Candidate:
    layout: Layout
    memory: Memory
    timing: Timing
    gpu_memory: float
    n_gpus: int
    peak_flops: float
    tokens: int  # per step
    moe: dict | None = None  # a mixture-of-experts model's figures (plan/moe.py summary)
    impl: Implementation = MESHLOOM  # how the code runs it (the search may pick per layout)

    @property
    def held(self) -> bool:
        """Whether ZeRO-3 runs without resharding after forward (`reshard_after_forward`
        off), which the search tries for meshloom beside the resharding default."""
        return self.layout.zero == 3 and not self.impl.reshard_after_forward

    @property
    def reduce_once(self) -> bool:
        """Whether ZeRO-3 sums whole gradients over the micro-batches and reduce-scatters them
        once (`fsdp_no_sync`, meshloom's `parallel.reduce_once`), which the search also tries
        for meshloom."""
        return self.layout.zero == 3 and self.impl.fsdp_no_sync

    def short(self) -> str:
        """The layout's one-line summary, with `no-reshard` where ZeRO-3 holds its units and
        `reduce-once` where it sums whole gradients."""
        return (self.layout.short() + (" no-reshard" if self.held else "")
                + (" reduce-once" if self.reduce_once else ""))

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu_memory

    @property
    def tflops_per_gpu(self) -> float:
        return self.timing.model_flops / self.n_gpus / self.timing.step_time_s / 1e12

    @property
    def hw_tflops_per_gpu(self) -> float:
        return self.timing.hw_flops / self.n_gpus / self.timing.step_time_s / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.peak_flops

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.timing.step_time_s / self.n_gpus

    def to_dict(self) -> dict:
        t = self.timing
        return {
            "layout": self.layout.to_dict(), "summary": self.short(), "fits": self.fits,
            "memory_per_gpu_bytes": self.memory.to_dict(), "gpu_memory_bytes": self.gpu_memory,
            "step_time_s": t.step_time_s, "tflops_per_gpu": self.tflops_per_gpu,
            "hw_tflops_per_gpu": self.hw_tflops_per_gpu, "mfu": self.mfu,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "time_breakdown_s": t.breakdown(), "bubble_fraction": t.bubble_fraction,
            "time_detail_s": t.detail,
        } | ({"moe": self.moe} if self.moe is not None else {})


def check_layout(shape: ModelShape, lay: Layout, cluster: Cluster, seq: int,
                 global_batch: int) -> str | None:
    """Why this layout cannot run (one line), or None: first what only the planner asks (every
    GPU used, the batch a whole number of micro-batches), then the training code's own rules
    (meshloom.validation.layout_problem), on the config --write-config would write."""
    if lay.gpus != cluster.n_gpus:
        return (f"tp x pp x dp x cp = {lay.tp} x {lay.pp} x {lay.dp} x {lay.cp} = {lay.gpus}, "
                f"not --gpus {cluster.n_gpus}")
    if lay.dp % lay.dp_replicate:
        return f"dp_replicate={lay.dp_replicate} does not divide dp={lay.dp}"
    if global_batch % (lay.dp * lay.micro_batch):
        return (f"--global-batch {global_batch} is not a multiple of dp x micro_batch = "
                f"{lay.dp} x {lay.micro_batch}")
    if lay.pp == 1 and lay.v != 1:
        return "v (virtual stages) needs pp > 1"
    why = _ep_problem(shape, lay)
    if why:
        return why
    dims = _dims(lay.pp, lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp, lay.ep)
    return layout_problem(_as_config(lay, seq, global_batch), dims, _model(shape))


def _ep_problem(shape: ModelShape, lay: Layout) -> str | None:
    """Expert parallel's own rules (parallel.ep, mesh.ParallelDims.resolve): experts to split,
    and ep dividing both dp_shard x cp and the experts."""
    if lay.ep < 1:
        return f"ep={lay.ep} must be at least 1"
    if lay.ep == 1:
        return None
    if not shape.is_moe:
        return f"ep={lay.ep} needs a mixture-of-experts model; {shape.name} is dense"
    if (lay.dp_shard * lay.cp) % lay.ep:
        return (f"ep={lay.ep} does not divide dp_shard x cp = {lay.dp_shard} x {lay.cp} "
                "(expert-parallel ranks are taken from the data and context ranks)")
    if shape.n_experts % lay.ep:
        return f"ep={lay.ep} does not divide the {shape.n_experts} experts"
    return None


def _expert_tp_problem(shape: ModelShape, lay: Layout, impl: Implementation) -> str | None:
    """Experts split over tp (impl.expert_tp) need sequence parallel, as Megatron-Core asks."""
    if impl.expert_tp and shape.is_moe and lay.tp > 1 and not lay.sp:
        return ("expert_tp splits the experts over tp, which Megatron-Core runs only with "
                "sequence parallel: add sp=true")
    return None


def _as_config(lay: Layout, seq: int, global_batch: int) -> Config:
    """The keys of a training config that the layout rules read (as layout.config_toml writes
    them). The sections are cached and shared between candidates (the rules only read them):
    a search asks about tens of thousands of layouts."""
    parallel = _parallel_config(lay.dp_replicate, lay.dp_shard, lay.zero, lay.tp, lay.sp, lay.pp,
                                lay.schedule, lay.v, lay.cp, lay.ep)
    return Config(model=_SHARED_MODEL, data=_data_config(seq), run=_SHARED_RUN,
                  train=_train_config(global_batch, lay.micro_batch), parallel=parallel)


_SHARED_MODEL, _SHARED_RUN = ModelConfig(), RunConfig()


@functools.lru_cache(maxsize=4096)
def _parallel_config(dp_replicate: int, dp_shard: int, zero: int, tp: int, sp: bool, pp: int,
                     schedule: str, v: int, cp: int, ep: int = 1) -> ParallelConfig:
    return ParallelConfig(dp_replicate=dp_replicate, dp_shard=dp_shard, zero_stage=zero, tp=tp,
                          sequence_parallel=sp, pp=pp, pp_schedule=schedule,
                          pp_virtual_stages=v, cp=cp, ep=ep)


@functools.lru_cache(maxsize=64)
def _data_config(seq: int) -> DataConfig:
    return DataConfig(seq_len=seq)


@functools.lru_cache(maxsize=256)
def _train_config(global_batch: int, micro_batch: int) -> TrainConfig:
    return TrainConfig(global_batch=global_batch, micro_batch=micro_batch)


@functools.lru_cache(maxsize=1024)
def _dims(pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, ep: int = 1
          ) -> ParallelDims:
    return ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)


@functools.lru_cache(maxsize=16)
def _model(shape: ModelShape) -> LlamaConfig:
    """The shape as the rules read it (a GPT shape too: they only look at its sizes)."""
    experts = dict(n_experts=shape.n_experts, top_k=shape.top_k, moe_hidden=shape.moe_hidden,
                   shared_hidden=shape.shared_hidden,
                   shared_gate=shape.shared_gate, aux_loss_coef=shape.aux_loss_coef,
                   capacity_factor=shape.capacity_factor) if shape.is_moe else {}
    return LlamaConfig(dim=shape.hidden, n_layers=shape.layers, n_heads=shape.heads,
                       n_kv_heads=shape.kv_heads, ffn_hidden=shape.ffn_hidden,
                       vocab_size=shape.vocab, tie_embeddings=shape.tied,
                       sliding_window=shape.sliding_window,  # its layout_problem reads it
                       **experts)


def evaluate(shape: ModelShape, lay: Layout, cluster: Cluster, seq: int, global_batch: int,
             dtype: str = "bf16", flash: bool = True, exact: bool = True,
             memory: Memory | None = None, impl: Implementation = MESHLOOM) -> Candidate:
    why = (check_layout(shape, lay, cluster, seq, global_batch)
           or _expert_tp_problem(shape, lay, impl) or _float8_problem(shape, lay, impl, dtype))
    if why:
        raise PlanError(f"layout {lay.short()}: {why}")
    mem = memory or memory_per_gpu(shape, lay, seq, global_batch, dtype, flash, impl)
    tim = step_time(shape, lay, cluster, seq, global_batch, dtype, flash, exact_bubble=exact,
                    impl=impl)
    moe = None
    if shape.is_moe:
        held = rank_layers(stage_layers(shape, lay.pp, lay.v, seq, impl.pp_split), lay.pp)
        dense, experts = rank_param_split(shape, lay, lay.pp - 1, held[-1],
                                          expert_tp(lay, impl), impl)
        moe = moe_summary(shape, lay, cluster, seq, lay.microbatches(global_batch),
                          act_elem_bytes(dtype), dense, experts,
                          tim.detail["comm_s"]["ep"].get("ops", {}).get("all_to_all", 0.0),
                          impl)
    return Candidate(lay, mem, tim, cluster.gpu.memory_gb * 1e9, cluster.n_gpus,
                     cluster.gpu.peak_tflops * 1e12, global_batch * seq, moe, impl)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def layouts(shape: ModelShape, cluster: Cluster, seq: int, global_batch: int,
            fixed: dict) -> Iterator[Layout]:
    """Every valid layout that agrees with `fixed`."""
    n = cluster.n_gpus

    def opts(key: str, values: list) -> list:
        return [fixed[key]] if key in fixed else values

    for tp in opts("tp", _powers(cluster.gpus_per_node)):
        for cp in opts("cp", _powers(MAX_CP)):
            if n % (tp * cp):
                continue
            for pp in opts("pp", _divisors(n // (tp * cp))):
                if n % (tp * cp * pp):
                    continue
                dp = n // (tp * cp * pp)
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                for rep in opts("dp_replicate", [1]):
                    yield from _rest(shape, cluster, seq, global_batch, fixed, opts,
                                     Layout(tp=tp, pp=pp, dp=dp, cp=cp, dp_replicate=rep))


def _rest(shape, cluster, seq, global_batch, fixed, opts, base: Layout) -> Iterator[Layout]:
    if global_batch % base.dp:
        return
    local = global_batch // base.dp
    mbs = opts("micro_batch", [d for d in _divisors(local) if d <= MAX_MICRO_BATCH])
    zeros = opts("zero", [0, 1, 2, 3] if base.dp_shard > 1 else [0])
    sps = opts("sp", [False, True] if base.tp > 1 else [False])
    # Expert parallel only for a model with experts (a dense one keeps its layouts exactly);
    # a pinned ep on a dense model reaches check_layout, which names the problem.
    eps = opts("ep", [d for d in _divisors(base.dp_shard * base.cp) if shape.n_experts % d == 0]
               if shape.is_moe else [1])
    if base.pp == 1:
        scheds = [(fixed.get("schedule", "1f1b"), 1)]
    else:
        scheds = []
        for sched in opts("schedule", list(SCHEDULES)):
            vs = ([d for d in _divisors(shape.layers // base.pp) if d > 1]
                  if sched in INTERLEAVED and shape.layers % base.pp == 0 else [1])
            if sched == "interleaved_zb" and vs == [1] and "schedule" not in fixed:
                continue  # with one chunk a rank it runs zb_h1's lists, searched already
            scheds += [(sched, v) for v in opts("v", vs)]
    for mb in mbs:
        for zero in zeros:
            for rec in opts("recompute", list(RECOMPUTE)):
                for sched, v in scheds:
                    for sp in sps:
                        for ep in eps:
                            lay = replace(base, micro_batch=mb, zero=zero, recompute=rec,
                                          schedule=sched, v=v, sp=sp, ep=ep)
                            if check_layout(shape, lay, cluster, seq, global_batch) is None:
                                yield lay


def search(shape: ModelShape, cluster: Cluster, seq: int, global_batch: int, fixed: dict,
           dtype: str = "bf16", flash: bool = True, top: int = 10,
           refuses: Callable[[Layout], str | None] | None = None,
           try_held: bool = False, try_once: bool = False) -> list[Candidate]:
    """The `top` fastest layouts that fit (the least memory-hungry ones if none fits). The
    implementation keys of `fixed` (plan/implementation.py) say how the code runs them;
    `refuses`, if given, names why a layout is out (the layouts a trainer cannot run,
    plan/trainers.py) and the search skips those. `try_held`: each ZeRO-3 layout is also
    tried without resharding after forward (every unit held for the step: more memory, fewer
    gathers), and whichever of the two fits and is faster stands for the layout; `meshloom
    plan` asks for it unless the user pins `reshard_after_forward`. `try_once` likewise tries
    each ZeRO-3 layout with more than one micro-batch summing whole gradients and reducing
    them once (`fsdp_no_sync`: more memory, one reduce-scatter a step), unless pinned."""
    if global_batch < 1 or seq < 1:
        raise PlanError("--seq and --global-batch must be positive")
    fixed, impl = split_fix(fixed)
    alts = [replace(impl, reshard_after_forward=False)] if try_held else []
    if try_once:
        alts += [replace(a, fsdp_no_sync=True) for a in (impl, *alts)]
    with _collector_paused():
        return _search(shape, cluster, seq, global_batch, fixed, impl, dtype, flash, top,
                       refuses, alts)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """A search allocates millions of small objects (layouts, schedule actions) and keeps none
    in reference cycles; the cyclic collector's passes over them took 40% of a large search.
    Whatever cycles there are wait for the next collection after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _float8_problem(shape: ModelShape, lay: Layout, impl: Implementation,
                    dtype: str) -> str | None:
    """What `float8` is not priced for (implementation.py): bf16 training of dense blocks."""
    if impl.float8 == "none":
        return None
    if dtype != "bf16":
        return f"float8={impl.float8} trains in bf16 around its fp8 GEMMs: use --dtype bf16"
    if shape.is_moe:
        return f"float8={impl.float8} is priced for dense blocks; {shape.name} has experts"
    return None


def _search(shape: ModelShape, cluster: Cluster, seq: int, global_batch: int, fixed: dict,
            impl: Implementation, dtype: str, flash: bool, top: int,
            refuses: Callable[[Layout], str | None] | None = None,
            alts: list[Implementation] | None = None) -> list[Candidate]:
    fitting: list[Candidate] = []
    budget = cluster.gpu.memory_gb * 1e9
    smallest: list[tuple[float, Layout]] = []
    count = 0
    skipped = None
    refused = None
    keep = max(top, EXACT_PASS)  # how many of the first pass's fastest the second re-ranks
    fastest: list[float] = []  # their first-pass step times, negated (a max-heap)
    floor = _ComputeFloor(shape, cluster, seq, global_batch, dtype, flash)
    for lay in layouts(shape, cluster, seq, global_batch, fixed):
        why = refuses(lay) if refuses else None
        if why:
            refused = why
            continue
        skipped = _expert_tp_problem(shape, lay, impl) or _float8_problem(shape, lay, impl,
                                                                          dtype)
        if skipped:
            continue
        count += 1
        # A layout whose blocks alone take longer than the keep-th fastest step so far cannot
        # be among the fastest: neither its memory nor its step is worked out.
        if len(fastest) == keep and floor(lay, impl) > -fastest[0] * (1 + FLOOR_MARGIN):
            continue
        mem = memory_per_gpu(shape, lay, seq, global_batch, dtype, flash, impl)
        if mem.total > budget:
            smallest.append((mem.total, lay))
            continue
        best = evaluate(shape, lay, cluster, seq, global_batch, dtype, flash, exact=False,
                        memory=mem, impl=impl)
        # The alternatives need more memory than the plain ZeRO-3: only if that fits. Summing
        # once changes nothing with one micro-batch a step.
        for other in (alts or []) if lay.zero == 3 else []:
            if other.fsdp_no_sync and lay.microbatches(global_batch) < 2:
                continue
            mem = memory_per_gpu(shape, lay, seq, global_batch, dtype, flash, other)
            if mem.total <= budget:
                alt = evaluate(shape, lay, cluster, seq, global_batch, dtype, flash,
                               exact=False, memory=mem, impl=other)
                if alt.timing.step_time_s < best.timing.step_time_s * (1 - ALT_MARGIN):
                    best = alt
        fitting.append(best)
        heapq.heappush(fastest, -best.timing.step_time_s)
        if len(fastest) > keep:
            heapq.heappop(fastest)
    if not count:
        if refused:
            raise PlanError(f"no layout{' with --fix ' + _fmt(fixed) if fixed else ''} that "
                            f"the trainer runs: {refused}")
        if skipped:
            raise PlanError(f"no valid layout{' with --fix ' + _fmt(fixed) if fixed else ''}: "
                            f"{skipped}")
        raise PlanError(_no_layout(shape, cluster, seq, global_batch, fixed))
    if not fitting:
        smallest.sort(key=lambda x: x[0])
        return [evaluate(shape, lay, cluster, seq, global_batch, dtype, flash, impl=impl)
                for _, lay in smallest[:top]]
    fitting.sort(key=lambda c: c.timing.step_time_s)
    head = [evaluate(shape, c.layout, cluster, seq, global_batch, dtype, flash,
                     memory=c.memory, impl=c.impl) for c in fitting[:keep]]
    head.sort(key=lambda c: c.timing.step_time_s)
    return head[:top]


# An alternative ZeRO-3 mode (held units, whole gradients summed once) spends memory; it stands
# for its layout only when planned this much faster than the plain one. A smaller difference is
# below the planner's resolution: its mean error on meshloom's own runs is 1.1% (accuracy.json).
ALT_MARGIN = 0.01
# Rounding room for the floor's test: it sums the block's seconds in another order than
# step_time does, so it may come out a few units in the last place above a step it bounds.
FLOOR_MARGIN = 1e-9
# The Layout fields `compute.block_cost` reads (tests/test_plan_search_floor.py holds it to
# them): layouts alike in these share one block's cost.
BLOCK_FIELDS = ("tp", "cp", "ep", "micro_batch", "recompute", "sp", "zero")


class _ComputeFloor:
    """A lower bound on a layout's first-pass step time (`step_time`, exact_bubble off): the
    micro-batches times the most blocks a pipeline rank holds times one block's forward and
    backward compute, without any communication, bubble, ends or optimizer. Every term the
    step adds to it is non-negative, so a layout whose floor exceeds the keep-th fastest step
    found so far is not among the fastest. The block's cost is worked out once per
    `BLOCK_FIELDS` values. It does not depend on how ZeRO-3 reshards (`block_cost` never reads
    `reshard_after_forward`), so it bounds the held variant the search also tries."""

    def __init__(self, shape: ModelShape, cluster: Cluster, seq: int, global_batch: int,
                 dtype: str, flash: bool):
        self.shape, self.seq, self.global_batch, self.flash = shape, seq, global_batch, flash
        self.rates, self.e = rates_for(cluster), act_elem_bytes(dtype)
        self._blocks: dict[tuple, float] = {}

    def __call__(self, lay: Layout, impl: Implementation) -> float:
        key = (*(getattr(lay, f) for f in BLOCK_FIELDS), impl)
        block = self._blocks.get(key)
        if block is None:
            blk = block_cost(self.shape, lay, self.rates, self.seq, self.e, self.flash, impl)
            block = self._blocks[key] = blk.fwd.total + blk.bwd.total
        stages = stage_layers(self.shape, lay.pp, lay.v, self.seq, impl.pp_split)
        return lay.microbatches(self.global_batch) * max(rank_layers(stages, lay.pp)) * block


def _no_layout(shape: ModelShape, cluster: Cluster, seq: int, global_batch: int,
               fixed: dict) -> str:
    """Name the reason when nothing matches: the pinned layout's own check if it is complete."""
    try_lay = Layout(**{k: v for k, v in fixed.items()})
    if "dp" not in fixed:
        rest = fixed.get("tp", 1) * fixed.get("pp", 1) * fixed.get("cp", 1)
        if cluster.n_gpus % rest:
            return (f"--fix pins tp x pp x cp = {rest}, which does not divide --gpus "
                    f"{cluster.n_gpus}")
        try_lay = replace(try_lay, dp=cluster.n_gpus // rest)
    why = check_layout(shape, try_lay, cluster, seq, global_batch)
    return f"no valid layout{' with --fix ' + _fmt(fixed) if fixed else ''}: " + (
        why or "try pinning fewer keys")


def _fmt(fixed: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in fixed.items())
