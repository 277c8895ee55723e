"""Flat, padded, evenly sharded parameter groups: the storage layout of every ZeRO stage.

A `FlatGroup` lays a list of same-dtype parameters end to end in one buffer whose length is padded
up to a multiple of the shard count N, so that collectives see N equal shards (Gloo's all-gather
and reduce-scatter need equal sizes). Rank r owns elements [r*S, (r+1)*S) with S = padded / N.
Padding is zeros, is never handed to the optimizer, and never enters a norm or a loss.

`pieces()` says which part of which parameter falls into this rank's shard; the sharded
optimizer works on those pieces (views of the shard), so AdamW's per-parameter settings (weight
decay on matrices only) stay exactly as without sharding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Piece:
    """Elements [param_lo, param_hi) of flattened parameter `index`, at shard_lo of the shard."""

    index: int
    param_lo: int
    param_hi: int
    shard_lo: int

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo


class FlatGroup:
    def __init__(self, names: list[str], params: list[nn.Parameter], n_shards: int, rank: int):
        if len({p.dtype for p in params}) != 1:
            raise ValueError("a flat group holds parameters of one dtype")
        self.names, self.params = names, params
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.n_shards, self.rank = n_shards, rank
        self.shard_size = -(-self.numel // n_shards)
        self.padded = self.shard_size * n_shards
        self.shard_lo = rank * self.shard_size
        self.dtype, self.device = params[0].dtype, params[0].device

    def new_flat(self, dtype: torch.dtype | None = None, *, empty: bool = False) -> torch.Tensor:
        """A whole flat buffer; `empty` skips zero-filling (for buffers `pack` will overwrite)."""
        make = torch.empty if empty else torch.zeros
        return make(self.padded, dtype=dtype or self.dtype, device=self.device)

    def new_shard(self, dtype: torch.dtype | None = None, device=None, *,
                  empty: bool = False) -> torch.Tensor:
        make = torch.empty if empty else torch.zeros
        return make(self.shard_size, dtype=dtype or self.dtype, device=device or self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's shape as a view into a full flat buffer."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes,
                                                          strict=True)]

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.shard_lo:self.shard_lo + self.shard_size]

    def pack(self, tensors: list[torch.Tensor | None], out: torch.Tensor) -> torch.Tensor:
        """Copy per-parameter tensors (e.g. gradients; None = zeros) into a flat buffer."""
        for o, n, t in zip(self.offsets, self.numels, tensors, strict=True):
            if t is None:
                out[o:o + n].zero_()
            else:
                out[o:o + n].copy_(t.reshape(-1))
        out[self.numel:].zero_()
        return out

    def pieces(self) -> list[Piece]:
        lo, hi = self.shard_lo, self.shard_lo + self.shard_size
        out = []
        for i, (o, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            a, b = max(lo, o), min(hi, o + n)
            if a < b:
                out.append(Piece(i, a - o, b - o, a - lo))
        return out

    def piece_views(self, shard: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        """This rank's pieces as views of a shard-sized tensor."""
        return [(pc, shard[pc.shard_lo:pc.shard_lo + pc.numel]) for pc in self.pieces()]


def group_parameters(named: list[tuple[str, nn.Parameter]], cap_bytes: int,
                     first_cap_bytes: int | None = None) -> list[list[tuple[str, nn.Parameter]]]:
    """Split parameters, in the given order, into consecutive groups of at most ~cap_bytes
    (a group is closed once it reaches the cap) and of one dtype and device each."""
    groups, current, size = [], [], 0
    limit = min(cap_bytes, first_cap_bytes or cap_bytes)
    for name, p in named:
        if current and (size >= limit or p.dtype != current[0][1].dtype
                        or p.device != current[0][1].device):
            groups.append(current)
            current, size, limit = [], 0, cap_bytes
        current.append((name, p))
        size += p.numel() * p.element_size()
    if current:
        groups.append(current)
    return groups
