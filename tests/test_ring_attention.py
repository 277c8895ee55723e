"""Ring attention alone: forward output and input gradients equal full causal attention (fp32)
for cp 2 and 4, with and without grouped-query attention, through each of its kernel paths
(CPU's fused kernel, explicit scores, and the CUDA path's code with CPU kernels standing in);
the CUDA kernels' calls as the ring makes them; the zigzag split; the bytes moved."""

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


def _cpu_flash_fwd(q, k, v, diagonal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, diagonal, scale=scale)
    return out, lse


def _cpu_flash_bwd(do, q, k, v, out, lse, diagonal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse.contiguous(), 0.0, diagonal, scale=scale)


def _job(world, kv_heads, path="cpu"):
    import meshloom.parallel.context as context

    if path == "explicit":  # scores formed per block (devices without a fused kernel)
        context._fused_cpu = lambda q: False
    elif path == "flash":  # the CUDA path's code: inputs kept in their dtype, the kernel's
        # own delta, with CPU's fused kernels standing in for the CUDA ones
        context._kernel = lambda q: "flash"
        context._flash_fwd, context._flash_bwd = _cpu_flash_fwd, _cpu_flash_bwd
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


@pytest.mark.parametrize("world,kv_heads,path", [
    (2, 4, "cpu"), (2, 2, "cpu"), (4, 4, "cpu"), (4, 1, "cpu"), (2, 2, "explicit"),
    (4, 1, "explicit"), (2, 2, "flash"), (4, 1, "flash")])
def test_ring_attention_equals_full_causal_attention(world, kv_heads, path):
    for r in run_ranks(_job, world, world, kv_heads, path):
        for key in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(r[key], r[f"{key}_ref"], rtol=1e-5, atol=1e-5, msg=key)
        # Forward: cp-1 K/V block exchanges; backward: cp-1 K/V and cp gradient exchanges,
        # each block [2, b, h_kv, 2c, d] fp32.
        block = 2 * B * kv_heads * (S // world) * D * 4
        assert r["calls"][("cp", "send")] == (world - 1) + (world - 1) + world
        assert r["bytes"][("cp", "send")] == r["calls"][("cp", "send")] * block


def test_cuda_kernel_calls_take_the_ring_blocks():
    """The CUDA FlashAttention calls as the ring makes them, on meta tensors (shapes and dtypes
    only), for each kind of step: the block's output in bf16 with each row's fp32
    log-sum-exp, and its backward from the merged rows' output and their slice of the
    log-sum-exp (not contiguous)."""
    from meshloom.parallel.context import _flash_bwd, _flash_fwd, _step_block

    b, h, c, d = 2, 4, 16, 64
    q, k, v = (torch.empty(b, h, 2 * c, d, dtype=torch.bfloat16, device="meta")
               for _ in range(3))
    whole_lse = torch.empty(b, h, 2 * c, device="meta")
    for owner in (0, 1, 2):  # rank 1's own block, an earlier rank's, a later rank's
        rows, cols, causal = _step_block(1, owner, c)
        n_q, n_k = rows.stop - rows.start, cols.stop - cols.start
        out, lse = _flash_fwd(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, d ** -0.5)
        assert out.shape == (b, h, n_q, d) and out.dtype == torch.bfloat16
        assert lse.shape == (b, h, n_q) and lse.dtype == torch.float32
        grads = _flash_bwd(out, q[:, :, rows], k[:, :, cols], v[:, :, cols], out,
                           whole_lse[:, :, rows], causal, d ** -0.5)
        assert [g.shape for g in grads] == [(b, h, n_q, d), (b, h, n_k, d), (b, h, n_k, d)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_each_step_is_the_chunk_pairs_the_mask_leaves(cp):
    """A ring step's one block leaves out nothing the causal mask lets a local query see,
    computes nothing it hides, and is masked exactly when it is the rank's own block (whose
    two chunks the local order keeps in causal order, so the mask is the ordinary one)."""
    from meshloom.parallel.context import _step_block

    c = 4
    for rank in range(cp):
        mine = zigzag_indices(2 * cp * c, cp, rank)
        for owner in range(cp):
            theirs = zigzag_indices(2 * cp * c, cp, owner)
            rows, cols, causal = _step_block(rank, owner, c)
            seen = mine.unsqueeze(1) >= theirs.unsqueeze(0)  # query position >= key position
            inside = torch.zeros_like(seen)
            inside[rows, cols] = True
            assert not (seen & ~inside).any()  # nothing visible is left out
            block = seen[rows, cols]
            assert causal == (owner == rank)
            if causal:
                assert torch.equal(block, torch.ones_like(block).tril())
            else:
                assert block.all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_block_kernels_match_explicit_attention():
    """One ring block on the GPU: FlashAttention's output, log-sum-exp and gradients (bf16)
    against the explicit fp32 computation, diagonal (masked) and off-diagonal."""
    from meshloom.parallel.context import _attend, _attend_grads, _kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 128, 64, device="cuda", generator=g, dtype=torch.bfloat16)
                   for _ in range(4))
    assert _kernel(q) == "flash"
    scale = 64 ** -0.5
    for diagonal in (True, False):
        out, lse = _attend(q, k, v, diagonal, scale, "flash")
        ref, ref_lse = _attend(q.float(), k.float(), v.float(), diagonal, scale, "explicit")
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-2, atol=1e-2)
        delta = (do.float() * out.float()).sum(-1, keepdim=True)
        got = _attend_grads(do, q, k, v, out, lse, None, diagonal, scale, "flash")
        want = _attend_grads(do.float(), q.float(), k.float(), v.float(), out.float(), lse,
                             delta, diagonal, scale, "explicit")
        for a, w in zip(got, want, strict=True):
            torch.testing.assert_close(a.float(), w, rtol=5e-2, atol=5e-2)


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
