"""Step time of a layout: each block's kernels priced from the GPU's kernel table
(plan/compute.py), exposed communication per mesh axis as the implementation overlaps it
(plan/implementation.py), the pipeline bubble from the pipeline code's own schedule simulator,
the optimizer step and clipping at the GPU's streaming bandwidth.

FLOPs use the convention of the published figures (Narayanan et al. 2021, published.md): per
token and layer 2 x (matrix weights) for the matmuls plus 4s x (attention width) for attention
(QK^T and AV over the whole sequence); the head 2Vh; backward is twice forward; full recompute
adds one more forward of every layer (Megatron's 96BsLh^2 hardware FLOPs), selective recompute
the attention core's. `tflops_per_gpu` counts model FLOPs only; `hw_tflops_per_gpu` adds
recompute, as Megatron's Table 1 does. These are what the MFU is quoted in; the time is what the
kernels take (a causal FlashAttention kernel, for one, does half the attention FLOPs).

Nothing here is fitted to end-to-end runs: the kernel rates are measured or published
microbenchmarks (plan/kernels/), the links' rates published (plan/hardware.py).

Mixture of experts (plan/moe.py): the FLOPs count the active experts (top_k per token); the
busiest GPU's expert GEMMs run its imbalance-scaled rows; each MoE block adds its all-to-alls
(dispatch and combine, forward and backward), not overlapped, on NVLink when the ep group fits
in a node and on the network otherwise; expert gradients are reduced over the ranks that hold
the same experts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache, partial

from meshloom.parallel.pipeline_schedule import (
    INTERLEAVED,
    SPLIT_BACKWARD,
    Action,
    build_schedule,
    simulate,
)
from meshloom.plan import nccl
from meshloom.plan.compute import (
    ACCUMULATE_BF16_TO_FP32,
    FP8_BYTES,
    Rates,
    accumulate_seconds,
    attention_source,
    block_cost,
    embedding_cost,
    float8_source,
    head_cost,
    loss_source,
    optimizer_seconds,
    rates_for,
)
from meshloom.plan.hardware import OVERLAP_SLOWDOWN, Cluster
from meshloom.plan.implementation import (
    MESHLOOM,
    Implementation,
    dp_calls,
    ends_split,
    float8_gathers,
    fp32_working_params,
    head_tp,
    keeps_grads,
    optimizer_state,
    pytorch_pipelined,
    reduce_bytes,
    table_tp,
    whole_fp32_states,
    zero3_held_step,
    zero3_no_sync,
    zero3_resharded,
)
from meshloom.plan.layout import Layout
from meshloom.plan.memory import (
    act_elem_bytes,
    gathered_param_bytes,
    outer_params,
    precision,
    rank_param_split,
    zero3_first_outer_params,
)
from meshloom.plan.models import ModelShape
from meshloom.plan.moe import (
    A2A_FORWARD,
    all_to_all_bandwidth,
    all_to_all_time,
    all_to_alls,
    dispatch_bytes,
    expert_replicas,
    expert_shard,
    expert_tp,
    ffn_tokens,
    load_factor,
)
from meshloom.plan.reruns import dispatch_reruns, ring_reruns, tp_pass_worths
from meshloom.plan.stages import rank_layers, stage_layers
from meshloom.plan.step_kernels import head_gemm

SIMULATE_LIMIT = 6000  # GPipe: micro-batches x stages simulated directly before extrapolating
# Cluster.action_cv > 0: the expected span is the mean of this many seeded simulations (the
# standard error of a 2-stage bubble at cv 0.1 is then ~0.002); a factor is never below the
# floor (a normal draw can be negative).
JITTER_SAMPLES = 64
JITTER_FLOOR = 0.3


def attention_flops_per_token(shape: ModelShape, seq: int) -> float:
    """Forward attention FLOPs per token and layer, Megatron's convention: QK^T and AV over the
    whole sequence at the attention width (heads x head width), no causal halving."""
    return 4 * seq * shape.q_dim


def model_flops(shape: ModelShape, seq: int, global_batch: int) -> float:
    """Model FLOPs of one training step (forward + backward, no recompute)."""
    per_token = shape.layers * (2 * shape.layer_matmul_params
                                + attention_flops_per_token(shape, seq))
    per_token += 2 * shape.vocab * shape.hidden
    return 3.0 * global_batch * seq * per_token


def recompute_flops(shape: ModelShape, seq: int, global_batch: int, recompute: str) -> float:
    """Extra FLOPs the hardware does to recompute activations in backward."""
    tokens = global_batch * seq
    if recompute == "full":
        return tokens * shape.layers * (2 * shape.layer_matmul_params
                                        + attention_flops_per_token(shape, seq))
    if recompute == "selective":
        return tokens * shape.layers * attention_flops_per_token(shape, seq)
    return 0.0


@dataclass
class Timing:
    step_time_s: float
    compute: float
    tp: float
    cp: float
    pp: float
    dp: float
    bubble: float
    optimizer: float
    bubble_fraction: float
    model_flops: float
    hw_flops: float
    ep: float = 0.0  # all-to-all seconds (expert parallel), on the critical path
    moe: bool = False  # the model has experts: the breakdown names ep_comm (a dense one's never)
    # For `meshloom plan --explain`: compute by kind of kernel and each communication's
    # exposed and hidden seconds, per step on the busiest GPU; where the rates come from.
    detail: dict = field(default_factory=dict)

    def breakdown(self) -> dict[str, float]:
        out = {"compute": self.compute, "tp_comm": self.tp, "cp_comm": self.cp,
               "pp_comm": self.pp, "dp_comm": self.dp, "bubble": self.bubble,
               "optimizer": self.optimizer}
        return out | {"ep_comm": self.ep} if self.moe else out


def step_time(shape: ModelShape, lay: Layout, cluster: Cluster, seq: int, global_batch: int,
              dtype: str = "bf16", flash: bool = True, exact_bubble: bool = True,
              impl: Implementation = MESHLOOM) -> Timing:
    """Predicted seconds per optimizer step and where they go, on the busiest GPU.
    `exact_bubble=False` uses the closed-form bubble (published.md) instead of the simulator:
    the search's fast first pass."""
    rates = rates_for(cluster)
    e = act_elem_bytes(dtype)
    s, b, t, p, v = seq // lay.cp, lay.micro_batch, lay.tp, lay.pp, lay.v
    m = lay.microbatches(global_batch)
    tokens = b * s

    # One block, one micro-batch, on one GPU: its kernels from the kernel table.
    blk = block_cost(shape, lay, rates, seq, e, flash, impl)
    f_layer, b_layer = blk.fwd.total, blk.bwd.total

    # Tensor parallel: 2 all-reduces forward and 2 backward per layer (all-gather +
    # reduce-scatter pairs with SP: the same bus time), and what recompute reruns of the
    # forward's (plan/reruns.py). With tp_overlap they run under the neighbouring GEMMs; only
    # the excess waits.
    # Under float8 the gathers carry fp8 (torchao's float8 tp styles cast before them, the
    # forward's inputs and the backward's output gradients); the reductions stay 16-bit.
    proto = impl.nccl_protocols
    def pair(gather_e: float) -> list:
        return ([cluster.collective(op, tokens * shape.hidden * width, t, 1, proto)
                 for op, width in (("all_gather", gather_e), ("reduce_scatter", e))] if lay.sp
                else [cluster.collective("all_reduce", tokens * shape.hidden * e, t, 1, proto)])

    tp_calls = pair(FP8_BYTES if impl.float8 != "none" else e)
    tp_one = sum(c.seconds for c in tp_calls)  # one all-reduce's worth
    # the embedding's and the head's are 16-bit: neither is a float8 linear
    end_one = sum(c.seconds for c in pair(e)) if impl.float8 != "none" else tp_one
    tp_start = sum(c.start for c in tp_calls)
    tp_pairs = ", ".join(sorted({c.name for c in tp_calls}))
    worth_f, worth_b = tp_pass_worths(shape, lay, impl)
    tp_f_all, tp_b_all = worth_f * tp_one, worth_b * tp_one
    if impl.tp_overlap:  # the hidden part still slows the GEMMs it runs beside
        tp_f, tp_b = _exposed(tp_f_all, blk.fwd.gemm), _exposed(tp_b_all, blk.bwd.gemm)
        if not impl.tp_overlap_backward:  # only the forward's run under its GEMMs
            tp_b = tp_b_all
    else:
        tp_f, tp_b = tp_f_all, tp_b_all

    # Context parallel: cp - 1 ring steps of this rank's K, V block per layer, each hidden
    # behind the ring's work on the block it already holds; backward also passes their
    # gradients (cp_ring_backward).
    cp_f = cp_b = 0.0
    if lay.cp > 1:
        kv_bytes = 2 * tokens * shape.kv_dim * e / t
        link, latency = cluster.link_bandwidth(lay.cp, t), cluster.send_latency(lay.cp, t)
        if blk.ring is not None:
            f_step, b_step = blk.ring.fwd / lay.cp, blk.ring.bwd / lay.cp
        else:  # the unfused core: its score GEMMs, backward twice the forward's
            f_step = blk.fwd.attention / lay.cp
            b_step = 2 * f_step
        cp_f = (lay.cp - 1) * _exposed(kv_bytes / link + latency, f_step)
        cp_b = cp_ring_backward(lay.cp, kv_bytes, e, link, latency, b_step, impl.cp_ring)
        if ring_reruns(lay, impl):
            cp_b += cp_f

    # Expert parallel: every MoE block dispatches and combines by all-to-all, forward and
    # backward (forward's pair again when recompute reruns it); nothing to hide them behind.
    # Experts split over tp (impl.expert_tp) also all-gather the tp group's received tokens
    # after each dispatch and reduce-scatter the output before each combine (their gradients
    # the other way round): one tp collective beside each all-to-all, as exposed.
    ep_f = ep_b = a2a = etp_one = 0.0
    etp_call = None
    etp = expert_tp(lay, impl) if shape.is_moe else 1
    if shape.is_moe and (lay.ep > 1 or etp > 1):
        payload = dispatch_bytes(shape, ffn_tokens(lay, tokens), e)
        a2a = all_to_all_time(payload, lay.ep, all_to_all_bandwidth(cluster, lay),
                              load_factor(shape, lay), cluster.send_latency(lay.ep, t))
        etp_call = cluster.collective("all_gather", etp * load_factor(shape, lay) * payload,
                                      etp, 1, proto)
        etp_one = etp_call.seconds
        ep_f = A2A_FORWARD * (a2a + etp_one)
        ep_b = (all_to_alls(dispatch_reruns(lay, impl)) - A2A_FORWARD) * (a2a + etp_one)
    tp_only = tp_f + tp_b
    tp_f, tp_b = tp_f + ep_f, tp_b + ep_b  # priced like TP's: on the critical path

    # Blocks per stage as the training code cuts them (plan/stages.py); stage s on rank s % p.
    stages = stage_layers(shape, p, v, seq, impl.pp_split)
    held = rank_layers(stages, p)
    head_f, head_b = head_cost(shape, lay, rates, seq, impl, e)
    emb_f, emb_b = embedding_cost(shape, lay, rates, seq, impl, e)
    head_wgrad = head_gemm(shape, tokens, head_tp(impl, lay)).backward()[1]
    logits = (cluster.collective("all_gather", tokens * shape.vocab * e, t, 1, proto)
              if ends_split(impl, lay) == "gathered" else None)
    ends = end_collectives(lay, end_one, tp_start / (2 if lay.sp else 1), rates.gemm(head_wgrad),
                           impl, logits)
    n_stages = p * v

    def cost(a: Action, comm: bool = True) -> float:
        first, last, n = a.stage == 0, a.stage == n_stages - 1, stages[a.stage]
        if a.kind == "F":
            c = n * (f_layer + (tp_f + cp_f) * comm) + (head_f if last else 0.0)
            c += (emb_f + ends.emb_f * comm if first else 0.0) + (
                ends.head_f * comm if last else 0.0)
        else:
            work_b = n * b_layer + (head_b if last else 0.0) + (emb_b if first else 0.0)
            comm_b = (n * (tp_b + cp_b) + (ends.emb_b if first else 0.0)
                      + (ends.head_b if last else 0.0)) * comm
            if a.kind == "W":  # zero-bubble halves: I carries the comm, W none of it
                return work_b / 2
            c = work_b / 2 + comm_b if a.kind == "I" else work_b + comm_b
        return c

    def end_comm(r: int) -> float:  # the ends' exposed tp collectives on pipeline rank r
        return (ends.emb_f + ends.emb_b if r == 0 else 0.0) + (
            ends.head_f + ends.head_b if r == p - 1 else 0.0)

    def work(r: int) -> float:  # one micro-batch's compute and comm on pipeline rank r
        return held[r] * (f_layer + tp_f + cp_f + b_layer + tp_b + cp_b) + (
            head_f + head_b if r == p - 1 else 0.0) + (
            emb_f + emb_b if r == 0 else 0.0) + end_comm(r)

    busiest = max(range(p), key=lambda r: (work(r), r))  # a tie goes to the last (the head)
    layers = held[busiest]

    hop_pp = pp_start = 0.0
    if p > 1:
        stride = lay.dp * lay.cp * t
        act = tokens * shape.hidden * e
        start = pp_start = cluster.send_latency(2, stride)
        if lay.sp:  # each tp rank holds, and sends, its sequence slice
            hop_pp = act / t / cluster.link_bandwidth(2, stride) + start
        elif impl.pp_scatter_gather and t > 1:  # a 1/t piece each, gathered over tp on arrival
            hop_pp = (act / t / cluster.link_bandwidth(2, stride) + start
                      + cluster.collective("all_gather", act, t, 1, proto).seconds)
        else:  # every tp rank sends the whole activation
            hop_pp = act / cluster.link_bandwidth(2, stride) + start

    busy_mb = work(busiest)
    comm_mb = layers * (tp_f + tp_b + cp_f + cp_b) + end_comm(busiest)
    ep_total = m * layers * (ep_f + ep_b)
    tp_total = m * layers * tp_only + m * end_comm(busiest)
    cp_total = m * layers * (cp_f + cp_b)
    if p == 1:
        span_nolat = span = m * busy_mb
    elif exact_bubble:
        sched = lay.schedule
        key, cv = _cost_key(cost, n_stages, v), cluster.action_cv
        span_nolat = _makespan(sched, p, m, v, key, 0.0, cv, w_order=impl.pp_w_order)
        span = _makespan(sched, p, m, v, key, hop_pp, cv, impl.p2p_blocking, impl.pp_w_order)
    else:
        chunks = v if lay.schedule in INTERLEAVED else 1  # micro-batch chunks a rank runs
        frac = (p - 1) / (chunks * m + p - 1)
        if lay.schedule in SPLIT_BACKWARD:  # F = I = W: 3 units per micro-batch chunk
            frac = (p - 1) / (3 * chunks * m + p - 1)
        span_nolat = m * busy_mb / (1 - frac)
        span = span_nolat + 2 * (p - 1) * hop_pp
        if impl.p2p_blocking:  # the busiest rank also waits out each of its own sends
            span += 2 * m * v * hop_pp
    bubble = max(0.0, span_nolat - m * busy_mb)
    pp_comm = max(0.0, span - span_nolat)
    # The bubble fraction as a measured timeline counts it (Timeline.bubble, meshloom report):
    # idle time averaged over the pipeline ranks, over the schedule's span. (`bubble` above is
    # the busiest rank's idle seconds, the part of the step time the breakdown charges to the
    # schedule.) Point-to-point transfers stay out of it, in pp_comm: a measured timeline
    # counts their wait as idle, see docs/plan.md.
    kinds = ("F", "I", "W") if lay.schedule in SPLIT_BACKWARD else ("F", "B")
    mean_busy = m * sum(cost(Action(k, st, 0)) for st in range(n_stages) for k in kinds) / p

    # After the pipeline drains, each rank reduces and steps its own parameters: the step ends
    # with the slowest, the last rank (the head's) or the one holding the most blocks.
    dp, optimizer, accumulate = max(
        (_after_backward(shape, lay, cluster, dtype, m, r, held[r],
                         held[r] * (f_layer + tp_f + cp_f), held[r] * (b_layer + tp_b + cp_b),
                         rates, impl)
         for r in sorted({p - 1, held.index(max(held))}, reverse=True)),
        key=lambda d: d[0]["exposed"] + d[1])

    tied = tied_table_sync(shape, lay, cluster, dtype, proto,
                           4 if whole_fp32_states(impl, lay, dtype) else None, impl)
    tied_s = tied.seconds
    total = span + dp["exposed"] + optimizer + tied_s
    mf = model_flops(shape, seq, global_batch)
    hw = mf + recompute_flops(shape, seq, global_batch, lay.recompute)
    compute = m * busy_mb - m * comm_mb
    per_step = m * layers
    detail = {
        "rates": "; ".join(filter(None, (rates.source, attention_source(
            rates, impl.attention_kernel, flash, impl.cp_ring if lay.cp > 1 else None),
            loss_source(impl, lay), float8_source(impl, lay)))),
        "implementation": impl.to_dict(),
        "compute_s": {"gemm": per_step * (blk.fwd.gemm + blk.bwd.gemm),
                      "attention": per_step * (blk.fwd.attention + blk.bwd.attention),
                      "elementwise": per_step * (blk.fwd.elementwise + blk.bwd.elementwise),
                      # the ends, where the busiest rank holds them
                      "head_and_loss": m * (head_f + head_b) if busiest == p - 1 else 0.0,
                      "embedding": m * (emb_f + emb_b) if busiest == 0 else 0.0},
        "comm_s": {"tp": {"exposed": tp_total,
                          "hidden": m * (layers * (tp_f_all + tp_b_all - tp_only)
                                         + ends.hidden(busiest == p - 1))}
                   | _tp_calls(m * layers, tp_f_all + tp_b_all, tp_one, tp_start,
                               2 if lay.sp else 1, ends.calls(m, busiest == 0, busiest == p - 1),
                               tp_pairs),
                   "cp": {"exposed": cp_total},
                   "dp": {"exposed": dp["exposed"], "hidden": dp["total"] - dp["exposed"],
                          "ops": dp["ops"], "calls": dp["calls"]},
                   "pp": _with_tied({"exposed": pp_comm} | _pp_sends(
                       m, busiest, p, n_stages, hop_pp, pp_start), tied)}
        | ({"ep": {"exposed": ep_total} | _ep_calls(
            m * layers * all_to_alls(dispatch_reruns(lay, impl)),
            {"all_to_all": (a2a, cluster.send_latency(lay.ep, t)),
             "expert_tp_gather_scatter": (etp_one, etp_call.start if etp_call else 0.0,
                                          etp_call.name if etp_call else "")})}
           if shape.is_moe else {}),
        "bubble_s": bubble, "optimizer_s": optimizer, "accumulate_s": accumulate,
    }
    return Timing(total, compute, tp_total, cp_total, pp_comm + tied_s, dp["exposed"], bubble,
                  optimizer, max(0.0, 1.0 - mean_busy / span_nolat) if span_nolat else 0.0, mf,
                  hw, ep_total, shape.is_moe, detail)


