"""Context parallel: causal ring attention over the `cp` axis, with the zigzag split.

The sequence is cut into 2·cp chunks and rank i holds chunks i and 2·cp-1-i (`zigzag_indices`),
so that under the causal mask every rank has the same amount of work. Attention of the local
queries against the whole sequence runs as a ring: each of cp steps computes the local queries
against the K/V block currently held while that block travels on to the next rank
(asynchronous p2p, overlapping the compute). A step is one kernel call (`_step_block`): its own
block is plain causal attention over the 2 local chunks; an earlier rank's block is seen whole
through its first chunk by every local query; a later rank's is seen whole by the second local
chunk only. The call's output is merged into the rows' fp32 running output by the log-sum-exp
rule. On a CUDA GPU with 16-bit inputs the call is PyTorch's FlashAttention kernel, in the
inputs' dtype; on CPU PyTorch's fused CPU kernel, in fp32; elsewhere the block's scores are
formed in fp32. The backward pass sends K/V around the ring again, each step's transfer
overlapping that step's work, with an accumulator of their gradients that follows its block one
step behind and arrives back at its owner after cp steps.

Grouped-query attention: K/V travel with their own (fewer) heads and are expanded per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from meshloom import comm
from meshloom.config import Config, ModelDims
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.contract import name_pattern

AXIS = "cp"


def check_cp_config(cfg: Config, dims: ParallelDims,
                    model: ModelDims | None = None) -> str | None:
    """Why the sequence cannot take the zigzag split over cp (one line), or None."""
    seq_len = cfg.data.seq_len
    if dims.cp > 1 and seq_len % (2 * dims.cp):
        return f"data.seq_len={seq_len} must be divisible by 2 x parallel.cp = {2 * dims.cp}"
    return None


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Token positions held by cp rank `rank`: chunks rank and 2·cp-1-rank of 2·cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 x cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * c, (first + 1) * c),
                      torch.arange(second * c, (second + 1) * c)])


def attention_work(seq_len: int, cp: int, rank: int, zigzag: bool = True) -> int:
    """Unmasked (query, key) pairs of causal attention that cp rank `rank` computes: with the
    zigzag split, or with the naive split into cp contiguous slices."""
    if zigzag:
        pos = zigzag_indices(seq_len, cp, rank)
    else:
        n = seq_len // cp
        pos = torch.arange(rank * n, (rank + 1) * n)
    return int((pos + 1).sum())  # query at position t sees keys 0..t


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:  # a square block in causal order: the ordinary triangle
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _fused_cpu(q: torch.Tensor) -> bool:
    """CPU has a fused attention kernel that returns the log-sum-exp: it never builds a block's
    scores in memory."""
    return q.device.type == "cpu" and hasattr(torch.ops.aten,
                                              "_scaled_dot_product_flash_attention_for_cpu")


def _flash_usable(q: torch.Tensor) -> bool:
    """PyTorch's CUDA FlashAttention kernel takes 16-bit inputs with head widths up to 256 (a
    multiple of 8) on Ampere or newer, and returns each row's log-sum-exp."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and torch.backends.cuda.flash_sdp_enabled()
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def _kernel(q: torch.Tensor) -> str:
    """What computes a ring step's block: `flash` (CUDA, in the inputs' 16-bit dtype), `cpu`
    (PyTorch's fused CPU kernel, fp32) or `explicit` (its scores in memory, fp32: any other
    device or dtype)."""
    if _flash_usable(q):
        return "flash"
    return "cpu" if _fused_cpu(q) else "explicit"


def _flash_fwd(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                             scale=scale)
    return out[0], out[1]


def _flash_bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    # No dropout: the kernel reads no random state, so empty seed and offset tensors stand in.
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
        seed, offset, scale=scale)


def _attend(q, k, v, causal: bool, scale: float,
            kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one block: q [b, h, n_q, d] against k, v [b, h, n_k, d], causal only when
    square (a rank's own block)."""
    if kernel == "flash":
        return _flash_fwd(q, k, v, causal, scale)
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float()
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _attend_grads(do, q, k, v, out, lse, delta, causal: bool, scale: float, kernel: str):
    """(dq, dk, dv) of one block, given the rows' final output and log-sum-exp (so the
    block's probabilities are the exact ones of the whole row); the fused kernels compute
    `delta`, rowsum(dO * O), themselves."""
    if kernel == "flash":
        return _flash_bwd(do, q, k, v, out, lse, causal, scale)
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, scale=scale)
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta) * scale
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv


