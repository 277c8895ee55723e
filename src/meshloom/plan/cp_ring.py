"""Context parallel's ring attention, priced as the training code runs it (`cp_ring`).

With cp > 1 each rank holds s = seq/cp tokens of every sequence, load-balanced as two halves
(meshloom's zigzag chunks i and 2cp-1-i; TransformerEngine's the same), and the attention of
its queries against the whole sequence runs as cp ring steps. What a step costs depends on
how the implementation cuts the work into kernel calls and merges the partial results:

- `meshloom` (parallel/context.py): every (query chunk, key chunk) pair the causal mask
  leaves anything of is one FlashAttention call on c = s/2 queries and c keys: per rank the
  two diagonal pairs causal, the other 2cp-1 whole. Each call's output is merged into the
  rows' fp32 running output (cast, one in-place interpolation, a few passes over the rows'
  log-sum-exp). K/V are stacked for the ring and, under grouped-query attention, copied out
  to every query head at each step. Backward: per pair one FlashAttention backward, its
  gradients added into fp32 accumulators; per step the K/V gradients summed back to their own
  heads and added into the accumulator that travels with the block.
- `te` (TransformerEngine's `AttnFuncWithCPAndKVP2P`, Megatron-Core and NeMo): per step one
  call over the local sequence (step 0, causal) or over half of it (later steps: all queries
  against the first half of the received keys, or the second half of the queries against
  all of them), with TE's jit-fused corrections of the output and its log-sum-exp.

Each kernel call is priced at the table's rate for its own length (the geometric mean of the
query and key lengths for an unequal pair, which has the work of that square); the passes
over memory at the table's bandwidth, with one launch each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshloom.plan.kernel_table import attention_flops

if TYPE_CHECKING:
    from meshloom.plan.compute import Rates
    from meshloom.plan.layout import Layout
    from meshloom.plan.models import ModelShape

CP_RINGS = ("meshloom", "te")
# Passes over one row's fp32 log-sum-exp per merged block, meshloom's ring: logaddexp (read
# 8, write 4), the block's weight exp(blk - new) as a subtraction and an exp (12 + 8), read
# again by the interpolation (4), and the row's new value written back (read 4, write 4):
# 44 bytes in 4 kernels.
MERGE_LSE_BYTES, MERGE_LSE_KERNELS = 44.0, 4


@dataclass(frozen=True)
class RingCall:
    """`count` attention calls of q_len queries against kv_len keys per (sequence, head)."""
    q_len: int
    kv_len: int
    causal: bool
    count: int = 1

    @property
    def seq(self) -> int:
        """The square length with the same work per head, whose rate prices the call."""
        return round(math.sqrt(self.q_len * self.kv_len))


@dataclass(frozen=True)
class RingCost:
    """One block's ring attention, one micro-batch: seconds of the attention kernels and of the
    ring's own passes over memory, forward and backward (without recompute)."""
    fwd_attention: float
    fwd_elementwise: float
    bwd_attention: float
    bwd_elementwise: float

    @property
    def fwd(self) -> float:
        return self.fwd_attention + self.fwd_elementwise

    @property
    def bwd(self) -> float:
        return self.bwd_attention + self.bwd_elementwise


def ring_calls(scheme: str, s: int, cp: int) -> list[RingCall]:
    """The attention calls of one rank's ring, all steps (the busiest rank's for `te`)."""
    c = s // 2
    if scheme == "meshloom":
        return [RingCall(c, c, True, 2), RingCall(c, c, False, 2 * cp - 1)]
    # te: step 0 causal over the local s; every later step one call of half the work.
    return [RingCall(s, s, True), RingCall(s, c, False, cp - 1)]


def _kernels_seconds(calls: list[RingCall], bh: float, d: int, direction: str, rates: Rates,
                     kernel: str) -> float:
    return sum(call.count * rates.attention(
        attention_flops(bh, call.q_len, call.kv_len, d, call.causal, direction), call.seq, d,
        call.causal, direction, kernel) for call in calls)


