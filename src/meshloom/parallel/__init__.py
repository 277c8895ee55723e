"""`parallelize()`: apply the layout's strategies to a plain model, always in the same order.

Order (DESIGN.md): pipeline split -> tensor (+ sequence) parallel -> context parallel ->
activation checkpointing -> data parallel. This version implements data parallel: DDP,
ZeRO-1/2/3 and HSDP; the config layer rejects the other axes before launch, so nothing here silently
ignores one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from meshloom.checkpoint import whole_optimizer_state
from meshloom.config import ParallelConfig
from meshloom.mesh import Mesh
from meshloom.optim import decay_groups, named_trainable
from meshloom.parallel.ddp import DataParallel
from meshloom.parallel.fsdp import FullyShardedDataParallel
from meshloom.parallel.zero import ShardPrecision, ZeroDataParallel


class GradSync(Protocol):
    """What the training loop needs from a data-parallel strategy.

    Per step: every micro-batch but the last runs inside `no_sync()`; then `finish()` leaves the
    averaged gradients in `.grad` of the tensors of `optim_param_groups()`, which the optimizer
    updates; `after_step()` brings the model's parameters up to date from them; `zero_grad()`.
    `norm_axes` are the mesh axes over which those tensors are disjoint (for the global norm).
    """

    norm_axes: tuple[str, ...]

    def no_sync(self) -> contextlib.AbstractContextManager: ...
    def finish(self) -> None: ...
    def optim_param_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...
    def after_step(self) -> None: ...
    def zero_grad(self) -> None: ...
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict: ...


class LocalGrads:
    """No data parallelism: gradients stay where they are."""

    norm_axes: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        self.model = model

    def optim_param_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return decay_groups(self.model.parameters())

    def after_step(self) -> None:
        pass

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return whole_optimizer_state(named_trainable(self.model), optimizer)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def finish(self) -> None:
        pass

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=False)


@dataclass
class Parallelized:
    model: nn.Module
    grads: GradSync


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig,
                compute_dtype: str = "fp32") -> Parallelized:
    """Apply the layout. With zero_stage >= 1 the sharded stages keep `compute_dtype` working
    copies of the parameters and fp32 masters; without sharding the model stays fp32 and the
    training loop runs its forward under autocast."""
    for axis in ("pp", "tp", "cp"):
        if mesh.size(axis) > 1:
            raise NotImplementedError(f"parallel.{axis} > 1 is not implemented in this version")
    prec = ShardPrecision(param_dtype=TORCH_DTYPES[compute_dtype],
                          reduce_dtype=TORCH_DTYPES[pcfg.reduce_dtype], offload=pcfg.cpu_offload)
    if pcfg.zero_stage in (1, 2):
        return Parallelized(model, ZeroDataParallel(model, mesh, stage=pcfg.zero_stage,
                                                    bucket_mb=pcfg.ddp_bucket_mb, precision=prec))
    if pcfg.zero_stage == 3:
        return Parallelized(model, FullyShardedDataParallel(
            model, mesh, reshard_after_forward=pcfg.reshard_after_forward, precision=prec))
    if mesh.size("dp") > 1:
        return Parallelized(model, DataParallel(model, mesh, axis="dp",
                                                bucket_mb=pcfg.ddp_bucket_mb))
    return Parallelized(model, LocalGrads(model))
