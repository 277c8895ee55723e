"""`parallelize()`: apply the layout's strategies to a plain model, always in the same order.

Order (DESIGN.md): pipeline split -> tensor (+ sequence) parallel -> context parallel ->
activation checkpointing -> data parallel. This version implements tensor (+ sequence) parallel
and data parallel (DDP, ZeRO-1/2/3, HSDP) over the tensor-parallel slices; the config layer
rejects pp and cp before launch, so nothing here silently ignores one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from meshloom.checkpoint import whole_state
from meshloom.config import ParallelConfig
from meshloom.mesh import Mesh
from meshloom.optim import decay_groups, named_trainable
from meshloom.parallel.ddp import DataParallel
from meshloom.parallel.fsdp import FullyShardedDataParallel
from meshloom.parallel.tensor_plan import GatheredLogits, TensorParallel, TensorParallelGrads
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

    def __init__(self, model: nn.Module, mesh: Mesh):
        self.model, self.mesh = model, mesh

    def optim_param_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return decay_groups(self.model.parameters())

    def after_step(self) -> None:
        pass

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return whole_state(named_trainable(self.model), self.mesh, optimizer)

    def model_state(self) -> dict:
        return whole_state(named_trainable(self.model), self.mesh)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def finish(self) -> None:
        pass

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=False)


def plain_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@dataclass
class Parallelized:
    model: nn.Module
    grads: GradSync
    # Mean cross-entropy from what `model` returns (vocabulary-split logits under tp).
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = plain_loss
    # The model as a plain one (whole logits, any length) for sampling; every rank calls it.
    inference_model: nn.Module | None = None
    tp: TensorParallel | None = None


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig,
                compute_dtype: str = "fp32", tp_plan: dict[str, str] | None = None
                ) -> Parallelized:
    """Apply the layout. Tensor parallel first (the model's `TP_PLAN`, or `tp_plan`), then data
    parallel over the resulting slices. With zero_stage >= 1 the sharded stages keep
    `compute_dtype` working copies of the parameters and fp32 masters; without sharding the model
    stays fp32 and the training loop runs its forward under autocast."""
    for axis in ("pp", "cp"):
        if mesh.size(axis) > 1:
            raise NotImplementedError(f"parallel.{axis} > 1 is not implemented in this version")
    tp = None
    if mesh.size("tp") > 1:
        tp = TensorParallel(model, tp_plan or model.TP_PLAN, mesh,
                            sequence_parallel=pcfg.sequence_parallel)
    grads = _data_parallel(model, mesh, pcfg, compute_dtype)
    if tp is None:
        return Parallelized(model, grads, inference_model=model)
    return Parallelized(model, TensorParallelGrads(grads, tp), loss=tp.loss,
                        inference_model=GatheredLogits(model, tp), tp=tp)


def _data_parallel(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig,
                   compute_dtype: str) -> GradSync:
    prec = ShardPrecision(param_dtype=TORCH_DTYPES[compute_dtype],
                          reduce_dtype=TORCH_DTYPES[pcfg.reduce_dtype], offload=pcfg.cpu_offload)
    if pcfg.zero_stage in (1, 2):
        return ZeroDataParallel(model, mesh, stage=pcfg.zero_stage, bucket_mb=pcfg.ddp_bucket_mb,
                                precision=prec)
    if pcfg.zero_stage == 3:
        return FullyShardedDataParallel(model, mesh,
                                        reshard_after_forward=pcfg.reshard_after_forward,
                                        precision=prec)
    if mesh.size("dp") > 1:
        return DataParallel(model, mesh, axis="dp", bucket_mb=pcfg.ddp_bucket_mb)
    return LocalGrads(model, mesh)