def meshloom_passes(shape: ModelShape, lay: Layout, seq: int, e: int
                    ) -> tuple[float, int, float, int]:
    """(bytes, kernels) forward and (bytes, kernels) backward of meshloom's ring outside the
    attention kernels, per block and micro-batch (parallel/context.py, the CUDA path: inputs
    in their 16-bit dtype e, fp32 running output and gradient accumulators)."""
    s, cp, t = seq // lay.cp, lay.cp, lay.tp
    q_el = lay.micro_batch * s * shape.q_dim / t  # this rank's output elements
    kv_el = lay.micro_batch * s * shape.kv_dim / t  # of K (and of V)
    rows = lay.micro_batch * s * shape.heads / t
    blocks = 2 * cp + 1  # chunk pairs, each over half the rows
    gqa = shape.kv_heads != shape.heads
    cast = 4 + e if e < 4 else 0  # between fp32 and the 16-bit dtype (none in fp32)
    casts = 1 if cast else 0
    # forward: stack K, V; zero the output, fill the log-sum-exp; per step the K/V copies to
    # every head; per pair cast, interpolate, the rows' log-sum-exp; the output cast back.
    f_bytes = 2 * kv_el * 2 * e + 4 * q_el + 4 * rows + cast * q_el
    f_kernels = 1 + 2 + casts
    if gqa:
        f_bytes += cp * 2 * (kv_el + q_el) * e
        f_kernels += 2 * cp
    f_bytes += blocks * (q_el / 2 * (cast + 12) + rows / 2 * MERGE_LSE_BYTES)
    f_kernels += blocks * (casts + 1 + MERGE_LSE_KERNELS)
    # backward: the output cast to e, stack K, V, zero dq; per step the copies, zero the
    # step's fp32 K/V gradients (every head), sum them back to their heads, stack them and add
    # them to the travelling accumulator; per pair add dq, dk, dv into fp32; the casts back.
    b_bytes = cast * q_el + 2 * kv_el * 2 * e + 4 * q_el
    b_kernels = casts + 2
    per_step = 8 * q_el + 2 * kv_el * 8 + 2 * kv_el * 12
    b_kernels += cp * 3 + cp - 1
    if gqa:
        per_step += 2 * (kv_el + q_el) * e + 2 * q_el * 4 + 2 * kv_el * 4
        b_kernels += cp * 4
    b_bytes += cp * per_step - 2 * kv_el * 12  # the first step's accumulator is not added
    b_bytes += blocks * (3 * q_el / 2 * (8 + e) + rows / 2 * 8)
    b_kernels += blocks * 4
    b_bytes += cast * (q_el + 2 * kv_el)
    b_kernels += 3 * casts
    return f_bytes, f_kernels, b_bytes, b_kernels


def ring_cost(shape: ModelShape, lay: Layout, rates: Rates, seq: int, e: int, scheme: str,
              kernel: str) -> RingCost:
    """One block's ring attention (cp > 1), one micro-batch, as `scheme` runs it."""
    s = seq // lay.cp
    bh = lay.micro_batch * shape.heads / lay.tp
    calls = ring_calls(scheme, s, lay.cp)
    fa = _kernels_seconds(calls, bh, shape.head_dim, "fwd", rates, kernel)
    ba = _kernels_seconds(calls, bh, shape.head_dim, "bwd", rates, kernel)
    if scheme == "meshloom":
        fb, fk, bb, bk = meshloom_passes(shape, lay, seq, e)
    else:  # Megatron's sequence-first tensors reach the ring batch-first under FlashAttention
        flash = kernel != "cudnn"
        fb, fk, bb, bk = te_passes(shape, lay, seq, e, bshd=flash, flash=flash)
    return RingCost(fa, rates.stream(fb, fk), ba, rates.stream(bb, bk))



