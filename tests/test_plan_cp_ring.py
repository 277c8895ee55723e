"""The planner's context-parallel ring (plan/cp_ring.py) against meshloom's own ring attention
(parallel/context.py): its kernel calls, its memory traffic outside them, counted op by op on
real Gloo cp ranks, and its transfers; TransformerEngine's ring as its source runs it."""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch
from dist_harness import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from meshloom.plan import PlanError
from meshloom.plan.cp_ring import meshloom_passes, ring_calls
from meshloom.plan.hardware import make_cluster
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.models import PRESETS, from_dims
from meshloom.plan.search import search
from meshloom.plan.timing import cp_ring_backward

B, H, D = 2, 4, 8
# Ops that move no data: views are skipped by `is_view`; these allocate or read a scalar.
_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "detach", "alias", "lift_fresh",
               "_local_scalar_dense"}
_WRITE_ONLY = {"fill_", "zero_", "zeros_like", "zeros", "full", "full_like", "new_zeros"}


def _stored_bytes(t: torch.Tensor) -> int:
    """Bytes of memory a tensor reads from: a broadcast (stride 0) dimension reads nothing new."""
    return math.prod(n for n, st in zip(t.shape, t.stride(), strict=True) if st != 0) \
        * t.element_size()


class _Traffic(TorchDispatchMode):
    """Counts the kernels a region runs outside attention and communication, and the bytes
    each reads and writes."""

    def __init__(self):
        super().__init__()
        self.bytes, self.kernels = 0, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        base = func.name().split("::")[1].split(".")[0]
        if (func.namespace != "aten" or "scaled_dot_product" in base or func.is_view
                or base in _NO_TRAFFIC):
            return out
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(a, torch.Tensor)]
        outs = [a for a in torch.utils._pytree.tree_leaves(out) if isinstance(a, torch.Tensor)]
        if base in _WRITE_ONLY:
            ins = []
        elif base == "copy_":  # reads its source, writes its destination
            ins = ins[1:2]
        self.bytes += sum(map(_stored_bytes, ins)) + sum(map(_stored_bytes, outs))
        self.kernels[base] += 1
        return out


def _traffic_job(world, kv_heads, s2):
    """One layer's ring attention in bf16 through the CUDA path's code (CPU kernels standing
    in for FlashAttention's): (forward bytes, kernels, backward bytes, kernels)."""
    import torch.distributed as dist
    from test_ring_attention import _cpu_flash_bwd, _cpu_flash_fwd

    import meshloom.parallel.context as context
    from meshloom.comm import CommCounter
    from meshloom.mesh import Mesh, ParallelDims

    context._kernel = lambda q: "flash"
    context._flash_fwd, context._flash_bwd = _cpu_flash_fwd, _cpu_flash_bwd
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = Mesh(ParallelDims(cp=world), rank, "cpu", CommCounter())
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(B, H, s2, D, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(B, kv_heads, s2, D, generator=g).bfloat16().requires_grad_()
            for _ in range(2))
    fwd, bwd = _Traffic(), _Traffic()
    with fwd:
        out = context.ring_attention(q, k, v, mesh)
    grad = torch.randn(out.shape, generator=g).bfloat16()
    with bwd:
        out.backward(grad)
    return rank, (fwd.bytes, sum(fwd.kernels.values()), bwd.bytes, sum(bwd.kernels.values()))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_meshloom_ring_calls_are_the_planners(cp):
    """Every rank's ring makes the planner's calls: step 0 causal over its 2c local tokens,
    then one call of 2c queries against c keys per earlier rank and of c against 2c per
    later one (the same work, priced alike)."""
    from meshloom.parallel.context import _step_block

    c = 16
    for rank in range(cp):
        got = Counter()
        for step in range(cp):
            rows, cols, causal = _step_block(rank, (rank - step) % cp, c)
            got[(rows.stop - rows.start, cols.stop - cols.start, causal)] += 1
        assert got == Counter({(2 * c, 2 * c, True): 1, (2 * c, c, False): rank,
                               (c, 2 * c, False): cp - 1 - rank})
    assert [(x.q_len, x.kv_len, x.causal, x.count) for x in ring_calls(2 * c, cp)] == [
        (2 * c, 2 * c, True, 1), (2 * c, c, False, cp - 1)]


@pytest.mark.parametrize("world,kv_heads", [(2, 4), (2, 1), (4, 2)])
def test_meshloom_ring_passes_are_its_memory_traffic(world, kv_heads):
    """The bytes and kernels the planner prices for the ring outside its attention calls
    equal what meshloom's ring runs on each rank, counted op by op on real cp ranks (bf16,
    with and without grouped-query attention); the plan takes the rank that moves most."""
    from meshloom.plan.cp_ring import _meshloom_rank_passes

    s2 = 32
    shape = from_dims("llama", H * D, 2, H, 64, kv_heads=kv_heads)
    lay = Layout(cp=world, micro_batch=B)
    q_el, kv_el, rows = B * s2 * H * D, B * s2 * kv_heads * D, B * s2 * H
    want = {r: _meshloom_rank_passes(r, world, q_el, kv_el, rows, 2, kv_heads != H)
            for r in range(world)}
    got = dict(run_ranks(_traffic_job, world, world, kv_heads, s2))
    assert got == want
    assert meshloom_passes(shape, lay, s2 * world, 2) == max(
        want.values(), key=lambda x: x[0] + x[2])


