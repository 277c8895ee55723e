"""`parallelize()`: apply the layout's strategies to a plain model, always in the same order.

Order (DESIGN.md): pipeline split -> tensor (+ sequence) parallel -> context parallel -> expert
parallel -> (parallel.rank_devices: the blocks spread over the rank's devices) -> activation
checkpointing (and torch.compile) per block -> data parallel (DDP, ZeRO-1/2/3, HSDP) over what
the earlier steps left on this rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from meshloom import comm, launch
from meshloom.checkpoint import whole_state
from meshloom.config import ParallelConfig
from meshloom.mesh import Mesh
from meshloom.optim import decay_groups, named_trainable
from meshloom.parallel import rank_devices
from meshloom.parallel.activation_checkpointing import apply_block_options
from meshloom.parallel.context import ContextParallel, PlainAttention
from meshloom.parallel.ddp import DataParallel
from meshloom.parallel.expert import apply_expert_parallel, split_sequences
from meshloom.parallel.expert_dp import expert_data_parallel
from meshloom.parallel.fsdp import FullyShardedDataParallel
from meshloom.parallel.pipeline import (
    PipelinedLogits,
    PipelineGrads,
    PipelineRunner,
    PipelineStep,
)
from meshloom.parallel.pipeline_stage import PipelineStageModel, split_layers
from meshloom.parallel.rank_devices import RankDevices
from meshloom.parallel.single_process_dp import ReplicaGrads, ReplicatedModule, resolve_devices
from meshloom.parallel.step import AccumulationStep, Step
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
        # Freed, not zeroed: the next backward then writes each gradient as it is made instead
        # of adding it into a zeroed one (a memset and a read-modify-write pass a step saved,
        # and the gradients' memory is free until the backward: docs/gpu.md).
        self.model.zero_grad(set_to_none=True)


def plain_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@functools.cache
def compiled_loss(backend: str | Callable = "inductor"
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`plain_loss` through torch.compile (with `train.compile`). Eager cross entropy over a big
    vocabulary writes the logits again in fp32, then their log-softmax, then an fp32 gradient:
    at a 128k vocabulary and 16k tokens a step that is 8 GB per copy. Compiled, it reads the
    logits once and writes their gradient once, in the logits' own dtype. Measured on one H100
    (docs/gpu.md): the 1B model's step 10% shorter, its peak 15.6 GiB lower."""
    return torch.compile(plain_loss, backend=backend, dynamic=False)


@dataclass
class Parallelized:
    model: nn.Module
    grads: GradSync
    # What the training loop calls: forward-backward over a step's micro-batches and evaluation
    # (gradient accumulation, or the pipeline schedule; parallel/step.py).
    step: Step
    # Mean cross-entropy from what `model` returns (vocabulary-split logits under tp).
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = plain_loss
    # The model as a plain one (whole logits, any length) for sampling; every rank calls it.
    inference_model: nn.Module | None = None
    tp: TensorParallel | None = None
    pipeline: PipelineRunner | None = None
    context: ContextParallel | None = None
    # Distinct devices this rank computes on (for MFU's peak): several under parallel.mode=dp
    # or parallel.rank_devices.
    devices: int = 1
    # parallel.rank_devices: where this rank's pieces went and the copies between its devices.
    rank_devices: RankDevices | None = None