def _after_backward(shape: ModelShape, lay: Layout, cluster: Cluster, dtype: str, m: int,
                    rank: int, layers: int, f_mb: float, b_mb: float, rates,
                    impl: Implementation) -> tuple[dict, float, float]:
    """Pipeline rank `rank`'s data-parallel communication (`_dp_time`), and its optimizer step
    with the gradient accumulation passes (seconds; the second includes the third)."""
    dp = _dp_time(shape, lay, cluster, dtype, m, f_mb, b_mb, impl, rank, layers, rates)
    dense, experts = rank_param_split(shape, lay, rank, layers, expert_tp(lay, impl), impl)
    opt_params = dense / (lay.dp_shard if lay.zero else 1)
    if experts:
        opt_params += experts / (expert_shard(lay) if lay.zero else 1)
    clip_params = opt_params if lay.zero >= 2 else dense + experts  # ZeRO-2/3 keep a shard
    kept = keeps_grads(impl, lay)
    optimizer = optimizer_seconds(opt_params, clip_params if impl.grad_clip else 0.0, rates,
                                  clip_in_optimizer=impl.clip_in_optimizer, zeroed=kept,
                                  optimizer_impl=impl.optimizer_impl,
                                  state=optimizer_state(impl, lay, dtype))
    if whole_fp32_states(impl, lay, dtype):  # every micro-batch adds an fp32 copy of its grads
        accumulate = rates.stream(clip_params * ACCUMULATE_BF16_TO_FP32 * m)
    elif pytorch_pipelined(impl, lay):
        # FSDP2 upcasts the first micro-batch's gradients to the reduce dtype (a read and a
        # write, none when they match) and adds each later one in (read both, write).
        g, w = _grad_bytes(impl, lay, dtype), reduce_bytes(impl, dtype)
        accumulate = rates.stream((dense + experts) * ((g + w if g != w else 0)
                                                       + (m - 1) * (g + 2 * w)))
    elif zero3_no_sync(impl, lay, m) and impl.fsdp_flat_param:
        # FSDP1: later micro-batches add into the flat gradient, in the backward's dtype
        accumulate = accumulate_seconds(dense + experts, m - 1, rates,
                                        _grad_bytes(impl, lay, dtype))
    elif zero3_no_sync(impl, lay, m):
        # meshloom's fp32 sums (`parallel.reduce_once`): the first micro-batch's gradients
        # copied in (read g, write 4), each later one added (read g, read 4, write 4)
        g = _grad_bytes(impl, lay, dtype)
        accumulate = rates.stream((dense + experts) * (g + 4 + (m - 1) * (g + 8)))
    else:
        additions = 0 if impl.fused_grad_accumulation else m if kept else m - 1
        # meshloom's own ZeRO-1 keeps whole bf16 gradients; other trainers accumulate in fp32.
        bf16_grads = impl.meshloom_block and lay.zero == 1 and dtype == "bf16"
        accumulate = accumulate_seconds(clip_params, additions, rates, 2 if bf16_grads else 4)
    return dp, optimizer + accumulate, accumulate


