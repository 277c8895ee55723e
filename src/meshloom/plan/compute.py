"""Seconds of compute of one block for one micro-batch on one GPU, priced kernel by kernel from
the GPU's kernel table (plan/kernel_table.py) and the block's kernel inventory
(plan/step_kernels.py).

- GEMMs: every forward GEMM at its own shape's rate, and in backward its input gradient and its
  weight gradient at theirs; none faster than reading its two operands and writing its
  output once at the table's streaming bandwidth (the memory roofline: a thin GEMM, such as
  a GQA key or value projection of 128 columns, is bound by reading its input).
- Attention: a fused kernel (FlashAttention / SDPA) at the table's attention rate for the
  sequence, head width and causal mask, counting the FLOPs it really does (causal: half);
  unfused attention as its two batched GEMMs per direction (QK^T, PV; four in backward) plus
  the scores' trips through memory.
- Elementwise: the bytes of plan/step_kernels.py at the table's streaming bandwidth.
- Optimizer: a fused AdamW step's bytes at the table's measured optimizer rate (a measured table
  has one; otherwise the streaming bandwidth).
- Launch gaps: a kernel takes at least `launch_us` (the launch rate bounds a stream of short
  kernels), so each GEMM costs max(its time, launch) and the elementwise kernels together
  max(their bytes' time, their count x launch).
A GPU without a table is priced at its datasheet peak and bandwidth, with no launch gap: an
upper bound on speed, and said so (`Rates.source`).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshloom.plan import PlanError
from meshloom.plan.cp_ring import RingCost, ring_cost
from meshloom.plan.hardware import GB, GPUS, Cluster
from meshloom.plan.implementation import (
    TRAIN_METRIC_PASSES,
    Implementation,
    autocast_weights,
    ends_split,
    float8_gathers,
    head_tp,
    loss_kind,
    loss_vocab_share,
    residual_stream,
    table_tp,
)
from meshloom.plan.kernel_table import KernelTable, attention_flops, for_gpu, load, sdpa_kernel
from meshloom.plan.layout import Layout
from meshloom.plan.models import ModelShape
from meshloom.plan.moe import (
    expert_tp,
    ffn_elementwise_elems_per_token,
    ffn_tokens,
    load_factor,
)
from meshloom.plan.reruns import tp_pass_worths
from meshloom.plan.step_kernels import (
    Gemm,
    block_gemms,
    block_kernels,
    elementwise_bytes_per_token,
    head_gemm,
    score_bytes_per_entry,
    stream_casts,
)

# Cross entropy over the logits (`Implementation.cross_entropy`): (forward, backward) bytes per
# logit beyond the head GEMM's own output. Fused (compiled, flash-attn's fused cross entropy):
# forward reads the logits once; backward reads them again and writes their gradient. Eager
# (F.cross_entropy on bf16 logits under autocast): forward up-casts to fp32 (read 2, write 4)
# and takes the log-softmax (two reads of 4 for the max and the sum, a write of 4); backward
# writes the scattered NLL gradient (4), runs log-softmax's backward (read 4 twice, write 4)
# and down-casts (read 4, write 2). Megatron's unfused vocab-parallel loss
# (megatron/core/tensor_parallel/cross_entropy.py): forward up-casts (read 2, write 4), takes
# the max (read 4), subtracts it in place (read 4, write 4), exponentiates in place (4, 4),
# sums (4) and divides by the sum in place (4, 4), keeping that softmax for backward; backward
# multiplies it in place by the incoming gradient (4, 4) and the up-cast's backward
# down-casts it (read 4, write 2). Megatron-Core's `cross_entropy_loss_fusion`
# (megatron/core/fusions/fused_cross_entropy.py) runs the same steps as jit-fused functions,
# each at least one pass: up-cast with the max (read 2, write 4), subtract, exponentiate and
# sum (read 4, write 4), divide (read 4, write 4); backward the scaling with the down-cast
# (read 4, write 2). Its softmax is still an fp32 copy. Apex's and flash-attn 1's xentropy
# kernel (csrc/xentropy/xentropy_kernel.cu) reads each row twice forward, once for its max and
# sum and once for the sum of exponentials, and backward reads it once more and writes the
# gradient: 4 and 4. meshloom's vocabulary-parallel loss under tp > 1 (parallel/tensor.py,
# `vocab_parallel`) makes one fp32 copy (read 2, write 4) and takes the max (read 4), subtracts
# it and exponentiates in place (4, 4 each), sums (4) and divides in place (4, 4): Megatron's
# 38; its backward writes the 16-bit gradient straight from the softmax (read 4, write 2).
# PyTorch's `loss_parallel` (torch/distributed/tensor/parallel/loss.py; torchtitan's TP):
# forward up-casts (2, 4), takes the max (4), subtracts it (4, 4), exponentiates (4, 4), sums
# (4) and subtracts the log-sum (4, 4); backward writes zeros and the targets' -1 (4),
# exponentiates the kept log-softmax (4, 4), adds (4 + 4, 4), multiplies by the gradient
# (4, 4) and down-casts (4, 2).
# `F.cross_entropy` on bf16 logits with no autocast (`eager_bf16`, a bf16 model's loss: log_softmax
# keeps its input's dtype) runs eager's passes without the casts, at 2 bytes: forward two
# reads and a write (6); backward the NLL's gradient (2) and log-softmax's backward (read 2
# twice, write 2): 8.
CE_BYTES_PER_LOGIT = {"fused": (2.0, 4.0), "eager": (18.0, 22.0), "eager_bf16": (6.0, 8.0),
                      "megatron": (38.0, 14.0), "megatron_fused": (22.0, 6.0),
                      "xentropy": (4.0, 4.0), "vocab_parallel": (38.0, 6.0),
                      "loss_parallel": (38.0, 38.0)}
CE_KERNELS = {"fused": (1, 1), "eager": (4, 5), "eager_bf16": (3, 4), "megatron": (6, 2),
              "megatron_fused": (3, 1), "xentropy": (1, 1), "vocab_parallel": (6, 1),
              "loss_parallel": (6, 5)}
# AdamW (fused, fp32 state) reads and writes the master weight, m and v and reads the gradient
# (28 bytes). A training loop's gradient bookkeeping (Implementation.grad_clip): the global
# norm reads every gradient (4 bytes) and clipping scales it in place (read, write: 8), or,
# inside a fused optimizer kernel that reads the gradient anyway, writes it back scaled (4);
# gradients kept allocated are zeroed each step (write 4).
OPTIMIZER_BYTES_PER_PARAM = 28.0
# An unfused AdamW (`optimizer_impl` foreach or for_loop) runs the update as separate in-place
# elementwise kernels, each reading and writing its fp32 operands. PyTorch's
# (_single_tensor_adamw / _multi_tensor_adamw): weight decay mul (read 4, write 4), lerp of m
# towards the gradient (12), v times beta2 (8), addcmul of the squared gradient (12), sqrt
# (8), divide by the bias correction (8), add eps (8), addcdiv into the weight (read 12, write
# 4): 80 bytes. Composer's DecoupledAdamW (llm-foundry) updates m with mul and add (8 + 12)
# where PyTorch lerps (12) and skips the decay mul at weight_decay 0, as the MPT yamls set
# it: 80 bytes as well. Their launches (eight per tensor for a loop) are not counted.
UNFUSED_ADAMW_BYTES_PER_PARAM = 80.0
NORM_BYTES_PER_PARAM = 4.0
CLIP_BYTES_PER_PARAM = {"pass": 8.0, "in_optimizer": 4.0}
ZERO_BYTES_PER_PARAM = 4.0
# A trainer that keeps only bf16 state (`optimizer_state=bf16`: bf16 weights updated in place,
# bf16 moments, no fp32 master, as KempnerForge's bf16 model under FSDP2 or alone) steps on bf16
# weights, gradients and moments: every byte count above halves (14 a parameter fused, 40
# unfused, the gradient passes at 2 bytes an element).
STATE_BYTES_SCALE = {"fp32": 1.0, "fp32_remainders": 1.0, "bf16": 0.5}
# A backward that finds a gradient already there adds into it in place (autograd's
# AccumulateGrad: `variable_grad += new_grad`): read the new fp32 gradient, read the kept one,
# write it, 12 bytes. A gradient found empty is taken over as it is (no pass). So a loop that
# keeps its gradients pays this on every micro-batch, one that frees them on all but the first.
# meshloom's ZeRO-1 in bf16 keeps whole bf16 gradients in its flat buffers (parallel/zero.py):
# 6 bytes there (`accumulate_seconds(..., grad_bytes=2)`).
ACCUMULATE_BYTES_PER_PARAM = 12.0
# DeepSpeed's BF16_Optimizer adds each micro-batch's bf16 gradient into its fp32 buffer through
# an fp32 copy (`hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype))`): the cast reads 2 bytes and
# writes 4, the add reads both fp32 tensors and writes one, 18 bytes a parameter.
ACCUMULATE_BF16_TO_FP32 = 18.0
# The token-table lookup (`embedding_cost`), in passes over the micro-batch's rows (tokens x
# hidden at the table's dtype). Forward, the gather reads the table's rows and writes them.
# Backward, PyTorch's CUDA `embedding_dense_backward` reads the sorted incoming rows, writes
# per-segment partial sums, reads them and scatters them into the table's gradient: 4 passes,
# in 3 kernels besides the sort (fill, compute_grad_weight, sum_and_scatter). The profiled 1B
# Llama step (benchmarks/measured/h100-2026-11-26) spends 0.73 ms in these and the gather, where
# this prices 0.62 (benchmarks/results/planner/profile_vs_plan_llama1b.json).
EMBED_FWD_PASSES = 2
EMBED_BWD_PASSES = 4
EMBED_BWD_KERNELS = 3


# TransformerEngine's comm-GEMM overlap (Implementation.tp_overlap_chunks): forward, the GEMMs
# that read the all-gathered sequence run in tp ring-exchange chunks and the row-parallel ones
# in RS_SPLITS pipelined splits ahead of their reduce-scatter; backward, the row-parallel ones'
# input gradients read an all-gathered output gradient in tp chunks. The other backward GEMMs
# run whole beside a bulk collective.
_GATHERED = frozenset({"qkv", "fc1", "wq", "wk", "wv", "w1", "w3"})
_ROW_PARALLEL = frozenset({"proj", "fc2", "wo", "w2"})
RS_SPLITS = 4


def _pieces(g: Gemm, n: int) -> Gemm:
    """`g` run as n GEMMs of 1/n of its rows each."""
    return Gemm(g.name, g.m / n, g.n, g.k, g.count * n)


def overlap_pieces(gemms: list[Gemm], tp: int) -> tuple[list[Gemm], list[Gemm]]:
    """(forward GEMMs, backward GEMMs) of a block as TransformerEngine's userbuffers overlap
    runs them on a tp group with SP."""
    fwd = [_pieces(g, tp) if g.name in _GATHERED
           else _pieces(g, RS_SPLITS) if g.name in _ROW_PARALLEL else g for g in gemms]
    bwd = []
    for g in gemms:
        dgrad, wgrad = g.backward()
        bwd += [_pieces(dgrad, tp) if g.name in _ROW_PARALLEL else dgrad, wgrad]
    return fwd, bwd


GEMM_BYTES = 2  # bf16 operands and output, as the GEMM tables are measured
FP8_BYTES = 1  # an e4m3 operand (`Implementation.float8`)


@dataclass(frozen=True)
class Rates:
    """What one GPU's kernels run at: its kernel table (or None) and the figures used without."""
    table: KernelTable | None
    peak_tflops: float
    hbm_gbps: float
    launch_s: float
    scale: float  # --peak-tflops over the table GPU's datasheet peak (1 without an override)
    source: str
    optimizer_gbps: float = 0.0  # a fused AdamW step's bytes per second (0: hbm_gbps's)

    def __post_init__(self):
        if not self.optimizer_gbps:
            object.__setattr__(self, "optimizer_gbps", self.hbm_gbps)

    def gemm(self, g: Gemm, fp8: bool = False) -> float:
        """Seconds of one GEMM (all its `count` instances, as one grouped launch); `fp8`: with
        e4m3 operands and a 16-bit output (`Implementation.float8`)."""
        if g.m <= 0 or g.n <= 0 or g.k <= 0 or g.count <= 0:
            return 0.0
        if self.table is None:  # the datasheet's peak: an upper bound on speed
            if fp8:
                raise PlanError("float8 is priced from a kernel table's fp8 GEMM rows; the "
                                "datasheet (--kernels datasheet) has none")
            return max(g.flops / (self.peak_tflops * 1e12), self.launch_s)
        rate = self.table.gemm_tflops(g.m, g.n, g.k) * self.scale
        operand = GEMM_BYTES
        if fp8:
            rate *= self.table.fp8_speedup(g.m, g.n, g.k)
            operand = FP8_BYTES
        # The table's rows are its shapes; one far from them (a GQA projection of 128 columns
        # under tp 8) may be interpolated faster than reading its operands once allows.
        moved = (operand * (g.m * g.k + g.k * g.n) + GEMM_BYTES * g.m * g.n) * g.count
        return max(g.flops / (rate * 1e12), moved / (self.hbm_gbps * GB), self.launch_s)

    def attention(self, flops: float, seq: int, head_dim: int, causal: bool,
                  direction: str, kernel: str = "sdpa") -> float:
        if self.table is None or not self.table.has_attention:
            return flops / (self.peak_tflops * 1e12)
        rate = self.table.attention_tflops(seq, head_dim, causal, direction, kernel) \
            * self.scale
        return max(flops / (rate * 1e12), self.launch_s)

    def stream(self, nbytes: float, kernels: float = 0.0) -> float:
        return max(nbytes / (self.hbm_gbps * GB), kernels * self.launch_s)


