"""Context parallel's ring attention, priced as the training code runs it (`cp_ring`).

With cp > 1 each rank holds s = seq/cp tokens of every sequence, load-balanced as two halves
(meshloom's zigzag chunks i and 2cp-1-i; TransformerEngine's the same), and the attention of
its queries against the whole sequence runs as cp ring steps, one kernel call each: step 0
causal over the s local tokens, every later step half that work (all queries against the
first half of an earlier rank's K/V, or the second half of the queries against all of a later
rank's). The rings differ in the kernel and in what they do around it:

- `meshloom` (parallel/context.py): PyTorch's FlashAttention op; each step's output merged
  into the rows' fp32 running output (cast, one in-place interpolation, a few passes over the
  rows' log-sum-exp); K/V stacked for the ring and, under grouped-query attention, copied out
  to every query head at each step. Backward: dq and each step's dK, dV made fp32, dK, dV
  summed back to their heads and added into the accumulator that travels with the block.
- `te` (TransformerEngine's `AttnFuncWithCPAndKVP2P`, Megatron-Core and NeMo): the output and
  the gradients kept in the 16-bit dtype, TE's jit-fused corrections of the output and its
  log-sum-exp.

Each call is priced at the table's rate for the square of its work (the geometric mean of the
query and key lengths); the passes over memory at the table's bandwidth, one launch each.
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


def ring_calls(s: int, cp: int) -> list[RingCall]:
    """The attention calls of one rank's ring, all steps, in either scheme: step 0 causal over
    the local s tokens, every later step one call of half that work (s queries against s/2
    keys, or s/2 against s: the same work, so the same price)."""
    return [RingCall(s, s, True), RingCall(s, s // 2, False, cp - 1)]


def _kernels_seconds(calls: list[RingCall], bh: float, d: int, direction: str, rates: Rates,
                     kernel: str) -> float:
    return sum(call.count * rates.attention(
        attention_flops(bh, call.q_len, call.kv_len, d, call.causal, direction), call.seq, d,
        call.causal, direction, kernel) for call in calls)


def _meshloom_rank_passes(me: int, cp: int, q_el: float, kv_el: float, rows: float, e: int,
                          gqa: bool) -> tuple[float, int, float, int]:
    """meshloom's ring outside its attention calls on cp rank `me` (parallel/context.py, the
    CUDA path: inputs in their 16-bit dtype e, fp32 running output and gradient
    accumulators): forward and backward (bytes, kernels) per block and micro-batch. Step 0
    covers every row and key; a step on an earlier rank's block every row against half the
    keys; on a later rank's half the rows against every key."""
    cast = 4 + e if e < 4 else 0  # between fp32 and the 16-bit dtype (none in fp32)
    casts = 1 if cast else 0
    kv2 = 2 * kv_el  # K and V
    # (row share, key share) of each step after the first
    steps = [(1.0, 0.5)] * me + [(0.5, 1.0)] * (cp - 1 - me)
    # forward: stack K, V; per step the K/V copies to every head; step 0's output made fp32;
    # per later step cast, interpolate, the rows' log-sum-exp; the output cast back.
    f = 2 * kv2 * e + 2 * cast * q_el
    fk = 1 + 2 * casts
    if gqa:
        f, fk = f + cp * 2 * (kv_el + q_el) * e, fk + 2 * cp
    for row, _ in steps:
        f += row * (q_el * (cast + 12) + rows * MERGE_LSE_BYTES)
        fk += casts + 1 + MERGE_LSE_KERNELS
    # backward: the output cast to e, stack K, V; per step the K/V copies, the rows' lse made
    # contiguous, dq (step 0's made fp32, later ones added), dK and dV made fp32, summed back to
    # their heads and stacked, then added into the travelling accumulator; the casts back.
    b = cast * q_el + 2 * kv2 * e + 2 * cast * q_el + cast * kv2
    bk = casts + 1 + 2 * casts + 2 * casts
    for i, (row, key) in enumerate([(1.0, 1.0)] + steps):
        if gqa:
            b, bk = b + 2 * (kv_el + q_el) * e, bk + 2
        b, bk = b + 8 * rows * row, bk + 1
        if i:
            b, bk = b + (8 + e) * q_el * row, bk + 1
        b, bk = b + 2 * cast * q_el * key, bk + 2 * casts
        if gqa:
            b, bk = b + 8 * q_el * key + 4 * kv2 * key, bk + 2
        b, bk = b + 16 * kv_el * key, bk + 1
        if i:
            b, bk = b + 12 * kv2 * key, bk + 1
    return f, fk, b, bk


def meshloom_passes(shape: ModelShape, lay: Layout, seq: int, e: int
                    ) -> tuple[float, int, float, int]:
    """(bytes, kernels) forward and backward of meshloom's ring outside its attention calls,
    per block and micro-batch, on the rank that moves the most."""
    ranks = [_meshloom_rank_passes(r, lay.cp, *_elements(shape, lay, seq), e,
                                   shape.kv_heads != shape.heads) for r in range(lay.cp)]
    return max(ranks, key=lambda x: x[0] + x[2])


def _elements(shape: ModelShape, lay: Layout, seq: int) -> tuple[float, float, float]:
    """This rank's output elements, K elements (and V's) and (query, head) rows, per block and
    micro-batch."""
    tokens = lay.micro_batch * (seq // lay.cp)
    return (tokens * shape.q_dim / lay.tp, tokens * shape.kv_dim / lay.tp,
            tokens * shape.heads / lay.tp)


def ring_cost(shape: ModelShape, lay: Layout, rates: Rates, seq: int, e: int, scheme: str,
              kernel: str) -> RingCost:
    """One block's ring attention (cp > 1), one micro-batch, as `scheme` runs it."""
    s = seq // lay.cp
    bh = lay.micro_batch * shape.heads / lay.tp
    calls = ring_calls(s, lay.cp)
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
    cp rank r, causal, no FP8 (transformer_engine/pytorch/attention.py, the class from line
    1302 in 1.10 and 1405 in 1.11, identical here but for FP8 arguments): forward and backward
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
    ranks = [_te_rank_passes(r, lay.cp, *_elements(shape, lay, seq), e, bshd, lay.micro_batch,
                             flash) for r in range(lay.cp)]
    return max(ranks, key=lambda x: x[0] + x[2])