def _grad_bytes(impl: Implementation, lay: Layout, dtype: str) -> int:
    """Bytes of one gradient element as the backward writes it: fp32 where the parameters are
    (`fp32_params`), else the precision's."""
    return 4 if fp32_working_params(impl, lay, dtype) else precision(dtype).grad_bytes


def _dp_time(shape: ModelShape, lay: Layout, cluster: Cluster, dtype: str, m: int,
             f_mb: float, b_mb: float, impl: Implementation, rank: int, layers: int,
             rates: Rates) -> dict:
    """Data-parallel communication per step: {"exposed", "total", "ops"} seconds, as the
    implementation runs it. meshloom: DDP all-reduces in buckets during the last micro-batch's
    backward (hidden up to that backward's length; `ddp_overlap` off: after it), over dp x cp
    ranks; ZeRO-1 reduce-scatters
    once after the last backward; ZeRO-2 reduce-scatters after every micro-batch behind its
    backward; ZeRO-1/2 all-gather the updated parameters after the step (exposed); ZeRO-3
    gathers every block for forward and backward, what lies outside the blocks once
    (`fsdp_root`), and reduce-scatters every gradient, prefetched behind the micro-batch's
    compute, except the first gathers (the first block's and the outer parameters' gathered
    before it: the root's under `fsdp_root=outer`, meshloom's embedding and its tied root,
    where its untied root is the last block's prefetch). Under `fsdp_carry` (meshloom's plain
    accumulation, pp = 1) every micro-batch after the first opens with those already gathered:
    the first block, and a root holding the outer parameters, stay gathered from the backward
    before (their gathers are not made again), and the embedding is gathered behind that
    backward. ZeRO-3 without `reshard_after_forward` gathers for forward only, and meshloom's
    (`zero3_held_step`) in the step's first forward alone, behind it as usual but for the first
    gathers; FSDP1's ZeRO-2
    (`fsdp_flat_param`, SHARD_GRAD_OP) gathers each unit once a micro-batch, behind its
    forward, and reduce-scatters it behind its backward; its ZeRO-0 (NO_SHARD) all-reduces
    each unit every micro-batch. `dp_overlap` (Megatron's
    distributed optimizer): ZeRO-1/2's reduce-scatter hides behind the last backward and the
    gather behind the first forward. `zero_redundancy_optimizer` (PyTorch's, over DDP): ZeRO-1
    all-reduces the whole gradient in DDP's buckets during the last backward and broadcasts
    the updated parameters after the step (a gather's bytes, exposed). `fsdp_prefetch` off:
    every ZeRO-3 (and FSDP1 ZeRO-2) gather and reduce-scatter waits. `fsdp_no_sync`: ZeRO-3
    (and FSDP1 ZeRO-2) reduce-scatters (and copies in, but for FSDP1's concatenation, below)
    on the last micro-batch only, the others gather as usual. `pp_fsdp=pytorch` (ZeRO-3 under
    PyTorch's pipelining): every unit gathered in the first forward and held, the whole
    gradients (in the wire dtype) reduce-scattered once after the stage's last backward,
    exposed. HSDP all-reduces the shard across
    replicas after the step, and with cp > 1 the shard is averaged over the cp ranks too (both
    exposed). `fsdp_copy_out` (FSDP2): every
    ZeRO-3 gather is copied out of its flat buffer into each parameter on the
    compute stream, a read and a write of the gathered bytes (`rates`' copy rate), exposed.
    Before each ZeRO-3 reduce-scatter, every implementation copies the unit's gradients into
    its flat send buffer in the reduce dtype on the compute stream, a read of the gradients
    and a write at the wire's bytes, exposed: meshloom's `_reduce` packs them
    (parallel/fsdp.py) and FSDP2's `foreach_reduce_scatter_copy_in` chunk-cats them. FSDP1
    (`fsdp_flat_param`) differs: its flat parameter receives every backward's gradients
    through autograd's concatenation of its views' gradients, in their own dtype, every
    micro-batch (`fsdp_no_sync` or not), and is cast to the wire dtype on the post-backward
    stream before each reduce-scatter, a cost that rides with the collective.
    `fp32_params`: the gathers carry fp32 parameters and the gradients are fp32.
    meshloom's ZeRO-2 packs each bucket the same way every micro-batch, and its ZeRO-1 casts
    its whole bf16 gradient buffers to the reduce dtype once a step (parallel/zero.py);
    Megatron-style ZeRO-1/2 reduce their gradient buffers in place (`meshloom_block` off).
    With expert parallel the
    experts' gradients go over their own groups (plan/moe.py) at the same points: DDP
    all-reduces them over the edp = dp x cp / ep ranks, ZeRO shards them over edp_shard (ep
    ranks apart) and all-reduces the shard over dp_replicate; cp is inside edp_shard, so no cp
    average."""
    none = {"exposed": 0.0, "total": 0.0, "ops": {}, "calls": {}}
    dense, experts = rank_param_split(shape, lay, rank, layers, expert_tp(lay, impl), impl)
    if lay.ep == 1:  # no expert groups: the experts are ordinary parameters
        dense, experts = dense + experts, 0.0
    if lay.dp <= 1 and not experts:
        return none
    stride = lay.cp * lay.tp
    n = lay.dp_shard
    # Gradients travel in the reduce dtype (`grad_reduce_dtype`), parameters in bf16 (fp32
    # under `fp32_params`).
    wire = reduce_bytes(impl, dtype)
    param_bytes = gathered_param_bytes(impl, lay, dtype)
    grad_bytes = _grad_bytes(impl, lay, dtype)
    grad_b, param_b = dense * wire, dense * param_bytes
    if float8_gathers(impl, lay):  # the blocks' linear weights travel in fp8, a byte each
        blocks = dense - outer_params(shape, lay, rank, impl)
        param_b -= (blocks * shape.layer_matmul_params / shape.layer_params
                    * (param_bytes - FP8_BYTES))
    if lay.dp <= 1:  # only expert groups to reduce (ep < cp); the dense part as before: none
        grad_b = param_b = 0.0
    xn = expert_shard(lay)
    x_grad, x_param = experts * wire, experts * param_bytes
    ops: dict[str, float] = {}
    # Per op: the calls a step makes and the seconds of their fixed cost (in ops' seconds).
    made: dict[str, list] = {}

    def coll(name: str, op: str, payload: float, size: int, stride_: int, n_calls: int,
             per_step: int = 1) -> float:
        if payload <= 0 or size <= 1 or n_calls <= 0:
            return 0.0
        one = cluster.collective(op, payload / n_calls, size, stride_, impl.nccl_protocols)
        tally = made.setdefault(name, [0, 0.0, set()])
        tally[0] += n_calls * per_step
        tally[1] += n_calls * per_step * one.start
        tally[2].add(one.name)
        return n_calls * one.seconds

    def result(exposed: float, total: float) -> dict:
        return {"exposed": exposed, "total": total, "ops": ops,
                "calls": {k: {"calls": c, "fixed_s": f, "nccl": ", ".join(sorted(pairs))}
                          for k, (c, f, pairs) in made.items()}}

    if lay.zero == 0 and impl.fsdp_flat_param:
        # FSDP1's NO_SHARD: every micro-batch's backward all-reduces each unit's flat gradient
        # from its post-backward hook (once a step, on the last, under `fsdp_no_sync`), cast to
        # the wire dtype first on the same stream, behind the backward or waited on
        # (`fsdp_prefetch`), after autograd has concatenated the unit's gradients into it on
        # the compute stream (every micro-batch).
        units, grads = max(1, layers), dense + experts
        times = 1 if impl.fsdp_no_sync and m > 1 else m
        reduce = coll("all_reduce", "all_reduce", grad_b, lay.dp * lay.cp, lay.tp, units, times)
        if experts:
            reduce += coll("all_reduce", "all_reduce", x_grad, expert_replicas(lay),
                           lay.ep * lay.tp, units, times)
        cast = rates.stream(grads * (grad_bytes + wire), units) if grad_bytes != wire else 0.0
        concat = m * rates.stream(grads * 2 * grad_bytes, units)
        ops["all_reduce"] = times * reduce
        if cast:
            ops["reduce_scatter_cast"] = times * cast
        ops["reduce_scatter_copy_in"] = concat
        waits = _exposed(reduce + cast, b_mb) if impl.fsdp_prefetch else reduce + cast
        return result(times * waits + concat, times * (reduce + cast) + concat)
    if lay.zero == 0:  # meshloom's DDP averages over every replica: dp x cp ranks, stride tp
        ranks, xr = lay.dp * lay.cp, expert_replicas(lay)
        calls = partial(dp_calls, impl.dp_buckets, impl.ddp_overlap)
        reduce = coll("all_reduce", "all_reduce", grad_b, ranks, lay.tp,
                      calls(grad_b, dense, ranks))
        if experts:
            reduce += coll("all_reduce", "all_reduce", x_grad, xr, lay.ep * lay.tp,
                           calls(x_grad, experts, xr))
        ops["all_reduce"] = reduce
        return result(_exposed(reduce, b_mb) if impl.ddp_overlap else reduce, reduce)
    out = 0.0
    units = max(1, layers)
    # FSDP1's ZeRO-2 (SHARD_GRAD_OP under `fsdp_flat_param`) keeps each unit gathered from its
    # forward to its backward only: every micro-batch gathers it again.
    fsdp1_zero2 = lay.zero == 2 and impl.fsdp_flat_param
    by_unit = lay.zero == 3 or fsdp1_zero2
    # ZeRO-3 gathers and reduces unit by unit (a block each); ZeRO-1/2 bucket by bucket.
    calls = partial(dp_calls, impl.dp_buckets, impl.dp_overlap)

    def per(nbytes: float, params: float, ranks: int) -> int:
        return units if by_unit else calls(nbytes, params, ranks)

    # How often a step repeats each: ZeRO-3 gathers twice a micro-batch and reduces once (once
    # a step under `fsdp_no_sync`), FSDP1's ZeRO-2 gathers and reduces once a micro-batch,
    # meshloom's ZeRO-2 reduces every micro-batch and gathers once a step, ZeRO-1 once. ZeRO-3
    # without `reshard_after_forward` gathers for forwards only: each micro-batch's, or under
    # `zero3_held_step` (meshloom) the first's alone, every unit then held to the step's end.
    resharded = zero3_resharded(impl, lay)
    pipelined = pytorch_pipelined(impl, lay)
    forwards = 1 if zero3_held_step(impl, lay) else m  # the forwards that gather
    ag_times = ((2 * m if resharded else forwards) if lay.zero == 3
                else m if fsdp1_zero2 else 1)
    rs_times = m if lay.zero >= 2 and not zero3_no_sync(impl, lay, m) else 1
    # DeepSpeed's BF16_Optimizer and PyTorch's ZeroRedundancyOptimizer (over DDP) all-reduce
    # the whole gradient where ZeRO reduce-scatters it.
    whole = whole_fp32_states(impl, lay, dtype)
    zro = impl.zero_redundancy_optimizer and lay.zero == 1
    red = "all_reduce" if whole or zro else "reduce_scatter"
    # ZeRO-3 gathers each block once a pass and what lies outside the blocks (embedding, final
    # norm, head) once a micro-batch: the root (`fsdp_root=outer`) or the embedding before
    # anything runs, meshloom's untied root behind the last block (`zero3_first_outer_params`).
    sharded_outer = lay.zero == 3 and param_b
    outer = outer_params(shape, lay, rank, impl) * param_bytes if sharded_outer else 0.0
    lead = (zero3_first_outer_params(shape, lay, rank, impl) * param_bytes if sharded_outer
            else 0.0)
    ag = coll("all_gather", "all_gather", param_b - outer, n, stride,
              per(param_b - outer, dense, n), ag_times)
    rs = coll(red, red, grad_b, n, stride, per(grad_b, dense, n), rs_times)
    if experts:
        ag += coll("all_gather", "all_gather", x_param, xn, lay.ep * lay.tp,
                   per(x_param, experts, xn), ag_times)
        rs += coll(red, red, x_grad, xn, lay.ep * lay.tp, per(x_grad, experts, xn), rs_times)
    # One backward's gathers: the blocks, ZeRO-3 resharding after forward only.
    ag_b = ag if lay.zero == 3 and resharded else 0.0
    ag_lead = coll("all_gather", "all_gather", lead, n, stride, 1, forwards)
    ag_tail = coll("all_gather", "all_gather", outer - lead, n, stride, 1, forwards)
    # One forward's gathers, and the part of them nothing runs beside: the first outer
    # parameters' and the first unit's.
    block = ag / units
    ag, first = ag + ag_lead + ag_tail, block + ag_lead
    # `fsdp_carry`: the micro-batches after the first open with the first block (and a root
    # that holds the first outer parameters) kept from the backward before, and gather the
    # embedding behind that backward instead (parallel/fsdp.py).
    carried = (m - 1 if impl.fsdp_carry and lay.zero == 3 and resharded and lay.pp == 1
               and param_b else 0)
    lead_is_root = impl.fsdp_root == "outer" or shape.tied
    behind = 0.0 if lead_is_root else ag_lead  # gathered in the backward before
    if carried:  # the gathers not made again, out of the step's tally
        coll("all_gather", "all_gather", (param_b - outer) / units, n, stride, 1, -carried)
        if experts:
            coll("all_gather", "all_gather", x_param / units, xn, lay.ep * lay.tp, 1, -carried)
        if lead_is_root:
            coll("all_gather", "all_gather", lead, n, stride, 1, -carried)
    reduced = (dense if n > 1 else 0.0) + (experts if xn > 1 else 0.0)
    flat_param = by_unit and impl.fsdp_flat_param
    # FSDP1 casts the flat gradient to the wire dtype on its post-backward stream, before the
    # reduce-scatter (`_post_backward_hook`), so the cast rides with the collective.
    cast = (rates.stream(reduced * (grad_bytes + wire), units)
            if flat_param and reduced and grad_bytes != wire else 0.0)
    if lay.zero in (1, 2) and not fsdp1_zero2:
        ops = {red: rs * rs_times, "all_gather": ag}
        if whole:  # after the pipeline drains, then the step's gather: none of it overlapped
            out += rs + ag
        elif zro:  # DDP's buckets during the last backward; the owners' broadcasts after the step
            out += (_exposed(rs, b_mb) if impl.ddp_overlap else rs) + ag
        elif impl.dp_overlap:
            out += _exposed(rs, b_mb) * rs_times + _exposed(ag, f_mb)
        elif lay.zero == 1:  # reduce-scatters the accumulated gradients after the last backward
            out += rs + ag
        else:
            out += m * _exposed(rs, b_mb) + ag
    else:
        kept = carried * (block + (ag_lead if lead_is_root else 0.0))
        ops = {"all_gather": forwards * ag + m * ag_b - kept, "reduce_scatter": rs_times * rs}
        if cast:
            ops["reduce_scatter_cast"] = rs_times * cast
        if impl.fsdp_prefetch:  # the micro-batches that reduce-scatter hide it behind backward
            # Forwards: the first (and each one not carried) opens exposed; the carried ones
            # hide all of theirs. Backwards: the carried ones (all but the last) also gather
            # the next forward's embedding; the last, or every one, reduce-scatters.
            out += ((forwards - carried) * (_exposed(ag - ag_lead, f_mb) + first)
                    + carried * _exposed(ag - ag_lead - block, f_mb))
            if pipelined:  # after the stage's last backward, waited on (`pp_fsdp`)
                out += rs + cast
            elif rs_times == m:
                out += (carried * _exposed(ag_b + rs + cast + behind, b_mb)
                        + (m - carried) * _exposed(ag_b + rs + cast, b_mb))
            else:
                out += (_exposed(ag_b + rs + cast, b_mb) + carried * _exposed(ag_b + behind, b_mb)
                        + (m - 1 - carried) * _exposed(ag_b, b_mb))
        else:
            out += forwards * ag + m * ag_b + rs_times * (rs + cast) - kept
        gathered = (param_b if n > 1 else 0.0) + (x_param if xn > 1 else 0.0)
        if impl.fsdp_copy_out and gathered:  # one copy kernel per unit and gather
            again = gathered - outer if lay.zero == 3 and resharded else 0.0  # for backward
            kernels = units * (2 if again else 1) + (1 if outer else 0)
            copied = 2 * (gathered + again)  # read and written, every forward
            # `fsdp_carry`: a carried micro-batch gathers, so copies out, its first block (and
            # a root holding the first outer parameters) no more.
            held_b = (gathered - outer) / units + (lead if lead_is_root else 0.0)
            held_k = 1 + (1 if lead_is_root and lead else 0)
            copy_out = ((forwards - carried) * rates.stream(copied, kernels)
                        + carried * rates.stream(copied - 2 * held_b, kernels - held_k))
            ops["all_gather_copy_out"] = copy_out
            out += copy_out
    # The gradients' copy into the flat send buffers in the wire dtype, on the compute stream
    # (`_dp_time`'s docstring): ZeRO-3 per unit, meshloom's ZeRO-2 per bucket, every
    # micro-batch; meshloom's ZeRO-1 casts its whole 16-bit buffers once, when they differ.
    # FSDP1 (`fsdp_flat_param`) instead concatenates every backward's gradients into the flat
    # gradient in their own dtype, on the compute stream (its cast to the wire dtype is above).
    copies = (rs_times if lay.zero == 3 or lay.zero == 2 and impl.meshloom_block
              else 1 if lay.zero == 1 and impl.meshloom_block and grad_bytes != wire
              else 0)
    if reduced and flat_param:
        copy_in = m * rates.stream(reduced * 2 * grad_bytes, units)
        ops["reduce_scatter_copy_in"] = copy_in
        out += copy_in
    elif reduced and copies and not whole:
        kernels = units if lay.zero == 3 else per(grad_b, dense, n)
        held = wire if pipelined else grad_bytes  # (accumulated in the wire dtype)
        copy_in = copies * rates.stream(reduced * (held + wire), kernels)
        ops["reduce_scatter_copy_in"] = copy_in
        out += copy_in
    if lay.dp_replicate > 1:
        reps = lay.dp_replicate
        rep = coll("replica_all_reduce", "all_reduce", grad_b / n, reps, stride * n,
                   calls(grad_b / n, dense / n, reps))
        if experts:
            rep += coll("replica_all_reduce", "all_reduce", x_grad / xn, reps, stride * n,
                        calls(x_grad / xn, experts / xn, reps))
        ops["replica_all_reduce"] = rep
        out += rep
    if lay.cp > 1:  # the cp ranks of a shard hold the same parameters: average their shards
        cpr = coll("cp_all_reduce", "all_reduce", grad_b / n, lay.cp, lay.tp,
                   calls(grad_b / n, dense / n, lay.cp))
        ops["cp_all_reduce"] = cpr
        out += cpr
    return result(out, max(out, sum(ops.values())))