def rates_for(cluster: Cluster) -> Rates:
    gpu = cluster.gpu
    if cluster.kernels == "datasheet":
        table = None
    elif cluster.kernels is not None:
        table = load(cluster.kernels)
    else:
        table = for_gpu(gpu.name)
    if table is None:
        why = "--kernels datasheet" if cluster.kernels else f"no kernel table for {gpu.name}"
        return Rates(None, gpu.peak_tflops, gpu.hbm_gbps, 0.0, 1.0,
                     f"{why}: datasheet peak and bandwidth (an upper bound on speed)")
    base = GPUS.get(gpu.name)
    scale = gpu.peak_tflops / base.peak_tflops if base else 1.0
    hbm = table.hbm_gbps or gpu.hbm_gbps
    adam = table.optimizer_gbps or hbm
    if base and gpu.hbm_gbps != base.hbm_gbps:  # an override scales the achieved figures
        adam *= gpu.hbm_gbps / base.hbm_gbps
        hbm *= gpu.hbm_gbps / base.hbm_gbps
    launch = (table.launch_us or 0.0) * 1e-6
    where = f"kernel table {table.path.rsplit('/', 1)[-1]} ({table.kind}: {table.device})"
    if table.power_limit is not None:
        watts, factor, attention, lender = table.power_limit
        what = "GEMM and attention" if attention else "GEMM"
        where += (f"; at its {watts:.0f} W limit: {lender}'s {what} rates x {factor:.3f} "
                  "(at_power_limit)")
    return Rates(table, gpu.peak_tflops, hbm, launch, scale, where, adam)


