"""Tensor-parallel layers over the `tp` axis (Megatron-style), built on comm's autograd pairs.

Each layer is made from the plain module it replaces (`from_module`), keeping only this rank's
slice of the weight, so initialisation stays that of the unsharded model whatever the layout.
- ColumnParallelLinear: output features split. Input enters through `copy_to_group` (identity
  forward, gradient all-reduce backward), or, with sequence parallel, through `gather_seq`
  (all-gather of the sequence-split activations, reduce-scatter of their gradient).
- RowParallelLinear: input features split; the partial products are summed by
  `reduce_from_group` (all-reduce forward), or reduce-scattered along the sequence with sequence
  parallel.
- VocabParallelEmbedding: vocabulary split (padded up to a multiple of tp; padding rows are zero
  and never looked up); out-of-range ids are masked, then the partial lookups are summed.
- vocab_parallel_cross_entropy: the loss from vocabulary-split logits; no rank ever holds the
  whole logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshloom import comm
from meshloom.mesh import Mesh
from meshloom.placement import TPSplit, mark_sp_partial, set_tp_split

AXIS = "tp"


def _rows(weight: torch.Tensor, mesh: Mesh, padded: int | None = None) -> torch.Tensor:
    """This rank's block of rows (dim 0), after zero-padding dim 0 to `padded`."""
    if padded is not None and padded > weight.shape[0]:
        pad = weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])
        weight = torch.cat([weight, pad])
    return weight.chunk(mesh.size(AXIS), dim=0)[mesh.coord(AXIS)].clone()


def _tag(p: nn.Parameter, dim: int, global_shape, mesh: Mesh) -> nn.Parameter:
    """Record where this slice sits in the global parameter (checkpoints read it)."""
    set_tp_split(p, TPSplit(dim, tuple(global_shape), mesh.coord(AXIS) * p.shape[dim]))
    return p


def _input_entry(x: torch.Tensor, mesh: Mesh, sequence_parallel: bool) -> torch.Tensor:
    """Megatron's f operator: the activations entering a tensor-parallel region. Replicated input:
    identity forward, all-reduce of the gradient backward. Sequence-split input: all-gather of
    the sequence forward, reduce-scatter backward."""
    if sequence_parallel:
        return comm.gather_seq(x, mesh, AXIS, dim=1)
    return comm.copy_to_group(x, mesh, AXIS)


