"""Data parallel under expert parallel: the dense parameters and the experts, each over its ranks.

Dense parameters (attention, norms, routers, shared experts, embeddings) are handled exactly as
without experts. An expert is held by the ranks of one ep coordinate only, so a second instance
of the same strategy (DDP, ZeRO-1/2 or ZeRO-3) takes the experts over the expert axes
(dp_axes.EXPERTS): DDP all-reduces them over "edp"; ZeRO shards them over "edp_shard" and sums
over dp_replicate. Both divide by the data x context degree, as the experts' gradients already
hold the whole ep group's tokens. `ExpertGrads` drives the two as one GradSync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from meshloom import comm
from meshloom.config import ParallelConfig
from meshloom.mesh import Mesh
from meshloom.models.moe import moe_blocks
from meshloom.optim import named_trainable
from meshloom.parallel.ddp import DataParallel
from meshloom.parallel.delegate import backward_scope
from meshloom.parallel.dp_axes import EXPERTS, DPAxes
from meshloom.parallel.expert import AXIS, is_expert
from meshloom.parallel.fsdp import FullyShardedDataParallel, units_of
from meshloom.parallel.zero import ShardPrecision, ZeroDataParallel


class ExpertGrads:
    """Two data-parallel strategies as one GradSync: `dense` for the dense parameters,
    `experts` for the expert-parallel ones. The global norm sums each part over its own axes
    (`norm_axes`, `expert_norm_axes`)."""

    def __init__(self, model: nn.Module, mesh: Mesh, dense, experts):
        self.model, self.mesh, self.dense, self.experts = model, mesh, dense, experts
        self.norm_axes = dense.norm_axes
        self.expert_norm_axes = experts.norm_axes

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.dense.no_sync(), self.experts.no_sync():
            yield

    @contextlib.contextmanager
    def backward_of(self, params: list[nn.Parameter]) -> Iterator[None]:
        with backward_scope(self.dense, params), backward_scope(self.experts, params):
            yield

    def finish(self) -> None:
        self.dense.finish()
        self.experts.finish()

    def optim_param_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        d, nd = self.dense.optim_param_groups()
        e, ne = self.experts.optim_param_groups()
        return d + e, nd + ne

    def after_step(self) -> None:
        self.dense.after_step()
        self.experts.after_step()

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return {**self.dense.optimizer_state(optimizer),
                **self.experts.optimizer_state(optimizer)}

    def model_state(self) -> dict:
        return {**self.dense.model_state(), **self.experts.model_state()}

    @property
    def grad_bytes(self) -> int:
        return getattr(self.dense, "grad_bytes", 0) + getattr(self.experts, "grad_bytes", 0)

    @property
    def units(self) -> list:
        return getattr(self.dense, "units", []) + getattr(self.experts, "units", [])

    @property
    def buckets(self) -> list:
        return getattr(self.dense, "buckets", []) + getattr(self.experts, "buckets", [])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, experts in their global [E, ...] shape (collective over the
        data-parallel ranks and ep)."""
        out = _whole(self.dense, self.model)
        mine = _whole(self.experts, self.model)
        for name, p in self.model.named_parameters():
            if is_expert(p):
                local = mine[name].contiguous()
                whole = local.new_empty((local.shape[0] * self.mesh.size(AXIS),
                                         *local.shape[1:]))
                comm.all_gather_into(whole, local, self.mesh, AXIS)
                out[name] = whole
        return out


def _whole(strategy, model: nn.Module) -> dict[str, torch.Tensor]:
    if hasattr(strategy, "full_state_dict"):
        return strategy.full_state_dict()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def expert_data_parallel(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig,
                         precision: ShardPrecision, reduce_dtype: torch.dtype,
                         dense_axis: str) -> ExpertGrads:
    """The layout's data-parallel strategy, once for the dense parameters (as without experts)
    and once for the experts over the expert axes."""
    named = named_trainable(model)
    dense = [(n, p) for n, p in named if not is_expert(p)]
    experts = [(n, p) for n, p in named if is_expert(p)]
    dp_cp = mesh.size("dp_cp")

    def build(part: list, axes: DPAxes | None, units: list[str] | None):
        if pcfg.zero_stage in (1, 2):
            return ZeroDataParallel(model, mesh, stage=pcfg.zero_stage,
                                    bucket_mb=pcfg.ddp_bucket_mb, precision=precision,
                                    named=part, **({"axes": axes} if axes else {}))
        if pcfg.zero_stage == 3:
            return FullyShardedDataParallel(model, mesh,
                                            reshard_after_forward=pcfg.reshard_after_forward,
                                            precision=precision, named=part, units=units,
                                            carry=mesh.size("pp") == 1,
                                            reduce_once=pcfg.reduce_once,
                                            **({"axes": axes} if axes else {}))
        dp = DataParallel(model, mesh, axis=axes.whole if axes else dense_axis,
                          bucket_mb=pcfg.ddp_bucket_mb, reduce_dtype=reduce_dtype, named=part,
                          divisor=dp_cp)
        dp.norm_axes = axes.split if axes else ()
        return dp

    dense_units = [u for u in units_of(model)]
    # Each block's experts are one unit, hooked on the block that holds them (their parameters
    # are the unit's; the block's others are the dense strategy's): its gathers and frees then
    # run outside the block's checkpointed function, as the dense units' do. Hooked on the
    # experts inside it, a recompute would gather them again in backward, an op selective
    # recompute does not find among the forward's ('not found in storage').
    expert_units = [max((u for u in dense_units if u and name.startswith(u + ".")), key=len,
                        default=f"{name}.experts") for name, _ in moe_blocks(model)]
    return ExpertGrads(model, mesh, build(dense, None, dense_units),
                       build(experts, EXPERTS, expert_units))