def attention_source(rates: Rates, kernel: str, flash: bool, cp_ring: str | None = None
                     ) -> str:
    """Which attention the step is priced with, for the rates line: the implementation's
    kernel (SDPA's pick named as such), the unfused core, or nothing without a table; under
    context parallel (`cp_ring`) the ring's kernel and how it cuts the work."""
    if not flash:
        return "attention: unfused (batched GEMMs, every score written)"
    if rates.table is None:
        return ""
    if cp_ring is not None:
        kernel = ring_kernel(kernel, cp_ring)
        named = sdpa_kernel(rates.table) if kernel == "sdpa" else kernel
        return f"attention: {named}, {cp_ring}'s ring"
    if kernel == "sdpa":
        return f"attention: {sdpa_kernel(rates.table)}, SDPA's pick"
    priced = rates.table.priced_as(kernel)
    named = f"{kernel}, priced as {priced}" if priced != kernel else kernel
    lender = rates.table.borrowed_ratio(kernel)
    if lender:
        return f"attention: {named}, at its ratio to fa2 on {lender} (not published here)"
    return f"attention: {named}"


def ring_kernel(kernel: str, cp_ring: str) -> str:
    """The attention kernel a ring calls: meshloom's calls PyTorch's FlashAttention op itself
    (parallel/context.py), not SDPA, unless the plan fixes another kernel."""
    return "fa2" if cp_ring == "meshloom" and kernel == "sdpa" else kernel


