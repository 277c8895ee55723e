"""Synthetic click-through data, a pure function of (seed, step).

Each sample has one id per categorical feature (table) and a few dense features. Ids follow a
Zipf-like law (a few ids are very frequent, most are rare, as in real logs): a popularity rank r
is drawn log-uniformly, P(r) ~ 1/(r+1), then mapped to an id through a fixed random permutation,
so popular ids are spread over the id range (which keeps row-sharded servers evenly loaded).
Labels come from a hidden logistic model: one weight per (table, id) plus a linear term in the
dense features. Frequent ids' weights are learnable within a few dozen steps, so the loss falls
visibly from log(2)-ish.

Every trainer generates the same global batch and keeps its own slice, so the data of a run do not
depend on how many trainers there are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshloom.ps.config import PSConfig

LOGIT_SCALE = 2.0  # strength of the hidden model's signal (larger: easier to learn)


@dataclass
class Batch:
    ids: torch.Tensor  # (n, tables) int64
    dense: torch.Tensor  # (n, dense_features) float32
    labels: torch.Tensor  # (n,) float32, 0 or 1

    def part(self, index: int, parts: int) -> Batch:
        """Slice `index` of `parts` equal slices (a trainer's share of the global batch)."""
        n = self.labels.shape[0] // parts
        s = slice(index * n, (index + 1) * n)
        return Batch(self.ids[s], self.dense[s], self.labels[s])


class ClickData:
    def __init__(self, cfg: PSConfig):
        m = cfg.model
        self.tables, self.rows, self.features = m.tables, m.rows, m.dense_features
        self.seed = cfg.train.seed
        g = torch.Generator().manual_seed(self.seed)
        self.id_of_rank = torch.stack([torch.randperm(m.rows, generator=g)
                                       for _ in range(m.tables)])
        self.rank_weight = torch.randn(m.tables, m.rows, generator=g)
        self.dense_weight = torch.randn(m.dense_features, generator=g)

    def batch(self, step: int, size: int) -> Batch:
        """The global batch of `step` (same for every process, every layout)."""
        g = torch.Generator().manual_seed((self.seed + 1) * 1_000_003 + step)
        u = torch.rand(size, self.tables, generator=g, dtype=torch.float64)
        # rows**u is log-uniform on [1, rows): rank k has probability log((k+2)/(k+1)) ~ 1/k.
        rank = (self.rows ** u).floor().long().sub_(1).clamp_(0, self.rows - 1)
        table = torch.arange(self.tables)
        ids = self.id_of_rank[table, rank]
        dense = torch.randn(size, self.features, generator=g)
        logit = self.rank_weight[table, rank].sum(1) / math.sqrt(self.tables)
        if self.features:
            logit = logit + dense @ self.dense_weight / math.sqrt(self.features)
        p = torch.sigmoid(LOGIT_SCALE * logit)
        labels = (torch.rand(size, generator=g) < p).float()
        return Batch(ids, dense, labels)