@dataclass(frozen=True)
class PipelineSpec:
    """What the pipeline needs from the rest of the config."""

    microbatches: int
    seq_len: int
    timeout_s: float = 300.0


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig,
                compute_dtype: str = "fp32", tp_plan: dict[str, str] | None = None,
                pipeline: PipelineSpec | None = None, activation_checkpointing: str = "none",
                compile_blocks: bool = False, compile_backend: str | Callable = "inductor",
                seq_len: int = 0, broadcast_weights: bool | None = None) -> Parallelized:
    """Apply the layout, in DESIGN.md's order: pipeline split (the model becomes this rank's
    stages), tensor parallel (the model's `TP_PLAN`, or `tp_plan`), then data parallel over the
    resulting slices. With zero_stage >= 1 the sharded stages keep `compute_dtype` working
    copies of the parameters and fp32 masters; without sharding the model stays fp32 and the
    training loop runs its forward under autocast. `parallel.mode = "dp"` bypasses the mesh axes:
    one process, a replica of the whole model per device (parallel/single_process_dp.py).
    `parallel.rank_devices` spreads the rank's blocks over several devices (balanced by
    `layer_costs(seq_len)`) before data parallel wraps it (parallel/rank_devices.py).

    Every rank passes the whole model, and every layout keeps its slice of the weights it is
    given, so all ranks must hold the same weights. `broadcast_weights` makes them so: global
    rank 0's parameters and buffers are sent to every rank first. By default that happens for
    a model without `init_tensor` (a user's own, whatever its initialisation); a model with it
    declares that it draws each weight from (seed, name) alone, the same on every rank."""
    if pcfg.mode == "dp":  # one process driving several devices, instead of the mesh axes
        return _replicated(model, mesh, pcfg, activation_checkpointing)
    if broadcast_weights or (broadcast_weights is None and not hasattr(model, "init_tensor")):
        _broadcast_from_rank0(model, mesh)
    pp = mesh.size("pp")
    if pp > 1:
        if pipeline is None:
            raise ValueError("parallel.pp > 1 needs a PipelineSpec (micro-batches, sequence)")
        model = _cut(model, mesh, pcfg, pipeline)
    tp = None
    if mesh.size("tp") > 1:
        tp = TensorParallel(model, tp_plan or model.TP_PLAN, mesh,
                            sequence_parallel=pcfg.sequence_parallel, strict=pp == 1)
    cp = ContextParallel(model, mesh) if mesh.size("cp") > 1 else None
    if mesh.size("ep") > 1:  # this rank's experts; tokens reach them by all-to-all
        apply_expert_parallel(model, mesh)
    # An MoE routes whole sequences, of which it may see parts (cp chunks, sp slices); after
    # expert parallel, whose new expert parameters get the sequence-parallel mark too.
    split_sequences(model, mesh, pcfg.sequence_parallel)
    placed = _place_on_rank_devices(model, mesh, pcfg, seq_len) \
        if rank_devices.in_use(pcfg) else None
    apply_block_options(model, activation_checkpointing, compile_blocks, compile_backend)
    grads = _data_parallel(model, mesh, pcfg, compute_dtype)
    # Under tp the loss is vocab-parallel and holds collectives: it stays eager.
    loss = tp.loss if tp else compiled_loss(compile_backend) if compile_blocks else plain_loss
    if tp is not None:
        grads = TensorParallelGrads(grads, tp)
    if placed is not None:  # the loss on the last device, sampling on the first
        first, loss = placed.devices[0], rank_devices.loss_beside_logits(loss)
        return Parallelized(model, grads, AccumulationStep(model, grads, mesh, loss), loss=loss,
                            inference_model=rank_devices.LogitsOnFirst(model, first),
                            devices=len(set(placed.devices)), rank_devices=placed)
    if pp == 1:
        inference = GatheredLogits(model, tp) if tp else model
        if cp is not None:
            inference = PlainAttention(inference, cp)
        step = AccumulationStep(model, grads, mesh, loss, context=cp)
        return Parallelized(model, grads, step, loss=loss, inference_model=inference, tp=tp,
                            context=cp)
    runner = PipelineRunner(
        model, mesh, schedule=pcfg.pp_schedule, microbatches=pipeline.microbatches,
        virtual_stages=pcfg.pp_virtual_stages, loss=loss, timeout_s=pipeline.timeout_s,
        sequence_split=lambda: mesh.size("tp") if tp and tp.sequence_parallel else 1,
        context=cp)
    grads = PipelineGrads(grads, model, mesh)
    return Parallelized(model, grads, PipelineStep(runner, grads, mesh), loss=loss,
                        inference_model=PipelinedLogits(runner, tp), tp=tp, pipeline=runner,
                        context=cp)


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module, mesh: Mesh) -> None:
    """Global rank 0's whole weights on every rank, before any strategy slices them. Complex
    buffers (a RoPE table) are computed from the config, never drawn, and Gloo cannot send
    them: they are left as they are."""
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_complex():
            comm.broadcast(t.data, mesh, "world", src_coord=0)


def _cut(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig,
         spec: PipelineSpec) -> PipelineStageModel:
    """This rank's stages: stage s runs on pipeline rank s % pp (chunk s // pp)."""
    pp, v = mesh.size("pp"), pcfg.pp_virtual_stages
    costs, head = model.layer_costs(spec.seq_len)
    n_blocks = len(model.pipeline_cut_points())
    bounds = split_layers(n_blocks, pp * v, costs, head, pcfg.pp_layers or None)
    me = mesh.coord("pp")
    return PipelineStageModel(model, [c * pp + me for c in range(v)], bounds)


def _place_on_rank_devices(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig,
                           seq_len: int) -> RankDevices:
    """parallel.rank_devices: this local rank's devices (torchrun's LOCAL_RANK picks its entry),
    the blocks spread over them; the copies between them count on the mesh's counter."""
    local_rank = launch.rank_env()[2]
    devices = rank_devices.resolve(pcfg.rank_devices, mesh.device_type, local_rank)
    return rank_devices.place(model, devices, pcfg, seq_len, mesh.counter)


def _replicated(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig,
                activation_checkpointing: str) -> Parallelized:
    """parallel.mode=dp: a replica per device of parallel.dp_devices, made from the master
    every micro-batch (single_process_dp.py); each replica gets its own checkpoint wrappers."""
    devices = resolve_devices(pcfg.dp_devices, mesh.device_type)
    replicated = ReplicatedModule(model, devices, mesh.counter, activation_checkpointing)
    grads = ReplicaGrads(replicated, mesh)
    return Parallelized(replicated, grads, AccumulationStep(replicated, grads, mesh, plain_loss),
                        inference_model=model, devices=len(set(devices)))


def _data_parallel(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig,
                   compute_dtype: str) -> GradSync:
    prec = ShardPrecision(param_dtype=TORCH_DTYPES[compute_dtype],
                          reduce_dtype=TORCH_DTYPES[pcfg.reduce_dtype], offload=pcfg.cpu_offload)
    if mesh.size("ep") > 1:  # the experts over their own ranks, the rest as below
        return expert_data_parallel(model, mesh, pcfg, prec, TORCH_DTYPES[pcfg.reduce_dtype],
                                    mesh.replica_axis)
    if pcfg.zero_stage in (1, 2):
        return ZeroDataParallel(model, mesh, stage=pcfg.zero_stage, bucket_mb=pcfg.ddp_bucket_mb,
                                precision=prec)
    if pcfg.zero_stage == 3:
        return FullyShardedDataParallel(model, mesh,
                                        reshard_after_forward=pcfg.reshard_after_forward,
                                        precision=prec, carry=mesh.size("pp") == 1,
                                        reduce_once=pcfg.reduce_once)
    if mesh.size(mesh.replica_axis) > 1:  # cp ranks hold the same weights, see other tokens
        return DataParallel(model, mesh, axis=mesh.replica_axis, bucket_mb=pcfg.ddp_bucket_mb,
                            reduce_dtype=TORCH_DTYPES[pcfg.reduce_dtype])
    return LocalGrads(model, mesh)