def _te_rank_passes(r: int, cp: int, q_el: float, kv_el: float, rows: float, e: int,
                    bshd: bool, batch: int, flash: bool) -> tuple[float, int, float, int]:
    """TransformerEngine 1.10/1.11's `AttnFuncWithCPAndKVP2P` outside its attention calls on
    cp rank r, causal, no FP8 (attention.py, the counts of docs/plan.md): forward and backward
    (bytes, kernels). K/V, the output and every gradient stay in the 16-bit dtype e; the
    running log-sum-exp is fp64. `bshd`: the class sees batch-first tensors (the
    FlashAttention backend converts Megatron's sequence-first ones), whose halves are copied
    out unless batch is 1; the cuDNN backend keeps sequence-first ones, whose halves are
    views. `flash`: FlashAttention's backward zeroes each step's dq first; cuDNN's
    concatenates each step's dK and dV."""
    kv2 = 2 * kv_el  # K and V
    q_copies = bshd and batch > 1
    # forward: the send buffer, the zeroed output, the lse made fp64 (clone, cast), per step
    # its correction and the output's (all rows through step r, half of them after), the lse
    # back to fp32, and the per-step cu_seqlens arithmetic.
    f = 2 * kv2 * e + q_el * e + 20 * rows + 12 * rows
    fk = 1 + 1 + 2 + 1 + (2 * cp + 2)
    f += 3 * q_el * e + 8 * rows  # step 0's output correction
    fk += cp + (cp - 1)
    for i in range(1, cp):
        if i <= r:  # all queries against the first half of the received K/V
            f += 20 * rows + 3 * q_el * e + 8 * rows
            if bshd:
                f, fk = f + kv2 * e, fk + 1  # that half copied out (read, write)
        else:  # the second half of the queries against all of it
            f += 10 * rows + 1.5 * q_el * e + 6 * rows
            if q_copies:
                f, fk = f + q_el * e, fk + 1
    # backward: half the lse copied in fp32, K/V copied into the ring buffer; step i redoes
    # forward step cp - 1 - i, then accumulates dq and, with the received accumulator, dK/dV
    # in the 16-bit dtype.
    b = 4 * rows + 2 * kv2 * e
    bk = 2
    for i in range(cp):
        diag, half_kv = i == cp - 1, i >= cp - r - 1
        kv_part = 1.0 if diag or not half_kv else 0.5  # of the K/V the step's call reads
        if half_kv and not diag and bshd:
            b, bk = b + kv2 * e, bk + 1
        if not half_kv and q_copies:  # q, out and dout halves copied out
            b, bk = b + 3 * q_el * e, bk + 3
        if flash:  # dq of the step's queries zeroed
            b, bk = b + (q_el if half_kv else q_el / 2) * e, bk + 1
        else:  # dK, dV concatenated
            b, bk = b + 2 * kv_part * kv2 * e, bk + 1
        # dq: add (read 2, write 1) or copy (read, write), on all rows or the second half
        if i > cp - r - 1:
            b, bk = b + 3 * q_el * e, bk + 1
        elif i == cp - r - 1:
            b, bk = (b + 2 * q_el * e, bk + 1) if r == cp - 1 else (b + 2.5 * q_el * e, bk + 2)
        elif i > 0:
            b, bk = b + 1.5 * q_el * e, bk + 1
        else:
            b, bk = b + q_el * e, bk + 1
        # dK/dV into the accumulator received from the next rank
        if diag:
            b, bk = (b + 2.5 * kv2 * e, bk + 2) if r == 0 else (b + 3 * kv2 * e, bk + 1)
        elif half_kv:
            b, bk = b + (kv2 * e if i == 0 and r == cp - 1 else 1.5 * kv2 * e), bk + 1
        else:
            b, bk = b + (2 * kv2 * e if i == 0 else 3 * kv2 * e), bk + 1
    return f, fk, b, bk


def te_passes(shape: ModelShape, lay: Layout, seq: int, e: int, bshd: bool, flash: bool
              ) -> tuple[float, int, float, int]:
    """(bytes, kernels) forward and backward of TransformerEngine's ring outside its attention
    calls, per block and micro-batch, on the rank that moves the most."""
    s, t = seq // lay.cp, lay.tp
    q_el = lay.micro_batch * s * shape.q_dim / t
    kv_el = lay.micro_batch * s * shape.kv_dim / t
    rows = lay.micro_batch * s * shape.heads / t
    ranks = [_te_rank_passes(r, lay.cp, q_el, kv_el, rows, e, bshd, lay.micro_batch, flash)
             for r in range(lay.cp)]
    return max(ranks, key=lambda x: x[0] + x[2])

