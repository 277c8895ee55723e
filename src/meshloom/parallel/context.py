"""Context parallel: causal ring attention over the `cp` axis, with the zigzag split.

The sequence is cut into 2·cp chunks and rank i holds chunks i and 2·cp-1-i (`zigzag_indices`),
so that under the causal mask every rank has the same amount of work. Attention of the local
queries against the whole sequence runs as a ring: each of cp steps computes the local queries
against the K/V block currently held while that block travels on to the next rank
(asynchronous p2p, overlapping the compute), and the partial results are merged with the
log-sum-exp rule; chunk pairs that the mask hides entirely are skipped, and only the diagonal
pairs are masked. The backward pass sends K/V around the ring again,
with an accumulator of their gradients that arrives back at its owner after cp steps. No rank
ever holds the scores of the whole sequence: at most a (2 chunks x 2 chunks) block of them.

Grouped-query attention: K/V travel with their own (fewer) heads and are expanded per block.
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


def _chunks_of(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def _pairs(q_chunks, k_chunks, c):
    """The (query chunk, key chunk) sub-blocks the causal mask leaves anything of: (query
    rows, key rows, diagonal?) as slices; pairs with the key chunk later are skipped."""
    out = []
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(k_chunks):
            if kc <= qc:
                out.append((slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c), kc == qc))
    return out


def _scores(q, k, diagonal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:  # the causal triangle within one chunk
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _fused_cpu(q: torch.Tensor) -> bool:
    """CPU has a fused attention kernel that returns the log-sum-exp: it never builds a block's
    scores in memory (other devices use the explicit block below)."""
    return q.device.type == "cpu" and hasattr(torch.ops.aten,
                                              "_scaled_dot_product_flash_attention_for_cpu")


def _attend(q, k, v, diagonal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one sub-block: q [b, h, c, d] against k, v [b, h, c, d]."""
    if _fused_cpu(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, diagonal, scale=scale)
        return out.float(), lse.float()
    s = _scores(q, k, diagonal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _attend_grads(do, q, k, v, out, lse, delta, diagonal: bool, scale: float):
    """(dq, dk, dv) of one sub-block, given the rows' final output and log-sum-exp (so the
    block's probabilities are the exact ones of the whole row)."""
    if _fused_cpu(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, diagonal, scale=scale)
    s = _scores(q, k, diagonal, scale)
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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mesh):
        cp, me = mesh.size(AXIS), mesh.coord(AXIS)
        b, h, s2, d = q.shape
        c, n_rep, scale = s2 // 2, h // k.shape[1], d ** -0.5
        q_chunks = _chunks_of(me, cp)
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full((b, h, s2), float("-inf"), device=q.device)
        qf = q.float()
        kv = torch.stack([k, v])
        ring = _Ring(mesh, 0)
        for step in range(cp):
            pending = ring.start(kv) if step < cp - 1 else None
            owner = (me - step) % cp
            kk, vv = _expand(kv[0].float(), n_rep), _expand(kv[1].float(), n_rep)
            for rows, cols, diagonal in _pairs(q_chunks, _chunks_of(owner, cp), c):
                blk_out, blk_lse = _attend(qf[:, :, rows], kk[:, :, cols],
                                           vv[:, :, cols], diagonal, scale)
                new_lse = torch.logaddexp(lse[:, :, rows], blk_lse)
                w_old = torch.exp(lse[:, :, rows] - new_lse).unsqueeze(-1)
                w_new = torch.exp(blk_lse - new_lse).unsqueeze(-1)
                out[:, :, rows] = out[:, :, rows] * w_old + blk_out * w_new
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
        b, h, s2, d = q.shape
        c, n_rep, scale = s2 // 2, h // k.shape[1], d ** -0.5
        q_chunks = _chunks_of(me, cp)
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).float()
        dkv = torch.zeros_like(kv)
        ring = _Ring(mesh, 1 << 16)
        for step in range(cp):
            owner = (me - step) % cp
            kk, vv = _expand(kv[0], n_rep), _expand(kv[1], n_rep)
            dk, dv = torch.zeros_like(kk), torch.zeros_like(vv)
            for rows, cols, diagonal in _pairs(q_chunks, _chunks_of(owner, cp), c):
                gq, gk, gv = _attend_grads(do[:, :, rows], qf[:, :, rows], kk[:, :, cols],
                                           vv[:, :, cols], out[:, :, rows], lse[:, :, rows],
                                           delta[:, :, rows], diagonal, scale)
                dq[:, :, rows] += gq
                dk[:, :, cols] += gk
                dv[:, :, cols] += gv
            dkv = dkv + torch.stack([_reduce_heads(dk, n_rep), _reduce_heads(dv, n_rep)])
            # K/V move on for the next step; their gradient accumulator moves with them and,
            # after the last step, arrives back at its owner.
            pend_dkv = ring.start(dkv)
            pend_kv = ring.start(kv) if step < cp - 1 else None
            dkv = _Ring.finish(pend_dkv)
            if pend_kv is not None:
                kv = _Ring.finish(pend_kv)
        dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None


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
