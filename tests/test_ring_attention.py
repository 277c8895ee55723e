"""Ring attention alone: forward output and input gradients equal full causal attention (fp32)
for cp 2 and 4, with and without grouped-query attention; the zigzag split; the bytes moved."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_ranks

from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims
from meshloom.parallel.context import attention_work, ring_attention, zigzag_indices

B, H, S, D = 2, 4, 32, 8


def _job(world, kv_heads, fused=True):
    if not fused:  # the explicit per-block path (what non-CPU devices run)
        import meshloom.parallel.context as context

        context._fused_cpu = lambda q: False
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = Mesh(ParallelDims(cp=world), rank, "cpu", CommCounter())
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g, requires_grad=True)
    k = torch.randn(B, kv_heads, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, kv_heads, S, D, generator=g, requires_grad=True)
    r = torch.randn(B, H, S, D, generator=g)
    n_rep = H // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, 1),
                                         v.repeat_interleave(n_rep, 1), is_causal=True)
    (ref * r).sum().backward()
    idx = zigzag_indices(S, world, rank)
    ql, kl, vl = (t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, mesh)
    (out * r[:, :, idx]).sum().backward()
    return {"out": out.detach(), "out_ref": ref.detach()[:, :, idx],
            "dq": ql.grad, "dq_ref": q.grad[:, :, idx], "dk": kl.grad, "dk_ref": k.grad[:, :, idx],
            "dv": vl.grad, "dv_ref": v.grad[:, :, idx], "bytes": dict(mesh.counter.bytes),
            "calls": dict(mesh.counter.calls)}


@pytest.mark.parametrize("world,kv_heads,fused", [(2, 4, True), (2, 2, True), (4, 4, True),
                                                   (4, 1, True), (2, 2, False), (4, 1, False)])
def test_ring_attention_equals_full_causal_attention(world, kv_heads, fused):
    for r in run_ranks(_job, world, world, kv_heads, fused):
        for key in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(r[key], r[f"{key}_ref"], rtol=1e-5, atol=1e-5, msg=key)
        # Forward: cp-1 K/V block exchanges; backward: cp-1 K/V and cp gradient exchanges,
        # each block [2, b, h_kv, 2c, d] fp32.
        block = 2 * B * kv_heads * (S // world) * D * 4
        assert r["calls"][("cp", "send")] == (world - 1) + (world - 1) + world
        assert r["bytes"][("cp", "send")] == r["calls"][("cp", "send")] * block


def test_zigzag_split():
    assert zigzag_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([zigzag_indices(24, 3, r) for r in range(3)]).sort().values
    assert every.tolist() == list(range(24))
    with pytest.raises(ValueError, match="divisible by 2 x cp = 4"):
        zigzag_indices(10, 2, 0)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work(cp):
    """Per-rank attention work (unmasked score entries): max/min <= 1.1 with the zigzag split;
    the naive contiguous split gives the last rank about 2cp-1 times the first's."""
    seq = 64 * cp
    zig = [attention_work(seq, cp, r) for r in range(cp)]
    naive = [attention_work(seq, cp, r, zigzag=False) for r in range(cp)]
    assert sum(zig) == sum(naive) == seq * (seq + 1) // 2
    assert max(zig) / min(zig) <= 1.1
    assert max(naive) / min(naive) > 2 * cp - 1.5  # e.g. ~3 at cp 2, ~15 at cp 8