def _tp_calls(blocks: int, per_block: float, one: float, start: float, pieces: int,
              ends: tuple[float, int, float] = (0.0, 0, 0.0), nccl: str = "") -> dict:
    """The TP collectives of a step, reported as the data-parallel ones are ({"ops",
    "calls"}; empty without TP): `blocks` passes of one micro-batch through one block (forward
    and backward), each with `per_block` seconds of collectives, that is per_block / `one`
    all-reduces' worth; each all-reduce's worth is `pieces` calls (with SP an all-gather and a
    reduce-scatter) that start in `start` seconds together. `ends`: the embedding's and the
    head's collectives on this rank (seconds, calls, their start; `EndCollectives.calls`);
    `nccl`: the algorithm and protocol NCCL runs them with (the ends' are the blocks')."""
    if not one:
        return {}
    n = per_block / one  # all-reduces' worth per block pass
    out = {"ops": {"collectives": blocks * per_block},
           "calls": {"collectives": {"calls": round(blocks * n * pieces),
                                     "fixed_s": blocks * n * start, "nccl": nccl}}}
    if ends[1]:
        out["ops"]["embedding_and_head"] = ends[0]
        out["calls"]["embedding_and_head"] = {"calls": ends[1], "fixed_s": ends[2],
                                              "nccl": nccl}
    return out