def loss_source(impl: Implementation, lay: Layout) -> str:
    """Which cross entropy the head is priced with, for the rates line (`auto` resolved)."""
    kind = loss_kind(impl, lay)
    fwd, bwd = CE_BYTES_PER_LOGIT[kind]
    return f"loss: {kind}, {fwd + bwd:g} bytes per logit"


def float8_source(impl: Implementation, lay: Layout) -> str:
    """What `float8` prices, for the rates line (empty without it)."""
    if impl.float8 == "none":
        return ""
    gathered = ", weights gathered in fp8" if float8_gathers(impl, lay) else ""
    return (f"float8: {impl.float8}, the blocks' linears at the table's fp8/bf16 GEMM ratio "
            f"(gemm_fp8) with torchao's casts{gathered}")


@dataclass
class PassCost:
    """Seconds of one pass of one block, by kind of kernel."""
    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise

    def __add__(self, other: PassCost) -> PassCost:
        return PassCost(self.gemm + other.gemm, self.attention + other.attention,
                        self.elementwise + other.elementwise)

    def scaled(self, f: float) -> PassCost:
        return PassCost(self.gemm * f, self.attention * f, self.elementwise * f)


@dataclass
class BlockCost:
    fwd: PassCost
    bwd: PassCost  # input and weight gradients, plus any recompute
    attention_fwd: PassCost  # the attention core's forward alone (what selective reruns)
    ring: RingCost | None = None  # context parallel's ring attention (cp > 1, fused attention)


def launched_gemms(gemms: list[Gemm], impl: Implementation) -> list[Gemm]:
    """A block's GEMMs as the trainer launches them: with `fused_qkv`, a Llama-style block's
    wq, wk and wv as one projection of their summed widths (Megatron's `linear_qkv`)."""
    if not impl.fused_qkv or [g.name for g in gemms[:3]] != ["wq", "wk", "wv"]:
        return gemms
    q, k, v = gemms[:3]
    return [Gemm("qkv", q.m, q.n + k.n + v.n, q.k, q.count), *gemms[3:]]


