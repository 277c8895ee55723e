"""The step of a parallelised model: what the training loop calls, for every layout.

`Step.forward_backward(batches, ...)` runs one optimizer step's micro-batches forward and
backward, leaves the step's gradients complete (synchronised by the data-parallel strategy, ready
for the norm and the optimizer) and returns the global mean loss, the same number on every rank.
`Step.eval_loss(batches, ...)` returns the global mean loss of evaluation batches. Two
implementations: `AccumulationStep` here (micro-batches one after the other, gradients
accumulated) and the pipeline executor's `PipelineStep` (parallel/pipeline.py), which runs them
by its schedule. What both share is written once, here: a micro-batch's share of the step's loss
(`micro_share`), this rank's slice of the tokens under context parallel (`local_batch`), the
reduction to the global loss (`global_mean`) and the evaluation around a forward-only pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshloom import comm
from meshloom.config import Config
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.moe import set_aux_grad_scale
from meshloom.parallel.pipeline_schedule import pipeline_microbatches

if TYPE_CHECKING:
    from meshloom.parallel import GradSync
    from meshloom.parallel.context import ContextParallel

Batch = tuple[torch.Tensor, torch.Tensor]  # tokens, targets: whole sequences
# Tokens and targets on the device, and their positions in the whole sequence (None: all of it).
LocalBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def micro_batch_split(cfg: Config, dims: ParallelDims) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per step) of a rank's share of the global
    batch: the pipeline's micro-batch count (parallel.pp_microbatches or what it implies), or
    train.micro_batch sequences each (0: the whole share in one)."""
    local = cfg.train.global_batch // dims.dp
    if dims.pp > 1:
        count = pipeline_microbatches(cfg, dims)
        return local // count, count
    micro = cfg.train.micro_batch or local
    return micro, local // micro


def local_batch(x: torch.Tensor, y: torch.Tensor, device: torch.device,
                context: ContextParallel | None = None) -> LocalBatch:
    """A micro-batch on `device`; under context parallel (`context`) this rank's zigzag slice of
    its sequences, with the positions of those tokens."""
    x, y = _to_device(x, device), _to_device(y, device)
    if context is None:
        return x, y, None
    return context.local(x, y)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch onto a GPU through pinned memory, without waiting: a copy from pageable memory
    synchronises the stream, so the host would wait for the previous step's optimizer before
    it could queue this step's forward."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def micro_share(loss: torch.Tensor, count: int) -> torch.Tensor:
    """A micro-batch's part of the step's loss: the mean loss of the global batch is the mean of
    the `count` micro-batch means, so each (and with it its gradients) is divided by `count`."""
    return loss / count


def global_mean(local: float, mesh: Mesh) -> float:
    """The step's loss from this rank's part: summed over the pipeline (only the last stage
    holds a loss, the others 0), then the mean over the replicas. Every data- and
    context-parallel rank holds the same number of equal-sized batches and tokens, so the mean
    of their means is exact."""
    (local,) = comm.all_reduce_scalars([local], mesh, "pp")
    (total,) = comm.all_reduce_scalars([local], mesh, mesh.replica_axis)
    return total / mesh.size(mesh.replica_axis)


class Step:
    """One interface of the parallelised model for the training loop. Subclasses give this
    rank's part: `_forward_backward` (the sum of its micro-batch shares of the loss, gradients
    accumulated in `.grad`) and `_eval_sum` (the sum of its micro-batch mean losses)."""

    def __init__(self, model: nn.Module, grads: GradSync, mesh: Mesh):
        self.model, self.grads, self.mesh = model, grads, mesh

    def forward_backward(self, batches: list[Batch], device: torch.device,
                         autocast: contextlib.AbstractContextManager | None = None,
                         loss_scale: float = 1.0) -> float:
        """Forward and backward of the step's micro-batches (the loss multiplied by
        `loss_scale` before backward); the gradients are then synchronised. Returns the global
        mean loss (unscaled), the same on every rank."""
        # An MoE's load-balancing loss gets the gradient factor its micro-batch's loss gets.
        set_aux_grad_scale(loss_scale / max(1, len(batches)))
        local = self._forward_backward(batches, device, autocast or contextlib.nullcontext(),
                                       loss_scale)
        self.grads.finish()
        return global_mean(local, self.mesh)

    def eval_loss(self, batches: list[Batch], device: torch.device) -> float | None:
        """The global mean loss of `batches` (in eval mode, no gradients); None without any."""
        if not batches:
            return None
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                total = self._eval_sum(batches, device)
        finally:
            self.model.train(was_training)
        return global_mean(total / len(batches), self.mesh)

    def write_timeline(self, run_dir: Path) -> None:
        """What `meshloom report` draws of the run's schedule; only a pipeline has one."""

    def _forward_backward(self, batches: list[Batch], device: torch.device,
                          autocast: contextlib.AbstractContextManager,
                          loss_scale: float) -> float:
        raise NotImplementedError

    def _eval_sum(self, batches: list[Batch], device: torch.device) -> float:
        raise NotImplementedError


class AccumulationStep(Step):
    """Plain gradient accumulation: the micro-batches one after the other, every one but the
    last inside the data-parallel strategy's `no_sync()`, so that a step communicates once."""

    def __init__(self, model: nn.Module, grads: GradSync, mesh: Mesh,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 context: ContextParallel | None = None):
        super().__init__(model, grads, mesh)
        self.loss, self.context = loss, context

    def _micro_loss(self, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Mean loss of a micro-batch over this rank's tokens."""
        x, y, positions = local_batch(x, y, device, self.context)
        logits = self.model(x) if positions is None else self.model(x, positions)
        return self.loss(logits, y)

    def _forward_backward(self, batches: list[Batch], device: torch.device,
                          autocast: contextlib.AbstractContextManager,
                          loss_scale: float) -> float:
        total = None
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with self.grads.no_sync() if not last else contextlib.nullcontext():
                with autocast:
                    loss = micro_share(self._micro_loss(x, y, device), len(batches))
                (loss * loss_scale).backward()
            # Summed on the device and read once: reading each micro-batch's loss would stall
            # the host until that backward ends, leaving the GPU idle while the next is queued.
            # In float64, as the Python float sum it replaces: the same value to the bit.
            part = loss.detach().double()
            total = part if total is None else total + part
        return 0.0 if total is None else total.item()

    def _eval_sum(self, batches: list[Batch], device: torch.device) -> float:
        return sum(self._micro_loss(x, y, device).item() for x, y in batches)