@dataclass
class EndCollectives:
    """Seconds of the embedding's and the head's tp collectives per micro-batch, exposed, and
    the head's backward one in all (`head_b_all`, for the calls). The vocabulary-parallel
    lookup sums its partial rows over tp: an all-reduce forward, or under SP a reduce-scatter
    forward and its all-gather backward. The head's input enters the tp group: without SP its
    gradient is all-reduced backward; under SP it is all-gathered forward and its gradient
    reduce-scattered backward. Each end is one all-reduce's worth either way, on the step's
    critical path, except the head's backward collective, which Megatron-style
    implementations (`tp_overlap`) issue beside the head's weight-gradient GEMM: only what
    outlasts that GEMM waits. Ends run as `tp_ends=gathered` differ: a whole table's lookup is
    sliced, so only its gradient is all-gathered (half an all-reduce, backward), and the
    head's logits are also all-gathered whole forward (`logits`, one call, exposed: the loss
    waits for it); ends split over no rank (`whole`) have no collective."""
    emb_f: float = 0.0
    emb_b: float = 0.0
    head_f: float = 0.0
    head_b: float = 0.0
    head_b_all: float = 0.0
    start: float = 0.0  # one call's start
    emb_calls: int = 0  # per micro-batch
    head_calls: int = 0  # besides the logits' gather
    logits_calls: int = 0  # 1 for a gathered head (its seconds inside head_f)
    logits_start: float = 0.0

    def hidden(self, last: bool) -> float:
        return self.head_b_all - self.head_b if last else 0.0

    def calls(self, m: int, first: bool, last: bool) -> tuple[float, int, float]:
        """(seconds, calls, their starts) in a step of `m` micro-batches on a rank holding the
        first stage, the last, or both."""
        n = m * (self.emb_calls * first + self.head_calls * last)
        logits = m * self.logits_calls * last
        secs = m * ((self.emb_f + self.emb_b if first else 0.0)
                    + (self.head_f + self.head_b_all if last else 0.0))
        return secs, n + logits, n * self.start + logits * self.logits_start