def block_cost(shape: ModelShape, lay: Layout, rates: Rates, seq: int, e: int, flash: bool,
               impl: Implementation) -> BlockCost:
    """One block, one micro-batch (lay.micro_batch sequences of seq / cp local tokens)."""
    t, s = lay.tp, seq // lay.cp
    tokens = lay.micro_batch * s
    rows, local, moe_tokens, etp = 0.0, 0, None, 1
    if shape.is_moe:  # the feed-forward on its own tokens (a 1/t slice under SP)
        moe_tokens = ffn_tokens(lay, tokens)
        local, etp = shape.n_experts // lay.ep, expert_tp(lay, impl)
        # split over tp, each expert slice runs the tp group's gathered rows
        rows = (etp * moe_tokens * shape.top_k * load_factor(shape, lay) * lay.ep
                / shape.n_experts)
    gemms = block_gemms(shape, tokens, t, rows, local, moe_tokens, etp)
    launched = launched_gemms(gemms, impl)
    run_fwd, run_bwd = launched, [b for g in launched for b in g.backward()]
    if impl.tp_overlap and impl.tp_overlap_chunks and lay.sp and t > 1:
        pieces_fwd, pieces_bwd = overlap_pieces(launched, t)
        run_fwd = pieces_fwd  # the backward's in pieces only where its collectives overlap
        run_bwd = pieces_bwd if impl.tp_overlap_backward else run_bwd
    fp8 = impl.float8 != "none"
    fwd = PassCost(gemm=sum(rates.gemm(g, fp8) for g in run_fwd))
    bwd = PassCost(gemm=sum(rates.gemm(b, fp8) for b in run_bwd))

    # Attention core: heads over tp; this rank's s queries against the keys they see.
    bh = lay.micro_batch * shape.heads / t
    kv_len = seq if shape.sliding_window is None else min(seq, shape.sliding_window)
    windowed = kv_len < seq
    att, ring = PassCost(), None
    expand_kv = impl.expand_kv
    if flash and lay.cp > 1:  # the ring's own calls and merges (plan/cp_ring.py)
        if impl.cp_ring == "meshloom":  # it expands K/V per step, not the block once
            expand_kv = False
        ring = ring_cost(shape, lay, rates, seq, e, impl.cp_ring,
                         ring_kernel(impl.attention_kernel, impl.cp_ring))
        att = PassCost(attention=ring.fwd_attention, elementwise=ring.fwd_elementwise)
        bwd.attention += ring.bwd_attention
        bwd.elementwise += ring.bwd_elementwise
    elif flash:
        for direction, cost in (("fwd", att), ("bwd", bwd)):
            fl = attention_flops(bh, s, kv_len, shape.head_dim, not windowed, direction)
            cost.attention += rates.attention(fl, s, shape.head_dim, True, direction,
                                              impl.attention_kernel)
    else:  # the unfused core: batched GEMMs, every score computed
        qk = Gemm("qk", s, kv_len, shape.head_dim, bh)
        pv = Gemm("pv", s, shape.head_dim, kv_len, bh)
        att.attention = rates.gemm(qk) + rates.gemm(pv)
        bwd.attention += sum(rates.gemm(b) for g in (qk, pv) for b in g.backward())
    if flash and impl.qkv_transpose:  # part of the attention core: selective reruns it
        copies = qkv_transpose_cost(shape, t, tokens, e, rates)
        att.elementwise += copies
        bwd.elementwise += copies
    fwd.attention = att.attention

    ffn = (ffn_elementwise_elems_per_token(shape, lay) * ffn_tokens(lay, tokens) / tokens
           if shape.is_moe else None)
    impl_ew = impl.elementwise
    stream = residual_stream(impl, e)
    casts = stream_casts(shape, stream, impl.fused_qkv, impl.fused_swiglu)
    ew_bytes = tokens * elementwise_bytes_per_token(shape, t, lay.sp, e, impl_ew, ffn,
                                                    expand_kv, impl.rope_complex, stream, casts)
    score_bytes = tokens * bh / lay.micro_batch * kv_len * score_bytes_per_entry(shape, e, flash)
    n_ew = (block_kernels(shape, impl_ew, flash, expand_kv, impl.rope_complex, casts)
            - len(gemms) - (1 if flash else 4))
    fwd.elementwise = rates.stream(ew_bytes + score_bytes, n_ew) + att.elementwise
    bwd.elementwise += rates.stream(2 * (ew_bytes + score_bytes), 2 * n_ew)
    if casts_weights(lay, e, impl):  # recompute reruns the forward's casts too (below)
        weights = sum(g.n * g.k * g.count for g in gemms)
        fwd.elementwise += rates.stream(weights * (4 + e), len(launched))
        bwd.elementwise += rates.stream(weights * (4 + e), len(launched))
    if fp8:  # recompute reruns the forward's casts too (below)
        cast_f, cast_b, kernels = float8_cast_bytes(gemms, impl, lay)
        fwd.elementwise += rates.stream(cast_f, 2 * kernels)
        bwd.elementwise += rates.stream(cast_b, kernels)
    if not flash:  # softmax (and dropout) belong to the attention core: selective reruns them
        att.elementwise = rates.stream(score_bytes)

    if lay.recompute == "full":
        bwd = bwd + fwd
    elif lay.recompute == "selective" and impl.op_sac and not shape.is_moe:
        # every second matmul and every elementwise op; attention's outputs were kept
        bwd = bwd + PassCost(gemm=sum(rates.gemm(g, fp8) for g in run_fwd[1::2]),
                             elementwise=fwd.elementwise - att.elementwise)
    elif lay.recompute == "selective":
        bwd = bwd + att
        if impl.selective_elementwise:  # the rest of the forward but its GEMMs
            bwd = bwd + PassCost(elementwise=fwd.elementwise - att.elementwise)
    copies_f, copies_b = sp_copies(shape, lay, impl)  # after the recompute: tp_reruns has it
    if copies_f or copies_b:
        # each all-gather's worth is a gather and a reduce-scatter; float8 gathers in fp8
        one = sp_copy_seconds(rates, tokens, shape.hidden, (FP8_BYTES + e) / 2 if fp8 else e)
        fwd.elementwise += copies_f * one
        bwd.elementwise += copies_b * one
    return BlockCost(fwd, bwd, att, ring)


