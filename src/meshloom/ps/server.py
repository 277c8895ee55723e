"""A parameter server: the table pieces it holds, the lookups trainers send it, and the one
optimizer that applies all trainers' gradients.

A server process builds its `TableShard` and `TableOptimizer` before RPC starts (so no trainer can
reach it half-built), then only answers RPCs: trainers take a remote reference to the shard
(`rpc.remote(name, local_shard)`), call `lookup` on it inside a distributed-autograd context, and
build a DistributedOptimizer over its parameters.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed.rpc as rpc
from torch import nn

from meshloom.ps.config import PSConfig
from meshloom.ps.model import make_optimizer, make_table
from meshloom.ps.placement import Piece

# This process's tables and optimizer (one server per process); set by setup().
_SHARD: TableShard | None = None
_OPTIMIZER: TableOptimizer | None = None


class TableShard(nn.Module):
    """The pieces of embedding tables one server holds (at most one piece per table)."""

    def __init__(self, cfg: PSConfig, pieces: list[Piece]):
        super().__init__()
        self.tables = nn.ModuleDict({str(p.table): make_table(cfg, p.table, p.lo, p.hi)
                                     for p in pieces})
        self.first_row = {p.table: p.lo for p in pieces}

    def lookup(self, requests: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """Rows for each (table, ids counted from this server's first row of that table).

        Called by trainers inside a distributed-autograd context: the embedding lookups are
        recorded here, and the rows' gradients come back to this process in backward."""
        return [self.tables[str(t)](ids) for t, ids in requests]

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.parameters()]

    def weights(self) -> list[tuple[int, int, torch.Tensor]]:
        """(table, first row, rows) of every piece: the final tables, for checks and reports."""
        return [(int(t), self.first_row[int(t)], e.weight.detach().clone())
                for t, e in self.tables.items()]


class TableOptimizer:
    """Applies one update per training step, from the gradients of all trainers.

    Each trainer's DistributedOptimizer delivers that trainer's gradients (from its own autograd
    context) in its own step() call, and the trainers' calls arrive in any order. Stepping per
    call would be wrong for Adagrad (its accumulator squares the gradient, so two half-steps are
    not one step) and order-dependent in floating point even for SGD. So the contributions are
    held until every trainer's has arrived, summed in trainer order (deterministic), divided by the
    number of trainers (each trainer's loss is the mean over its part of the batch, so this is the
    mean over the global batch, exactly as DDP averages the dense gradients), and applied in one
    step of an ordinary sparse-capable optimizer.
    """

    def __init__(self, shard: TableShard, kind: str, lr: float, trainers: int,
                 record: bool = False):
        self.params = list(shard.parameters())
        self.inner = make_optimizer(kind, self.params, lr)
        self.trainers = trainers
        self.pending: dict[int, dict[nn.Parameter, torch.Tensor]] = {}
        self.steps = 0
        self._lock = threading.Lock()
        # With `record`, every step's (weights before, applied gradient) per piece, so that a
        # test can check the step's gradient and its update separately (see recorded_steps).
        self.record = record
        self.history: list[list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        self._where = {id(e.weight): (int(t), shard.first_row[int(t)])
                       for t, e in shard.tables.items()}

    def contribute(self, trainer: int, grads: dict[nn.Parameter, torch.Tensor]) -> None:
        with self._lock:
            if trainer in self.pending:
                raise RuntimeError(f"trainer{trainer} stepped the tables twice in step "
                                   f"{self.steps + 1}")
            self.pending[trainer] = grads
            if len(self.pending) < self.trainers:
                return
            contributions = [self.pending.pop(i) for i in range(self.trainers)]
            for p in self.params:
                parts = [c[p] for c in contributions if p in c]
                p.grad = _mean(parts, self.trainers) if parts else None
            if self.record:
                self.history.append(self._snapshot())
            self.inner.step()
            for p in self.params:
                p.grad = None
            self.steps += 1


    def _snapshot(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(table, first row, weights, gradient row ids, gradient rows) of every piece, taken
        just before the step; the gradient as the sparse optimizer receives it (coalesced)."""
        out = []
        for p in self.params:
            table, lo = self._where[id(p)]
            g = p.grad if p.grad is not None else torch.zeros(0, p.shape[1]).to_sparse(1)
            out.append((table, lo, p.detach().clone(), g._indices()[0].clone(),
                        g._values().clone()))
        return out


def _mean(parts: list[torch.Tensor], n: int) -> torch.Tensor:
    total = parts[0]
    for g in parts[1:]:
        total = total + g
    if total.is_sparse:
        total = total.coalesce()
    return total / n if n > 1 else total


class TableStep:
    """The optimizer class handed to DistributedOptimizer.

    DistributedOptimizer builds one local optimizer per (trainer, server), so each trainer would
    get its own optimizer state on the server; this thin class forwards to the server's single
    TableOptimizer instead, tagging the gradients with the trainer they came from.
    """

    def __init__(self, params: list[nn.Parameter], trainer: int):
        if _OPTIMIZER is None or {id(p) for p in params} != {id(p) for p in _OPTIMIZER.params}:
            raise RuntimeError("TableStep must be built over all of this server's tables")
        self.params, self.trainer = params, trainer

    def step(self) -> None:
        # DistributedOptimizer has just set p.grad from the calling trainer's autograd context
        # (under its process-wide lock). Taking them off keeps a step without a lookup of some
        # table from re-applying an old gradient.
        grads = {}
        for p in self.params:
            if p.grad is not None:
                grads[p] = p.grad
                p.grad = None
        _OPTIMIZER.contribute(self.trainer, grads)


def setup(cfg: PSConfig, pieces: list[Piece], record: bool = False) -> None:
    """Build this process's shard and optimizer (before rpc.init_rpc); `record` keeps every
    step's weights and gradients for `recorded_steps`."""
    global _SHARD, _OPTIMIZER
    _SHARD = TableShard(cfg, pieces)
    _OPTIMIZER = TableOptimizer(_SHARD, cfg.train.optimizer, cfg.table_lr, cfg.ps.trainers,
                                record=record)


def recorded_steps() -> list:
    """Run on the server through RPC: its optimizer's history (empty unless recording)."""
    if _OPTIMIZER is None:
        raise RuntimeError("this process is not a parameter server")
    return _OPTIMIZER.history


def local_shard() -> TableShard:
    """Run on the server through rpc.remote: the trainer's RRef then points at this shard."""
    if _SHARD is None:
        raise RuntimeError("this process is not a parameter server")
    return _SHARD


def ping() -> bool:
    return True