def end_collectives(lay: Layout, tp_one: float, start: float, head_wgrad_s: float,
                    impl: Implementation, logits: nccl.Call | None = None) -> EndCollectives:
    """The embedding's and the head's tp collectives for one micro-batch (`EndCollectives`);
    none without tp. `tp_one`: one all-reduce's worth of the micro-batch's activations;
    `start`: one call's start; `head_wgrad_s`: the head's weight-gradient GEMM; `logits`: the
    gather of the whole logits a gathered head (`tp_ends`) makes."""
    ends = ends_split(impl, lay)
    if lay.tp == 1 or not tp_one or ends == "whole":
        return EndCollectives()
    if lay.sp:  # each end an all-gather and a reduce-scatter, half an all-reduce each
        emb_f = emb_b = head_f = head_b = tp_one / 2
    else:
        emb_f, emb_b, head_f, head_b = tp_one, 0.0, 0.0, tp_one
    emb_calls = head_calls = 2 if lay.sp else 1
    if ends == "gathered":  # the table's slice taken, not reduce-scattered
        emb_f, emb_calls = 0.0, 1
    gathered = ends == "gathered" and logits is not None
    overlapped = impl.tp_overlap and impl.tp_overlap_backward
    exposed_b = _exposed(head_b, head_wgrad_s) if overlapped else head_b
    return EndCollectives(emb_f, emb_b, head_f + (logits.seconds if gathered else 0.0),
                          exposed_b, head_b, start, emb_calls, head_calls, int(gathered),
                          logits.start if gathered else 0.0)