def float8_cast_bytes(gemms: list[Gemm], impl: Implementation, lay: Layout
                      ) -> tuple[float, float, int]:
    """(forward bytes, backward bytes, casts) of the fp8 casts around a block's linears, one
    micro-batch (`Implementation.float8`, torchao's traffic model): forward, the input (m x k)
    and the weight (n x k); backward, the output gradient (m x n). Each is read twice, for its
    abs-max (unless fused into the kernel that made it: the input and the gradient under
    `compile`) and by the cast, which writes it in fp8 row- and column-major. Under
    `float8_all_gather` the weight is cast on its 1/dp shard before the gather, and the
    backward transposes the gathered fp8 weight (a byte read, a byte written).
    Under tp > 1, torchao's float8 tensor-parallel styles (torchtitan's TP plan with float8):
    `PrepareFloat8ModuleInput` casts each module's input once, on the rank's sequence slice
    under SP, before the projections that read it gather it (the column-parallel linears
    then take it as cast); a row-parallel linear casts its own input, and its output gradient
    on the sequence slice before the backward's gather (`Float8RowwiseParallel`)."""
    act = 4 if impl.compile else 6
    gathered = float8_gathers(impl, lay)
    t = lay.tp
    slice_ = t if lay.sp else 1  # a [tokens, h] activation on this rank: its SP slice
    fwd = bwd = 0.0
    casts = 0
    module_cast = False  # this module's input (attention's, the feed-forward's) is cast
    for g in gemms:
        weight = g.n * g.k * g.count
        fwd += 6 * weight / (lay.dp_shard if gathered else 1)
        bwd += 2 * weight if gathered else 0
        casts += 3
        if t > 1 and g.name in _GATHERED:
            if not module_cast:  # once, before the gather; its column-parallel readers share it
                module_cast = True
                fwd += act * g.m * g.k * g.count / slice_
            else:
                casts -= 1
            bwd += act * g.m * g.n * g.count
        elif t > 1 and g.name in _ROW_PARALLEL:  # the module ends with it
            module_cast = False
            fwd += act * g.m * g.k * g.count
            bwd += act * g.m * g.n * g.count / slice_
        else:
            fwd += act * g.m * g.k * g.count
            bwd += act * g.m * g.n * g.count
    return fwd, bwd, casts


# Under SP each all-reduce's worth of a block's tp traffic is an all-gather and a
# reduce-scatter (reruns.tp_pass_worths: 2 forward and 2 + tp_reruns backward with shared
# gathers, more per projection).
SP_COLLECTIVES_PER_PAIR = 2


def sp_copies(shape: ModelShape, lay: Layout, impl: Implementation) -> tuple[float, float]:
    """(forward, backward) sequence-parallel collectives of a block, per micro-batch, that also
    copy their whole (gathered) tensor on the compute stream (`Implementation.sp_copies`):
    NCCL gathers and scatters along the leading dimension, so a sequence split along dimension
    1 of batch-first tensors is rearranged around every call unless the micro-batch is one
    sequence (`batch`: meshloom's `comm._gather_dim` cat and `_reduce_scatter_dim` stack, which
    gather into and scatter from the tensor as it lies at b = 1, and PyTorch's functional
    collectives' chunk-and-cat under DTensor's Shard(1), a view at b = 1 in recent PyTorch;
    `always` for an implementation that rearranges even then). Megatron's sequence-first
    tensors need none; nor do collectives fused into their GEMMs piece by piece (torchtitan's
    async TP), which it does in the forward only (`tp_overlap_backward` off)."""
    if not _sp_copying(lay, impl):
        return 0.0, 0.0
    pairs_f, pairs_b = tp_pass_worths(shape, lay, impl)
    if _fused_into_gemms(impl):  # the forward's, or every pass's
        return 0.0, (0.0 if impl.tp_overlap_backward else pairs_b * SP_COLLECTIVES_PER_PAIR)
    return pairs_f * SP_COLLECTIVES_PER_PAIR, pairs_b * SP_COLLECTIVES_PER_PAIR


def end_sp_copies(lay: Layout, impl: Implementation, fused_forward: bool) -> tuple[float, float]:
    """(forward, backward) copies of an end's sequence-parallel pair per micro-batch, as
    `sp_copies` counts a block's: the embedding's reduce-scatter of its output and the gather
    of its gradient, or the head's gather of its input and the reduce-scatter of its input's
    gradient. Under async TP only a collective next to a matmul is fused, and only in the
    forward: the head's gather (`fused_forward`), not the embedding lookup's."""
    if not _sp_copying(lay, impl):
        return 0.0, 0.0
    if _fused_into_gemms(impl):
        return (0.0 if fused_forward else 1.0), (0.0 if impl.tp_overlap_backward else 1.0)
    return 1.0, 1.0


def _sp_copying(lay: Layout, impl: Implementation) -> bool:
    """Whether this layout's sequence-parallel collectives copy at all (`sp_copies`)."""
    if not lay.sp or lay.tp == 1 or impl.sp_copies == "none":
        return False
    return impl.sp_copies == "always" or lay.micro_batch > 1


