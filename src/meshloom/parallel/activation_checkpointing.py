"""Activation checkpointing per transformer block: `none`, `full` or `selective`.

`full` keeps only each block's input and reruns the whole block in backward (Korthikanti et al.:
2sbh bytes per layer). `selective` reruns only what is cheap to recompute and dear to keep: the
attention core (its scores / softmax, or the ring exchange under context parallel) and the
elementwise ops (norms, RoPE, SiLU, products), while every matmul's output is saved, so no
matmul runs twice. Both use PyTorch's non-reentrant checkpoint; the selection is a policy on
the ATen ops (`create_selective_checkpoint_contexts`).

Applied in DESIGN.md's order, after tensor and context parallel (the rerun block includes
their collectives, which every rank repeats in the same order) and before data parallel (whose
hooks sit on the block module, outside the checkpointed function: ZeRO-3 gathers the block's
parameters before its backward, which is when the rerun happens). Optionally each block's
forward is compiled with `torch.compile` (`train.compile`): inside the checkpoint for `full`,
around it for `selective` (so that the compiler sees the policy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from meshloom.models.contract import blocks_of

MODES = ("none", "full", "selective")

# Outputs kept by selective recompute: the projections' matmuls (linear layers lower to these
# on every device; the MoE experts' grouped GEMM is one too). Everything else in a block is
# recomputed. Batched matmuls are not kept: in a block they are an attention core's own, the
# scores and the weighted values of SDPA's math path (which it takes for attention dropout on
# CPU, or where no fused kernel fits the inputs), of an eager attention, or of context parallel's
# ring on devices without CPU's fused kernel that returns the log-sum-exp (CUDA): quadratic in
# the sequence, and what selective recompute exists to drop.
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
              torch.ops.aten.linear.default, torch.ops.aten.matmul.default}
if hasattr(torch.ops.aten, "_grouped_mm"):  # torch >= 2.8
    _SAVED_OPS.add(torch.ops.aten._grouped_mm.default)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, the checkpoint unit: the children of the container the model's
    `pieces()` names (a whole model's ModuleList, or a pipeline stage's ModuleDict of the blocks
    it runs), `layers` for a model without the contract."""
    layers = blocks_of(model)
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def apply_block_options(model: nn.Module, mode: str = "none", compile_blocks: bool = False,
                        compile_backend: str | Callable = "inductor",
                        block_list: list[nn.Module] | None = None) -> int:
    """Checkpoint (and/or compile) every block's forward in place; returns how many blocks.
    `block_list` names the blocks of a model that does not keep them in `layers` (the GPU
    benchmark's Hugging Face GPT-2)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}; one of {', '.join(MODES)}")
    if mode == "none" and not compile_blocks:
        return 0
    found = blocks(model) if block_list is None else list(block_list)
    for block in found:
        inner = block.forward  # the bound method of the class, before any wrapping
        if compile_blocks and mode != "selective":
            # Full: the compiled block runs inside the checkpoint, which keeps only its input.
            inner = torch.compile(inner, backend=compile_backend)
        if mode != "none":
            inner = _checkpointed(inner, mode)
        if compile_blocks and mode == "selective":
            # Selective: the checkpoint goes inside the compiled graph, where the compiler applies
            # the policy op by op. Compiled inside the checkpoint, the block would be one opaque
            # op that the policy can only rerun whole: full recompute (measured on an H100: the
            # same time and peak memory as `full`).
            inner = torch.compile(inner, backend=compile_backend)
        block.forward = inner  # instance attribute: module hooks still run around it
    return len(found)


def _checkpointed(fn, mode: str):
    context = _selective_context if mode == "selective" else None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation and sampling: nothing to save
            return fn(*args, **kwargs)
        extra = {"context_fn": context} if context else {}
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)
    return run
