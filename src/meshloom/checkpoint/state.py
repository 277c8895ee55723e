"""What a checkpoint holds: the entries of model, optimizer and RNG state, keyed by parameter
name in each parameter's global shape, so that they do not depend on the layout that wrote them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshloom.mesh import Mesh
from meshloom.placement import checkpoint_entry, checkpoint_name

ADAM_STATS = ("exp_avg", "exp_avg_sq")


def whole_state(named_params: list[tuple[str, nn.Parameter]], mesh: Mesh,
                optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Entries for parameters each rank holds whole, or as a tensor-parallel slice:
    `model/<name>`, or `optim/<name>/<stat>` when `optimizer` is given, in the parameter's global
    shape (a slice becomes a ShardedTensor over tp). The values are views of the live tensors, so
    a load fills them in place."""
    out = {}
    for name, p in named_params:
        name = checkpoint_name(name, p)
        if optimizer is None:
            out[f"model/{name}"] = checkpoint_entry(p, p.detach().view(-1), 0, mesh)
            continue
        for k in ADAM_STATS:
            out[f"optim/{name}/{k}"] = checkpoint_entry(p, optimizer.state[p][k].view(-1), 0,
                                                        mesh)
    return out


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                   strategy) -> dict[str, Any]:
    """What a checkpoint holds, keyed by parameter name so that it does not depend on the
    layout: `model/<name>` and `optim/<name>/<stat>`, each in the parameter's global shape —
    whole, or this rank's rectangles of it as a ShardedTensor where the layout splits it — plus
    the AdamW step count."""
    state: dict[str, Any] = strategy.model_state()
    state.update(strategy.optimizer_state(optimizer))
    steps = [st["step"] for st in optimizer.state.values() if "step" in st]
    state["optim/step"] = torch.tensor(float(steps[0]) if steps else 0.0)
    return state


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily made state, so that a load has tensors to fill.

    A step with zero gradients at lr 0 creates every state tensor and leaves the parameters
    untouched; the load then overwrites it. (torch's own state-dict helper skips this whenever
    `.grad` exists, as it does under our DDP, after which DCP would silently load nothing.)
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