def _pp_sends(m: int, rank: int, p: int, n_stages: int, hop: float, start: float) -> dict:
    """The pipeline rank `rank`'s sends in a step, reported as the collectives are ({"ops",
    "calls"}; empty without a pipeline): each of its stages sends its activation forward (but
    the last stage) and its input's gradient back (but the first), once per micro-batch; each
    takes `hop` seconds, of which `start` is the call's start."""
    if p <= 1:
        return {}
    stages = range(rank, n_stages, p)
    n = m * (sum(s < n_stages - 1 for s in stages) + sum(s > 0 for s in stages))
    return {"ops": {"sends": n * hop}, "calls": {"sends": {"calls": n, "fixed_s": n * start}}}


def tied_table_sync(shape: ModelShape, lay: Layout, cluster: Cluster,
                    dtype: str, protocols: str = "auto", grad_bytes: int | None = None,
                    impl: Implementation | None = None) -> nccl.Call:
    """Summing a tied token table's two gradients when the first and the last pipeline stage
    hold one copy each: after the backward, one all-reduce of the table's V/t x h gradient
    between those two ranks, (p - 1) stages apart, on the step's critical path (meshloom's
    parallel/pipeline.py `_sum_tied` over its "pp_ends" group; Megatron-Core's
    `_allreduce_embedding_grads` in finalize_model_grads), in the gradients' dtype unless
    `grad_bytes` says otherwise (DeepSpeed's BF16_Optimizer sums the fp32 copy, `_hp_grad`);
    the whole V x h where `impl` keeps the table whole on every tp rank (`tp_ends`). No call
    (0 s) otherwise."""
    if not shape.tied or lay.pp == 1:
        return nccl.Call(0.0, 0.0, "ring", "Simple")
    far = (lay.pp - 1) * lay.dp * lay.cp * lay.tp
    grad = shape.vocab / table_tp(impl, lay) * shape.hidden * (
        grad_bytes or precision(dtype).grad_bytes)
    return cluster.collective("all_reduce", grad, 2, far, protocols)