class ColumnParallelLinear(nn.Module):
    """Output features split. With `gather_input` the layer applies the region-entry operator
    to its input itself; without, the enclosing module has done it once for all of its column
    layers (q, k, v share one entry, so its gradient is reduced once, not three times)."""

    matmul = staticmethod(F.linear)  # a pipeline's zero-bubble schedule defers weight gradients

    def __init__(self, weight_shard: torch.Tensor, mesh: Mesh, *, sequence_parallel: bool = False,
                 gather_input: bool = True, bias_shard: torch.Tensor | None = None):
        super().__init__()
        self.mesh, self.sequence_parallel, self.gather_input = mesh, sequence_parallel, gather_input
        self.weight = nn.Parameter(weight_shard)
        self.bias = nn.Parameter(bias_shard) if bias_shard is not None else None

    @classmethod
    def from_module(cls, linear: nn.Linear, mesh: Mesh, *, sequence_parallel: bool = False,
                    padded_out: int | None = None, gather_input: bool = True
                    ) -> ColumnParallelLinear:
        n = mesh.size(AXIS)
        out = padded_out or linear.out_features
        if out % n:
            raise ValueError(f"{out} output features do not split over tp={n}")
        bias = None if linear.bias is None else _rows(linear.bias.detach(), mesh, padded_out)
        layer = cls(_rows(linear.weight.detach(), mesh, padded_out), mesh,
                    sequence_parallel=sequence_parallel, gather_input=gather_input,
                    bias_shard=bias)
        _tag(layer.weight, 0, linear.weight.shape, mesh)
        if layer.bias is not None:
            _tag(layer.bias, 0, linear.bias.shape, mesh)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            x = _input_entry(x, self.mesh, self.sequence_parallel)
        return self.matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split; the partial products are summed across tp (reduce-scattered along
    the sequence with sequence parallel). A bias is whole on every rank, added after the sum."""

    matmul = staticmethod(F.linear)

    def __init__(self, weight_shard: torch.Tensor, mesh: Mesh, *, sequence_parallel: bool = False,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.weight = nn.Parameter(weight_shard)
        self.bias = nn.Parameter(bias) if bias is not None else None
        if self.bias is not None:  # added to sequence-split outputs: a partial gradient per rank
            mark_sp_partial(self.bias)

    @classmethod
    def from_module(cls, linear: nn.Linear, mesh: Mesh, *,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        n = mesh.size(AXIS)
        if linear.in_features % n:
            raise ValueError(f"{linear.in_features} input features do not split over tp={n}")
        w = linear.weight.detach().chunk(n, dim=1)[mesh.coord(AXIS)].clone()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        layer = cls(w, mesh, sequence_parallel=sequence_parallel, bias=bias)
        _tag(layer.weight, 1, linear.weight.shape, mesh)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.matmul(x, self.weight, None)
        if self.sequence_parallel:
            out = comm.reduce_scatter_seq(partial, self.mesh, AXIS, dim=1)
        else:
            out = comm.reduce_from_group(partial, self.mesh, AXIS)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    backward_reads_weight = False  # its backward needs only the ids (ZeRO-3 skips a re-gather)

    def __init__(self, weight_shard: torch.Tensor, vocab_size: int, mesh: Mesh, *,
                 sequence_parallel: bool = False):
        super().__init__()
        self.mesh, self.vocab_size, self.sequence_parallel = mesh, vocab_size, sequence_parallel
        self.weight = nn.Parameter(weight_shard)
        self.lo = mesh.coord(AXIS) * weight_shard.shape[0]

    @classmethod
    def from_module(cls, emb: nn.Embedding, mesh: Mesh, *,
                    sequence_parallel: bool = False) -> VocabParallelEmbedding:
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise ValueError("VocabParallelEmbedding does not support max_norm, "
                             "scale_grad_by_freq or sparse embeddings")
        padded = padded_vocab(emb.num_embeddings, mesh.size(AXIS))
        layer = cls(_rows(emb.weight.detach(), mesh, padded), emb.num_embeddings, mesh,
                    sequence_parallel=sequence_parallel)
        if emb.padding_idx is not None:  # the rank holding that row keeps it gradient-free
            local = emb.padding_idx % emb.num_embeddings - layer.lo
            if 0 <= local < layer.weight.shape[0]:
                layer.padding_idx = local
        _tag(layer.weight, 0, emb.weight.shape, mesh)
        return layer

    padding_idx: int | None = None  # local row whose lookups give no gradient (nn.Embedding's)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight,
                          padding_idx=self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_seq(out, self.mesh, AXIS, dim=1)
        return comm.reduce_from_group(out, self.mesh, AXIS)


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


class _VocabParallelCE(torch.autograd.Function):
    """Memory: one fp32 tensor of the rank's logits, made by the up-cast and turned into the
    softmax in place, is all the forward allocates beside the 16-bit logits, and the backward
    writes the gradient straight in the logits' dtype beside it: 4 + e bytes a logit at either
    peak (plan/memory.py `logits_bytes`; tests/test_plan_loss_memory.py measures it)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, mesh):
        # logits: [N, V/tp] this rank's vocabulary slice; targets: [N] global ids. A copy
        # always, so that the caller's fp32 logits are never written.
        x = logits.to(torch.float32, copy=True)
        n_local = x.shape[-1]
        lo = mesh.coord(AXIS) * n_local
        if lo + n_local > vocab_size:  # padding columns (ids >= vocab_size) take no part
            x[:, max(vocab_size - lo, 0):] = float("-inf")
        m = x.max(dim=-1).values
        comm.all_reduce(m, mesh, AXIS, op=dist.ReduceOp.MAX, label="all_reduce_loss")
        local_t = targets - lo
        mine = (local_t >= 0) & (local_t < n_local)
        picked = x.gather(-1, local_t.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(mine, picked - m, torch.zeros_like(picked))
        comm.all_reduce(picked, mesh, AXIS, label="all_reduce_loss")
        softmax = x.sub_(m.unsqueeze(-1)).exp_()
        sum_exp = softmax.sum(dim=-1)
        comm.all_reduce(sum_exp, mesh, AXIS, label="all_reduce_loss")
        softmax.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, mine)
        ctx.grad_dtype = logits.dtype
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, mine = ctx.saved_tensors
        # d loss_i / d x_ij = g_i (softmax_ij - [j == t_i]): each element computed in fp32 and
        # rounded once into the logits' dtype, as an fp32 gradient cast afterwards would be.
        grad = torch.empty(softmax.shape, dtype=ctx.grad_dtype, device=softmax.device)
        torch.mul(softmax, g.unsqueeze(-1), out=grad)
        rows = torch.arange(grad.shape[0], device=grad.device)[mine]
        cols = local_t[mine]
        grad[rows, cols] = ((softmax[rows, cols] - 1.0) * g[rows]).to(grad.dtype)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 mesh: Mesh, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy from vocabulary-split logits [..., V/tp] and global target ids; as in
    F.cross_entropy, targets equal to `ignore_index` take no part (nor get a gradient)."""
    flat = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    rows = _VocabParallelCE.apply(flat, targets, vocab_size, mesh)
    keep = targets != ignore_index
    return torch.where(keep, rows, torch.zeros_like(rows)).sum() / keep.sum()
