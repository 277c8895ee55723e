"""`parallelize()`: apply the layout's strategies to a plain model, always in the same order.

Order (DESIGN.md): pipeline split -> tensor (+ sequence) parallel -> context parallel ->
activation checkpointing -> data parallel. This version implements data parallel (our DDP);
the config layer rejects the other axes before launch, so nothing here silently ignores one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from meshloom.config import ParallelConfig
from meshloom.mesh import Mesh
from meshloom.parallel.ddp import DataParallel


class GradSync(Protocol):
    """What the training loop needs from a data-parallel strategy."""

    def no_sync(self) -> contextlib.AbstractContextManager: ...
    def finish(self) -> None: ...
    def zero_grad(self) -> None: ...


class LocalGrads:
    """No data parallelism: gradients stay where they are."""

    def __init__(self, model: nn.Module):
        self.model = model

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


def parallelize(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig) -> Parallelized:
    for axis in ("pp", "tp", "cp"):
        if mesh.size(axis) > 1:
            raise NotImplementedError(f"parallel.{axis} > 1 is not implemented in this version")
    if pcfg.zero_stage:
        raise NotImplementedError("parallel.zero_stage > 0 is not implemented in this version")
    if mesh.size("dp") > 1:
        return Parallelized(model, DataParallel(model, mesh, axis="dp",
                                                bucket_mb=pcfg.ddp_bucket_mb))
    return Parallelized(model, LocalGrads(model))