def _with_tied(pp: dict, tied: nccl.Call) -> dict:
    """The pipeline's detail with the tied table's all-reduce (`tied_table_sync`) added."""
    if not tied.seconds:
        return pp
    pp["exposed"] += tied.seconds
    pp.setdefault("ops", {})["tied_table_all_reduce"] = tied.seconds
    pp.setdefault("calls", {})["tied_table_all_reduce"] = {"calls": 1, "fixed_s": tied.start,
                                                           "nccl": tied.name}
    return pp


def _ep_calls(n: int, per_call: dict[str, tuple]) -> dict:
    """An MoE step's expert collectives ({"ops", "calls"}): `n` calls of each op in
    `per_call` (op -> seconds of one call, its start[, the NCCL pair it runs with]), the ops
    that take no time left out (no all-to-all at ep 1, no gather and scatter unless experts
    are split over tp). The all-to-all has no NCCL pair: NCCL's tuner does not price it."""
    used = {op: v for op, v in per_call.items() if n and v[0]}
    return {"ops": {op: n * v[0] for op, v in used.items()},
            "calls": {op: {"calls": n, "fixed_s": n * v[1]} | ({"nccl": v[2]} if v[2:] else {})
                      for op, v in used.items()}} if used else {}


def cp_ring_backward(cp: int, kv_bytes: float, e: int, link: float, latency: float,
                     step: float, scheme: str) -> float:
    """Exposed seconds of the ring's backward transfers, one block and micro-batch, each step's
    hidden behind `step` seconds of the ring's backward work. Step i sends the K/V block on
    (i < cp - 1, at e bytes an element) and the gradient accumulator of a block (i > 0).
    meshloom (parallel/context.py): the accumulator is fp32 and is the one of the block held
    at step i - 1, so the last one goes home after the last step, with nothing left to hide
    behind. TE (`AttnFuncWithCPAndKVP2P`): the accumulator is in the 16-bit dtype and each
    step's transfers end within that step."""
    acc = kv_bytes * 4 / e if scheme == "meshloom" else kv_bytes
    out = 0.0
    for i in range(cp):
        nbytes = (kv_bytes if i < cp - 1 else 0.0) + (acc if i > 0 else 0.0)
        sends = (i < cp - 1) + (i > 0)
        out += _exposed(nbytes / link + sends * latency, step)
    return out + (acc / link + latency if scheme == "meshloom" else 0.0)


def _exposed(comm: float, compute: float) -> float:
    """What a collective of `comm` seconds hidden behind `compute` seconds adds to the step:
    the part that does not fit, plus the slowdown of the compute it runs beside
    (hardware.OVERLAP_SLOWDOWN, a published average) over the overlapped time."""
    return max(0.0, comm - compute) + OVERLAP_SLOWDOWN * min(comm, compute)


def _cost_key(cost, n_stages: int, v: int) -> tuple:
    """The per-stage costs as a hashable key (so identical pipelines simulate once)."""
    kinds = ("F", "B", "I", "W")
    return tuple(round(cost(Action(k, st, 0)), 12) for st in range(n_stages) for k in kinds)


def _makespan(schedule: str, p: int, m: int, v: int, key: tuple, latency: float,
              cv: float = 0.0, blocking: bool = False, w_order: str = "filled") -> float:
    """Simulated step span. From 2p micro-batches on, a 1F1B-type schedule is in its steady
    state, where every further round of p micro-batches adds the same time: simulate 2p and 3p
    and extrapolate linearly (tests check this against direct simulation). `w_order`: where
    interleaved_zb's weight passes go (`pp_w_order`)."""
    step = p  # one round of micro-batches through every stage (interleaving needs m % p == 0)
    m1, m2 = 2 * p, 3 * p
    if m <= m2 or schedule == "gpipe" and m * p <= 2 * SIMULATE_LIMIT:
        return _simulate(schedule, p, m, v, key, latency, cv, blocking, w_order)
    if schedule == "gpipe":  # all forwards, then all backwards: linear in m from the start
        m1, m2 = step, 2 * step
    s1 = _simulate(schedule, p, m1, v, key, latency, cv, blocking, w_order)
    s2 = _simulate(schedule, p, m2, v, key, latency, cv, blocking, w_order)
    return s1 + (m - m1) * (s2 - s1) / (m2 - m1)


@lru_cache(maxsize=8192)
def _simulate(schedule: str, p: int, m: int, v: int, key: tuple, latency: float,
              cv: float = 0.0, blocking: bool = False, w_order: str = "filled") -> float:
    """Makespan of the schedule; with action_cv > 0 the mean over JITTER_SAMPLES runs in which
    every action's time is its nominal time times an independent normal factor (mean 1, sd cv,
    floored at JITTER_FLOOR), seeded, so the same inputs always give the same prediction."""
    kinds = ("F", "B", "I", "W")
    table = {(kinds[i % 4], i // 4): c for i, c in enumerate(key)}
    lists = build_schedule(schedule, p, m, v, w_order)
    if cv <= 0:
        return simulate(lists, lambda a: table[(a.kind, a.stage)], latency, blocking).makespan
    spans = []
    for seed in range(JITTER_SAMPLES):
        rng = random.Random(seed)
        factors = {a: max(JITTER_FLOOR, rng.gauss(1.0, cv)) for actions in lists for a in actions}
        spans.append(simulate(lists, _scaled(table, factors), latency, blocking).makespan)
    return sum(spans) / len(spans)


def _scaled(table: dict, factors: dict) -> Callable[[Action], float]:
    return lambda a: table[(a.kind, a.stage)] * factors[a]