def _expand(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def _reduce_heads(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // n_rep, n_rep, s, d).sum(2)


class _Ring:
    """One ring pass: send this block to the next rank, receive the previous rank's."""

    def __init__(self, mesh: Mesh, tag_base: int):
        self.mesh = mesh
        ranks = mesh.group_ranks(AXIS)
        i, n = mesh.coord(AXIS), len(ranks)
        self.next, self.prev = ranks[(i + 1) % n], ranks[(i - 1) % n]
        self.tag = tag_base

    def start(self, t: torch.Tensor) -> tuple:
        buf = torch.empty_like(t)
        self.tag += 1
        send = comm.send(t, self.mesh, AXIS, self.next, self.tag)
        recv = comm.post_recv(buf, self.prev, self.tag)
        return send, recv, buf

    @staticmethod
    def finish(pending: tuple) -> torch.Tensor:
        send, recv, buf = pending
        recv.wait()
        send.wait()
        return buf


def _step_block(me: int, owner: int, c: int) -> tuple[slice, slice, bool]:
    """The one (query rows, key rows, causal?) block this rank computes against the K/V of
    `owner`: with the zigzag split, its own block is plain causal attention over its 2c local
    tokens; an earlier rank's first chunk is seen whole by all its queries; a later rank's
    two chunks are seen whole by its second chunk only (the first sees neither)."""
    whole, first, second = slice(0, 2 * c), slice(0, c), slice(c, 2 * c)
    if owner == me:
        return whole, whole, True
    return (whole, first, False) if owner < me else (second, whole, False)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mesh):
        cp, me = mesh.size(AXIS), mesh.coord(AXIS)
        d = q.shape[-1]
        c, n_rep, scale = q.shape[2] // 2, q.shape[1] // k.shape[1], d ** -0.5
        kernel = _kernel(q)
        # The CUDA kernel reads the 16-bit inputs as they are; the others work in fp32.
        low = kernel == "flash"
        qw = q if low else q.float()
        kv = torch.stack([k, v])
        ring = _Ring(mesh, 0)
        out = lse = None
        for step in range(cp):
            pending = ring.start(kv) if step < cp - 1 else None
            rows, cols, causal = _step_block(me, (me - step) % cp, c)
            kk, vv = _expand(kv[0], n_rep), _expand(kv[1], n_rep)
            if not low:
                kk, vv = kk.float(), vv.float()
            blk_out, blk_lse = _attend(qw[:, :, rows], kk[:, :, cols], vv[:, :, cols], causal,
                                       scale, kernel)
            if out is None:  # step 0 covers every row: the running output starts as its own
                out, lse = blk_out.float(), blk_lse.float()
            else:
                new_lse = torch.logaddexp(lse[:, :, rows], blk_lse)
                # The rows' old weight exp(lse - new) and the block's exp(blk_lse - new) sum
                # to 1, so one in-place interpolation merges them (one pass over the rows).
                out[:, :, rows].lerp_(blk_out.float(),
                                      torch.exp(blk_lse - new_lse).unsqueeze(-1))
                lse[:, :, rows] = new_lse
            if pending is not None:
                kv = _Ring.finish(pending)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh = mesh
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mesh = ctx.mesh
        cp, me = mesh.size(AXIS), mesh.coord(AXIS)
        d = q.shape[-1]
        c, n_rep, scale = q.shape[2] // 2, q.shape[1] // k.shape[1], d ** -0.5
        kernel = _kernel(q)
        if kernel == "flash":
            qw, do, ow, delta = q, dout.to(q.dtype), out.to(q.dtype), None
            kv = torch.stack([k, v])
        else:
            qw, do, ow = q.float(), dout.float(), out
            delta = (do * out).sum(-1, keepdim=True)  # rowsum(dO * O)
            kv = torch.stack([k, v]).float()
        kv_ring, acc_ring = _Ring(mesh, 1 << 16), _Ring(mesh, 1 << 17)
        dq = acc_pending = None
        for step in range(cp):
            # The next step's K/V travel while this step computes; so does the gradient
            # accumulator of the block held now, which the previous rank sent after its step.
            kv_pending = kv_ring.start(kv) if step < cp - 1 else None
            rows, cols, causal = _step_block(me, (me - step) % cp, c)
            kk, vv = _expand(kv[0], n_rep), _expand(kv[1], n_rep)
            gq, gk, gv = _attend_grads(do[:, :, rows], qw[:, :, rows], kk[:, :, cols],
                                       vv[:, :, cols], ow[:, :, rows], lse[:, :, rows],
                                       None if delta is None else delta[:, :, rows], causal,
                                       scale, kernel)
            if dq is None:  # step 0's rows are all of them; dq takes q's layout
                dq = torch.empty_like(q, dtype=torch.float32).copy_(gq)
            else:
                dq[:, :, rows].add_(gq)
            mine = torch.stack([_reduce_heads(gk.float(), n_rep),
                                _reduce_heads(gv.float(), n_rep)])
            if acc_pending is None:  # step 0: this rank's own block, every key row
                acc = mine
            else:
                acc = _Ring.finish(acc_pending)
                acc[:, :, :, cols].add_(mine)
            # The accumulator moves on with its block; after the last step it is back home.
            acc_pending = acc_ring.start(acc)
            if kv_pending is not None:
                kv = _Ring.finish(kv_pending)
        dkv = _Ring.finish(acc_pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mesh: Mesh) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries [b, h, 2c, d] against the whole sequence,
    with K/V [b, h_kv, 2c, d] exchanged around the cp ring. Equals the matching rows of full
    causal attention."""
    if mesh.size(AXIS) == 1:
        raise ValueError("ring_attention needs parallel.cp > 1")
    if not dist.is_initialized():
        raise RuntimeError("ring_attention needs an initialised process group")
    return _RingAttention.apply(q, k, v, mesh)


class ContextParallel:
    """Applies context parallel to a model's attention modules (those its `pieces().attention`
    pattern names, else every module with a `core`): each one's `core` becomes ring attention;
    the training loop feeds every cp rank its zigzag slice of the tokens and targets, with
    their absolute positions (RoPE and learned positions follow the split)."""

    def __init__(self, model: nn.Module, mesh: Mesh):
        self.mesh, self.cp, self.rank = mesh, mesh.size(AXIS), mesh.coord(AXIS)
        pattern = model.pieces().attention if hasattr(model, "pieces") else None
        if pattern:
            rx = name_pattern(pattern)
            self.attentions = [m for n, m in model.named_modules() if rx.match(n)]
        else:
            # The class defines `core`: a wrapper that forwards attribute reads to the module it
            # wraps (activation checkpointing's) is not a second attention.
            self.attentions = [m for m in model.modules()
                               if callable(getattr(type(m), "core", None))]
        if not self.attentions:
            raise ValueError("context parallel found no attention module "
                             + (f"named {pattern!r}" if pattern else "with a `core`"))
        bare = [type(m).__name__ for m in self.attentions if not callable(getattr(m, "core", None))]
        if bare:
            raise ValueError(f"context parallel: {bare[0]} (pattern {pattern!r}) has no "
                             "core(q, k, v) to replace with ring attention")
        for m in self.attentions:
            m.core = lambda q, k, v: ring_attention(q, k, v, mesh)

    def local(self, x: torch.Tensor, y: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens, targets and positions of a batch of whole sequences."""
        idx = zigzag_indices(x.shape[1], self.cp, self.rank)
        return x[:, idx], y[:, idx], idx.to(x.device)

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Plain attention on whole sequences (generation: every cp rank holds all weights)."""
        for m in self.attentions:
            del m.core  # back to the class's plain causal attention
        try:
            yield
        finally:
            for m in self.attentions:
                m.core = lambda q, k, v: ring_attention(q, k, v, self.mesh)


class PlainAttention(nn.Module):
    """A context-parallel model seen as a plain one, for sampling on every cp rank."""

    def __init__(self, model: nn.Module, cp: ContextParallel):
        super().__init__()
        self.model, self.cp = model, cp
        self.cfg = getattr(model, "cfg", None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with self.cp.off():
            return self.model(tokens)