def _fused_into_gemms(impl: Implementation) -> bool:
    """PyTorch's collectives fused into their matmuls, which run on each gathered piece as it
    lies (torchtitan's async TP: `tp_overlap` in chunks), copy nothing."""
    return impl.sp_copies == "batch" and impl.tp_overlap and impl.tp_overlap_chunks


def sp_copy_seconds(rates: Rates, tokens: int, hidden: int, e: float) -> float:
    """One sequence-parallel copy: a read and a write of the micro-batch's whole [tokens, h]."""
    return rates.stream(2 * tokens * hidden * e, 1)


def head_cost(shape: ModelShape, lay: Layout, rates: Rates, seq: int,
              impl: Implementation, e: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of the output head and the cross entropy on the last stage,
    vocabulary-parallel over tp (or as `tp_ends` runs it); the backward's share carries the
    training metrics the loop computes over the logits after it (`train_metrics`). A gathered
    head (`tp_ends`) also lays the gathered pieces side by side (a read and a write of the
    whole logits; the gather itself is timing.py's) and copies out its slice of their
    gradient."""
    tokens = lay.micro_batch * (seq // lay.cp)
    g = head_gemm(shape, tokens, head_tp(impl, lay))
    logits = tokens * shape.vocab / loss_vocab_share(impl, lay)
    kind = loss_kind(impl, lay)
    (ce_f, ce_b), (k_f, k_b) = CE_BYTES_PER_LOGIT[kind], CE_KERNELS[kind]
    fwd = rates.gemm(g) + rates.stream(ce_f * logits, k_f)
    bwd = sum(rates.gemm(b) for b in g.backward()) + rates.stream(ce_b * logits, k_b)
    if ends_split(impl, lay) == "gathered":
        fwd += rates.stream(2 * e * logits, 1)
        bwd += rates.stream(2 * e * logits / lay.tp, 1)
    casts = casts_weights(lay, e, impl)
    if casts:
        cast = rates.stream(g.n * g.k * (4 + e))
        fwd, bwd = fwd + cast, bwd + cast
    metrics = TRAIN_METRIC_PASSES[impl.train_metrics]
    if metrics:  # after the backward: eager cross-entropy forwards, no gradient
        eager_f, eager_k = CE_BYTES_PER_LOGIT["eager"][0], CE_KERNELS["eager"][0]
        bwd += metrics * rates.stream(eager_f * logits, eager_k)
    # the gather of the head's input and the reduce-scatter of its gradient (SP)
    copy_f, copy_b = end_sp_copies(lay, impl, fused_forward=True)
    if copy_f or copy_b:
        one = sp_copy_seconds(rates, tokens, shape.hidden, e)
        fwd, bwd = fwd + copy_f * one, bwd + copy_b * one
    return fwd, bwd + tied_gradient_add(shape, lay, rates, impl, 4 if casts else e)


def tied_gradient_add(shape: ModelShape, lay: Layout, rates: Rates, impl: Implementation,
                      grad_bytes: int) -> float:
    """Seconds per micro-batch of summing a tied token table's two gradients (the head's and
    the embedding's) before autograd accumulates them: read both, write one, each vocab/tp x
    hidden at the parameter's dtype (1.16 ms of the profiled 1B Llama step: 128256 x 2048 in
    fp32). Not there when the two sit on different pipeline stages (their gradients meet in
    an all-reduce) or when the weight-gradient GEMM adds into the kept gradient itself
    (`fused_grad_accumulation`)."""
    if not shape.tied or lay.pp > 1 or impl.fused_grad_accumulation:
        return 0.0
    return rates.stream(3 * grad_bytes * shape.vocab / head_tp(impl, lay) * shape.hidden, 1)


def embedding_cost(shape: ModelShape, lay: Layout, rates: Rates, seq: int, impl: Implementation,
                   e: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of the token-table lookup on the first stage, one
    micro-batch, vocabulary-parallel over tp unless the table is whole on every rank
    (`tp_ends`; its collectives are timing.py's `end_collectives`).
    Forward: the lookup reads each token's row and writes it (`EMBED_FWD_PASSES`); over a split
    table the rows of ids outside the rank's slice are then zeroed (read, write); a learned position
    table's rows are added (read, write). Backward (`embedding_dense_backward`): the table's
    gradient is zero-filled whole, then the incoming rows are sorted by id, summed per id into
    partial sums and scattered (`EMBED_BWD_PASSES`); with a position table the batch's rows are
    summed into its gradient (read). Where the weight-gradient GEMMs add into the fp32 main
    gradient themselves (`fused_grad_accumulation`, Megatron), the table's gradient is not a
    GEMM's: a hook adds it to the main gradient every micro-batch (read it, read and write 4
    bytes); elsewhere that add is `accumulate_seconds`' with every other gradient."""
    tokens = lay.micro_batch * (seq // lay.cp)
    w = 4 if casts_weights(lay, e, impl) else e  # the table's dtype: fp32 where the masters are
    rows = tokens * shape.hidden * w
    table = shape.vocab / table_tp(impl, lay) * shape.hidden
    fwd_passes, fwd_kernels = EMBED_FWD_PASSES, 1
    if table_tp(impl, lay) > 1:
        fwd_passes, fwd_kernels = fwd_passes + 2, fwd_kernels + 1
    bwd_bytes, bwd_kernels = table * w + EMBED_BWD_PASSES * rows, EMBED_BWD_KERNELS
    if shape.positions:
        fwd_passes, fwd_kernels = fwd_passes + 2, fwd_kernels + 2
        bwd_bytes, bwd_kernels = bwd_bytes + rows, bwd_kernels + 1
    if impl.fused_grad_accumulation:
        bwd_bytes, bwd_kernels = bwd_bytes + table * (w + 8), bwd_kernels + 1
    # the reduce-scatter of the lookup's output and the gather of its gradient (SP); a whole
    # table's lookup is sliced instead, DTensor cloning the rank's 1/tp of the rows
    copy_f, copy_b = end_sp_copies(lay, impl, fused_forward=False)
    if ends_split(impl, lay) == "gathered":
        copy_f = 1 / lay.tp
    one = sp_copy_seconds(rates, tokens, shape.hidden, e) if copy_f or copy_b else 0.0
    return (rates.stream(fwd_passes * rows, fwd_kernels) + copy_f * one,
            rates.stream(bwd_bytes, bwd_kernels) + copy_b * one)


def qkv_transpose_cost(shape: ModelShape, tp: int, tokens: int, e: int, rates: Rates) -> float:
    """Seconds of one pass's layout copies around the attention kernel (`qkv_transpose`), one
    block and micro-batch: q, k, v and the output each read and written once (their
    gradients the same backward). Interleaved q, k, v of head width 128 (multi-head
    attention) go in one kernel, else one each."""
    nbytes = tokens * 2 * (2 * shape.q_dim + 2 * shape.kv_dim) / tp * e
    one = shape.kv_heads == shape.heads and shape.head_dim == 128
    return rates.stream(nbytes, 2 if one else 4)


def casts_weights(lay: Layout, e: int, impl: Implementation) -> bool:
    """Whether each micro-batch casts the weights to the compute dtype: meshloom's unsharded
    layouts keep fp32 parameters (the masters) and compute under autocast, which casts every
    weight for the forward and again, transposed, for the backward: read 4 bytes, write e,
    each time (seen as `_to_copy` kernels in a profiled H100 step, 3.9 ms of the 1B model's
    step for 0.97B block parameters: docs/kernel-tables.md). ZeRO's stages hold low-precision
    working copies instead, and other trainers keep bf16 weights, except those that keep fp32
    parameters under autocast (`fp32_params`, Lightning's `bf16-mixed`): their forward casts
    each weight (read 4, write e) and their backward casts each weight's gradient back to fp32
    (read e, write 4), the same bytes."""
    return autocast_weights(impl, lay, "bf16" if e < 4 else "fp32")


def optimizer_seconds(params: float, grads: float, rates: Rates, *, clip_in_optimizer: bool = False,
                      zeroed: bool = True, optimizer_impl: str = "fused",
                      state: str = "fp32") -> float:
    """The optimizer step on `params` parameters, after the norm and clip of `grads` gradients
    (0: no clipping), which are then zeroed if `zeroed` (kept between steps). A fused AdamW
    kernel (with the clip it carries) runs at the table's measured optimizer rate where it has
    one; an unfused one (`optimizer_impl` foreach or for_loop: UNFUSED_ADAMW_BYTES_PER_PARAM),
    the norm, a separate clip pass and the zeroing stream at the copy rate. `state` is the
    `optimizer_state` key: bf16-only state moves half the bytes (STATE_BYTES_SCALE)."""
    fused = optimizer_impl == "fused"
    scale = STATE_BYTES_SCALE[state]
    clip_in_optimizer = clip_in_optimizer and fused
    in_kernel = CLIP_BYTES_PER_PARAM["in_optimizer"] if clip_in_optimizer else 0.0
    passes = (NORM_BYTES_PER_PARAM + (0.0 if clip_in_optimizer else CLIP_BYTES_PER_PARAM["pass"])
              + (ZERO_BYTES_PER_PARAM if zeroed else 0.0))
    if not fused:
        return rates.stream(scale * (params * UNFUSED_ADAMW_BYTES_PER_PARAM + grads * passes))
    adam = scale * (params * OPTIMIZER_BYTES_PER_PARAM + grads * in_kernel) / (
        rates.optimizer_gbps * GB)
    return adam + rates.stream(scale * grads * passes)


def accumulate_seconds(grads: float, additions: int, rates: Rates,
                       grad_bytes: int = 4) -> float:
    """`additions` micro-batches' backwards adding into `grads` kept gradients of `grad_bytes`
    bytes each (read new, read kept, write)."""
    per = ACCUMULATE_BYTES_PER_PARAM * grad_bytes / 4
    return rates.stream(grads * per * additions) if additions else 0.0
