"""The single-process reference: the same model, data and optimizer in plain PyTorch, with the whole
global batch in one step. A parameter-server run must reproduce its losses and final weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshloom.ps.config import PSConfig
from meshloom.ps.data import ClickData
from meshloom.ps.model import click_loss, make_dense, make_optimizer, make_table


@dataclass
class LocalResult:
    losses: list[float] = field(default_factory=list)
    tables: list[torch.Tensor] = field(default_factory=list)  # final weights, one per table
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # the MLP's state_dict


def train_local(cfg: PSConfig) -> LocalResult:
    m = cfg.model
    tables = [make_table(cfg, t, 0, m.rows) for t in range(m.tables)]
    dense = make_dense(cfg)
    # Two optimizers as in the distributed run (tables on the servers, MLP on the trainers).
    table_opt = make_optimizer(cfg.train.optimizer, [e.weight for e in tables], cfg.table_lr)
    dense_opt = make_optimizer(cfg.train.optimizer, dense.parameters(), cfg.train.lr)
    data = ClickData(cfg)
    out = LocalResult()
    for step in range(1, cfg.train.steps + 1):
        b = data.batch(step, cfg.train.global_batch)
        emb = torch.cat([e(b.ids[:, t]) for t, e in enumerate(tables)], dim=1)
        loss = click_loss(dense, emb, b.dense, b.labels)
        loss.backward()
        table_opt.step()
        dense_opt.step()
        table_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        out.losses.append(loss.item())
    out.tables = [e.weight.detach().clone() for e in tables]
    out.dense = {k: v.detach().clone() for k, v in dense.state_dict().items()}
    return out