def test_meshloom_ring_backward_sends_as_priced():
    """Backward moves what meshloom's Gloo record shows (tests/test_ring_attention.py):
    cp - 1 K/V blocks and cp gradient accumulators; only the last accumulator has no step to
    hide behind."""
    kv = 1000.0  # K and V of one block, fp32 (e = 4): the accumulator is as large
    for cp in (2, 4):
        assert cp_ring_backward(cp, kv, 4, 1.0, 0.0, 0.0, "meshloom") == pytest.approx(
            (cp - 1) * kv + cp * kv)
        # with long steps only the last accumulator waits (plus the overlap's slowdown)
        hidden = cp_ring_backward(cp, kv, 4, 1.0, 0.0, 1e9, "meshloom")
        assert kv < hidden < kv + 0.2 * (2 * cp - 1) * kv
    # bf16 K/V travel at 2 bytes an element, the accumulator at fp32's 4
    assert cp_ring_backward(2, kv, 2, 1.0, 0.0, 0.0, "meshloom") == pytest.approx(kv + 2 * 2 * kv)


def test_cp_ring_is_a_fix_key():
    assert parse_fix("cp_ring=te") == {"cp_ring": "te"}
    with pytest.raises(PlanError, match="cp_ring=ring must be one of meshloom, te"):
        parse_fix("cp_ring=ring")


def test_a_cp_plan_prices_meshlooms_ring():
    """On an H100 a cp = 2 plan of meshloom's ring pays for its merges (elementwise) and runs
    FlashAttention-2, where cp = 1 runs SDPA's cuDNN kernel; TE's ring on cuDNN's kernel,
    with its 16-bit fused corrections, is cheaper."""
    shape = PRESETS["llama3-8b"]
    cl = make_cluster("h100", 16)
    fixed = {"tp": 1, "pp": 1, "micro_batch": 1, "zero": 1, "recompute": "none"}
    one, two, te = (search(shape, cl, 16384, 64, {**fixed, "cp": cp, "dp": 16 // cp, **extra},
                           top=1)[0].timing
                    for cp, extra in ((1, {}), (2, {}),
                                      (2, {"cp_ring": "te", "attention_kernel": "cudnn"})))
    c1, c2, ct = (t.detail["compute_s"] for t in (one, two, te))
    assert c2["elementwise"] > c1["elementwise"] and c2["attention"] > c1["attention"]
    assert te.step_time_s < two.step_time_s
    assert "attention: fa2, meshloom's ring" in two.detail["rates"]
    assert "attention: cudnn, te's ring" in te.detail["rates"]
    assert "cudnn, SDPA's pick" in one.detail["rates"]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_rings_calls_cover_the_causal_work(cp):
    """The ring's calls (meshloom's and TransformerEngine's alike) compute each rank's causal
    share exactly once: s queries against the seq = cp * s keys they see, half masked."""
    from meshloom.plan.kernel_table import attention_flops

    s, bh, d = 64, 8, 16
    whole = attention_flops(bh, s, cp * s, d, True, "fwd")
    got = sum(c.count * attention_flops(bh, c.q_len, c.kv_len, d, c.causal, "fwd")
              for c in ring_calls(s, cp))
    assert got == pytest.approx(whole, rel=1e-12)


def test_te_ring_passes_by_hand():
    """TransformerEngine's ring at cp 2, per rank, from its attention.py (docs/plan.md):
    forward rank 0 moves 13 output and 8 K-sized element-bytes per element at bf16 with
    batch-first halves copied out (the helper's count, 13 E_o + 8 E_kv), rank 1 14 and 12;
    sequence-first (cuDNN's backend) drops the copies. The rank that moves most sets it."""
    from meshloom.plan.cp_ring import _te_rank_passes, te_passes

    Q, K, R, e = 1000.0, 250.0, 10.0, 2
    r0 = _te_rank_passes(0, 2, Q, K, R, e, bshd=True, batch=2, flash=False)
    r1 = _te_rank_passes(1, 2, Q, K, R, e, bshd=True, batch=2, flash=False)
    assert r0[0] == 13 * Q + 8 * K + 56 * R and r1[0] == 14 * Q + 12 * K + 68 * R
    s0 = _te_rank_passes(0, 2, Q, K, R, e, bshd=False, batch=2, flash=False)
    s1 = _te_rank_passes(1, 2, Q, K, R, e, bshd=False, batch=2, flash=False)
    assert s0[0] == 11 * Q + 8 * K + 56 * R and s1[0] == 14 * Q + 8 * K + 68 * R
    # backward, sequence-first: rank 0 copies dq's second half then adds (2 + 5 Q), copies
    # and adds dK/dV (8 + 10 K) beside the K/V copy into the ring buffer (8 K) and two
    # concatenations (8 + 8 K); rank 1 copies and adds dq whole (4 + 6 Q), dK/dV (4 + 12 K)
    assert s0[2] == 7 * Q + 42 * K + 4 * R and s1[2] == 10 * Q + 36 * K + 4 * R
    shape = from_dims("llama", 64, 2, 4, 64, kv_heads=1)
    lay = Layout(cp=2, micro_batch=2)
    q_el, kv_el, rows = 2 * 32 * 64, 2 * 32 * 16, 2 * 32 * 4
    got = te_passes(shape, lay, 64, 2, bshd=False, flash=False)
    ranks = [_te_rank_passes(r, 2, q_el, kv_el, rows, 2, False, 2, False) for r in (0, 1)]
    assert got == max(ranks, key=lambda x: x[0] + x[2])
