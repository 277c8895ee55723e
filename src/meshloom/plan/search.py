"""Evaluate one layout, or search all valid layouts and rank them by predicted step time.

The search enumerates every layout the training code accepts for this model and cluster (TP
that divides the heads and stays inside a node, CP with the zigzag split, PP up to one layer per
stage, DDP and ZeRO-1/2/3 (HSDP when `dp_replicate` is pinned), micro-batch size, recompute
mode and pipeline schedule),
keeps what `--fix` pins, and ranks in two passes: all candidates with the closed-form bubble,
then the fastest few again with the pipeline simulator, whose numbers are the ones reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from meshloom.parallel.pipeline_schedule import SCHEDULES
from meshloom.plan import PlanError
from meshloom.plan.hardware import Cluster
from meshloom.plan.layout import RECOMPUTE, Layout
from meshloom.plan.memory import Memory, memory_per_gpu
from meshloom.plan.models import ModelShape
from meshloom.plan.timing import Timing, step_time

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
            "layout": self.layout.to_dict(), "summary": self.layout.short(), "fits": self.fits,
            "memory_per_gpu_bytes": self.memory.to_dict(), "gpu_memory_bytes": self.gpu_memory,
            "step_time_s": t.step_time_s, "tflops_per_gpu": self.tflops_per_gpu,
            "hw_tflops_per_gpu": self.hw_tflops_per_gpu, "mfu": self.mfu,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "time_breakdown_s": t.breakdown(), "bubble_fraction": t.bubble_fraction,
        }


def check_layout(shape: ModelShape, lay: Layout, cluster: Cluster, seq: int,
                 global_batch: int) -> str | None:
    """Why this layout cannot run (one line), or None."""
    if lay.gpus != cluster.n_gpus:
        return (f"tp x pp x dp x cp = {lay.tp} x {lay.pp} x {lay.dp} x {lay.cp} = {lay.gpus}, "
                f"not --gpus {cluster.n_gpus}")
    for name, n in (("heads", shape.heads), ("kv_heads", shape.kv_heads),
                    ("ffn_hidden", shape.ffn_hidden)):
        if n % lay.tp:
            return f"tp={lay.tp} does not divide the model's {name}={n}"
    if lay.cp > 1 and seq % (2 * lay.cp):
        return f"cp={lay.cp} needs --seq divisible by 2 x cp (zigzag split); seq={seq}"
    if lay.pp > shape.layers:
        return f"pp={lay.pp} is more stages than the model's {shape.layers} layers"
    if lay.dp % lay.dp_replicate:
        return f"dp_replicate={lay.dp_replicate} does not divide dp={lay.dp}"
    if global_batch % (lay.dp * lay.micro_batch):
        return (f"--global-batch {global_batch} is not a multiple of dp x micro_batch = "
                f"{lay.dp} x {lay.micro_batch}")
    if lay.zero and lay.dp_shard == 1:
        return f"zero={lay.zero} needs more than one data-parallel shard (dp / dp_replicate)"
    if lay.sp and lay.tp == 1:
        return "sp (sequence parallel) needs tp > 1"
    if lay.pp > 1:
        m = lay.microbatches(global_batch)
        if lay.schedule == "interleaved_1f1b":
            if m % lay.pp:
                return f"interleaved_1f1b needs the micro-batch count ({m}) to be a multiple of pp"
            if lay.v * lay.pp > shape.layers:
                return f"pp x v = {lay.pp * lay.v} stages exceed the model's {shape.layers} layers"
        elif lay.v != 1:
            return f"v={lay.v} (virtual stages) needs schedule=interleaved_1f1b"
    elif lay.v != 1:
        return "v (virtual stages) needs pp > 1"
    return None


def evaluate(shape: ModelShape, lay: Layout, cluster: Cluster, seq: int, global_batch: int,
             dtype: str = "bf16", flash: bool = True, exact: bool = True,
             memory: Memory | None = None) -> Candidate:
    why = check_layout(shape, lay, cluster, seq, global_batch)
    if why:
        raise PlanError(f"layout {lay.short()}: {why}")
    mem = memory or memory_per_gpu(shape, lay, seq, global_batch, dtype, flash)
    tim = step_time(shape, lay, cluster, seq, global_batch, dtype, flash, exact_bubble=exact)
    return Candidate(lay, mem, tim, cluster.gpu.memory_gb * 1e9, cluster.n_gpus,
                     cluster.gpu.peak_tflops * 1e12, global_batch * seq)


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
    if base.pp == 1:
        scheds = [(fixed.get("schedule", "1f1b"), 1)]
    else:
        scheds = []
        for sched in opts("schedule", list(SCHEDULES)):
            vs = ([d for d in _divisors(shape.layers // base.pp) if d > 1]
                  if sched == "interleaved_1f1b" and shape.layers % base.pp == 0 else [1])
            scheds += [(sched, v) for v in opts("v", vs)]
    for mb in mbs:
        for zero in zeros:
            for rec in opts("recompute", list(RECOMPUTE)):
                for sched, v in scheds:
                    for sp in sps:
                        lay = replace(base, micro_batch=mb, zero=zero, recompute=rec,
                                      schedule=sched, v=v, sp=sp)
                        if check_layout(shape, lay, cluster, seq, global_batch) is None:
                            yield lay


def search(shape: ModelShape, cluster: Cluster, seq: int, global_batch: int, fixed: dict,
           dtype: str = "bf16", flash: bool = True, top: int = 10) -> list[Candidate]:
    """The `top` fastest layouts that fit (the least memory-hungry ones if none fits)."""
    if global_batch < 1 or seq < 1:
        raise PlanError("--seq and --global-batch must be positive")
    fitting: list[Candidate] = []
    smallest: list[tuple[float, Layout]] = []
    count = 0
    for lay in layouts(shape, cluster, seq, global_batch, fixed):
        count += 1
        mem = memory_per_gpu(shape, lay, seq, global_batch, dtype, flash)
        if mem.total > cluster.gpu.memory_gb * 1e9:
            smallest.append((mem.total, lay))
            continue
        fitting.append(evaluate(shape, lay, cluster, seq, global_batch, dtype, flash,
                                exact=False, memory=mem))
    if not count:
        raise PlanError(_no_layout(shape, cluster, seq, global_batch, fixed))
    if not fitting:
        smallest.sort(key=lambda x: x[0])
        return [evaluate(shape, lay, cluster, seq, global_batch, dtype, flash)
                for _, lay in smallest[:top]]
    fitting.sort(key=lambda c: c.timing.step_time_s)
    head = [evaluate(shape, c.layout, cluster, seq, global_batch, dtype, flash,
                     memory=c.memory) for c in fitting[:max(top, EXACT_PASS)]]
    head.sort(key=lambda c: c.timing.step_time_s)
    return head[:top]


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
