"""The click-through model: embedding tables (the sparse part) and an MLP (the dense part).

Initial values are a function of the seed only, never of the layout: a table row's value depends
on (seed, table, row), so a server holding rows [lo, hi) of a table starts with exactly the rows
the single-process model has there.
"""

from __future__ import annotations

import torch
from torch import nn

from meshloom.ps.config import PSConfig
from meshloom.ps.placement import dense_widths

# Rows are drawn in fixed blocks, each from its own generator, so any row range can be produced
# without drawing the whole table first.
INIT_BLOCK = 4096


def init_rows(cfg: PSConfig, table: int, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of table `table` as initialised (N(0, init_std^2))."""
    dim, out = cfg.model.dim, torch.empty(hi - lo, cfg.model.dim)
    for block in range(lo // INIT_BLOCK, -(-hi // INIT_BLOCK)):
        start = block * INIT_BLOCK
        g = torch.Generator().manual_seed((cfg.train.seed * 7919 + table) * 1_000_003 + block + 17)
        rows = torch.randn(INIT_BLOCK, dim, generator=g) * cfg.model.init_std
        a, b = max(lo, start), min(hi, start + INIT_BLOCK)
        out[a - lo:b - lo] = rows[a - start:b - start]
    return out


def make_table(cfg: PSConfig, table: int, lo: int, hi: int) -> nn.Embedding:
    # sparse=True: the gradient of a lookup is a sparse tensor with one row per looked-up id, so
    # the server's optimizer step touches only those rows, not the whole table.
    emb = nn.Embedding(hi - lo, cfg.model.dim, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init_rows(cfg, table, lo, hi))
    return emb


def make_dense(cfg: PSConfig) -> nn.Sequential:
    """The MLP: [embeddings of every table, dense features] -> hidden layers (SiLU) -> logit.

    SiLU rather than ReLU: trainers run the MLP on parts of the batch, so their activations differ
    from the single-process run's by rounding. With ReLU, a pre-activation within rounding of zero
    switches a unit's gradient on or off, and the runs part by ~1e-4 (observed after ~50 steps);
    a smooth activation keeps rounding differences at rounding size."""
    widths = dense_widths(cfg)
    layers: list[nn.Module] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
            layers.append(nn.Linear(a, b))
            if i < len(widths) - 2:
                layers.append(nn.SiLU())
    return nn.Sequential(*layers)


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    """Both kinds accept sparse gradients. SGD is linear in the gradient; Adagrad is not (its
    accumulator squares it), which is why the servers sum all trainers' gradients before one step
    rather than stepping once per trainer (see server.TableOptimizer)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adagrad":
        # Adagrad builds sparse tensors; opting out of invariant checks explicitly (the default)
        # silences the warning it otherwise prints.
        torch.sparse.check_sparse_tensor_invariants.disable()
        return torch.optim.Adagrad(params, lr=lr)
    raise ValueError(f"unknown optimizer {kind!r}")


def click_loss(dense: nn.Module, embeddings: torch.Tensor, features: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of the click logit over the samples given."""
    logits = dense(torch.cat([embeddings, features], dim=1)).squeeze(1)
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)
