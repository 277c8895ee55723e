"""Optimizer, learning-rate schedule and gradient clipping across mesh axes."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from meshloom import comm
from meshloom.config import TrainConfig
from meshloom.mesh import Mesh
from meshloom.placement import ep_split, is_duplicate, tp_split


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters by name (tied weights once, under their first name)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def decay_groups(params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(decay, no_decay): matrices decay, vectors (norm gains) don't."""
    params = [p for p in params if p.requires_grad]
    return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]


def build_optimizer(decay: list[torch.Tensor], no_decay: list[torch.Tensor], tcfg: TrainConfig,
                    *, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over the tensors this rank updates (whole parameters, or its shard's pieces)."""
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {}
    if fused is None and tcfg.optimizer_impl != "auto":
        fused = tcfg.optimizer_impl == "fused"
    if fused is None:
        fused = all(p.is_cuda for p in decay + no_decay) and bool(decay + no_decay)
    if fused:
        kwargs["fused"] = True
    else:
        # foreach is the fast path on CPU as well and is numerically the plain loop's result.
        kwargs["foreach"] = True
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps,
                             **kwargs)


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Linear warm-up to train.lr, then cosine decay to lr * min_lr_ratio at the last step."""
    if tcfg.warmup_steps and step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    span = max(1, tcfg.steps - tcfg.warmup_steps)
    progress = min(1.0, (step - tcfg.warmup_steps) / span)
    floor = tcfg.lr * tcfg.min_lr_ratio
    return floor + (tcfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def grad_norm(params: Iterable[nn.Parameter], mesh: Mesh | None = None,
              sharded_axes: Sequence[str] = (),
              expert_axes: Sequence[str] | None = None) -> float:
    """Global L2 norm of the gradients (`grad_norm_tensor` as a Python float)."""
    norm = grad_norm_tensor(params, mesh, sharded_axes, expert_axes)
    return 0.0 if norm is None else float(norm)


def grad_norm_tensor(params: Iterable[nn.Parameter], mesh: Mesh | None = None,
                     sharded_axes: Sequence[str] = (),
                     expert_axes: Sequence[str] | None = None) -> torch.Tensor | None:
    """Global L2 norm of the gradients, a 0-d fp32 tensor on the first gradient's device
    (None without any gradient): nothing waits for it, so the optimizer step can be launched
    behind it.

    Each rank sums the squares of the gradient elements it owns; `sharded_axes` are the mesh axes
    over which those elements are disjoint (sharded or split parameters), whose partial sums are
    added up. Over tp only the tensor-parallel slices are disjoint: a tensor replicated on every
    tp rank (a norm gain) enters each rank's sum divided by tp, so it is counted once. Replicated
    gradients (plain DDP) need no communication. Under expert parallel (`expert_axes` given)
    the experts' squares are summed over their own axes (ep, and edp_shard when sharded), so
    each expert is counted once, and added to the rest.
    """
    # A pipeline stage's copy of a tied table is counted on the stage that owns the original.
    params = [p for p in params if p.grad is not None and not is_duplicate(p)]
    if not params:
        return None
    groups = [(params, sharded_axes)]
    if expert_axes is not None:
        groups = [([p for p in params if ep_split(p) is None], sharded_axes),
                  ([p for p in params if ep_split(p) is not None], expert_axes)]
    device = params[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group, axes in groups:
        tp = mesh.size("tp") if mesh is not None and "tp" in axes else 1
        split = [p for p in group if tp == 1 or tp_split(p) is not None]
        replicated = [p for p in group if tp > 1 and tp_split(p) is None]
        sq = _sum_squares(split, device) + _sum_squares(replicated, device) / tp
        for axis in axes:
            if mesh is not None and mesh.size(axis) > 1:
                comm.all_reduce(sq, mesh, axis, label="all_reduce_scalars")
        total = total + sq
    return total.sqrt()


def _sum_squares(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """Sum of the squared gradient elements, in fp32, on `device`: one multi-tensor norm
    kernel per (device, dtype), each gradient read once (a per-tensor pow(2).sum() writes and
    reads a squared copy of every gradient)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:  # under parallel.rank_devices a rank's gradients live on several devices
        by_kind.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad.detach())
    for (_, dtype), grads in by_kind.items():
        # Low-precision gradients are normed in fp32; fp32 ones need no dtype argument (which
        # older PyTorch releases lack).
        norms = (torch._foreach_norm(grads, 2) if dtype == torch.float32
                 else torch._foreach_norm(grads, 2, dtype=torch.float32))
        total = total + torch.stack(norms).square().sum().to(device)
    return total


def guards_in_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `guarded_step` can run this optimizer: a fused AdamW reads a gradient divisor
    and a skip flag inside its kernel (the hooks PyTorch's GradScaler uses)."""
    return bool(optimizer.defaults.get("fused")) and getattr(
        optimizer, "_step_supports_amp_scaling", False)


def guarded_step(optimizer: torch.optim.Optimizer, norm: torch.Tensor, max_norm: float,
                 loss_finite: bool, agree: Callable[[torch.Tensor], object] | None = None
                 ) -> Callable[[], tuple[float, bool]]:
    """Queue the optimizer step clipped to `max_norm` (0 = no clipping) and skipped on the
    device when the norm is not finite (or `loss_finite` is False), without the host waiting
    for the norm first. `agree` (several ranks) takes the skip flag, a 0-d fp32 tensor, to a
    maximum over every rank in place, so that a rank whose own gradients went bad makes every
    rank skip. Returns a function that waits for the norm alone (not for the step) and gives
    (norm, whether the step was skipped).

    The fused kernel divides each gradient by max(1, norm / max_norm) as it reads it, so the
    clip costs no pass of its own over the gradients (clip_grads multiplies them in place: a
    read and a write of every gradient).
    """
    if not guards_in_kernel(optimizer):
        raise ValueError("guarded_step needs a fused AdamW (train.optimizer_impl=fused)")
    if loss_finite:
        skip = (~torch.isfinite(norm)).float()
    else:
        skip = torch.ones((), dtype=torch.float32, device=norm.device)
    if agree is not None:
        agree(skip)
    # The same 1e-6 as clip_grads: max_norm / (norm + 1e-6) is the factor it multiplies by.
    scale = (norm + 1e-6).div(max_norm).clamp(min=1.0) if max_norm > 0 else None
    # From a GPU into pinned memory, queued before the step: waiting for it waits for the norm.
    host = torch.stack([norm.detach().float(), skip]).to("cpu", non_blocking=True)
    ready = None
    if norm.is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    optimizer.grad_scale, optimizer.found_inf = scale, skip
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = optimizer.found_inf = None

    def wait() -> tuple[float, bool]:
        if ready is not None:
            ready.synchronize()
        return float(host[0]), bool(host[1] > 0)

    return wait


def clip_grads(params: Sequence[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale gradients so that their global norm is at most max_norm (0 = no clipping)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coef)


class LossScaler:
    """Dynamic loss scaling for fp16: the loss is multiplied by `scale` before backward so that
    small gradients survive fp16; a step whose gradients overflowed (non-finite global norm —
    the same verdict on every rank, as the norm is global) is skipped and the scale halved;
    after `growth_interval` good steps in a row the scale doubles."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**14, growth_interval: int = 200):
        self.enabled, self.scale = enabled, init_scale if enabled else 1.0
        self.growth_interval, self.good_steps = growth_interval, 0

    def update(self, norm_scaled: float) -> bool:
        """After finish(): True if the step may be taken (then grads must be unscaled)."""
        if not self.enabled:
            return True
        if not math.isfinite(norm_scaled):
            self.scale /= 2.0
            self.good_steps = 0
            return False
        self.good_steps += 1
        return True

    def grow(self) -> None:
        if self.enabled and self.good_steps >= self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0

    def state(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load(self, state: dict[str, float] | None) -> None:
        if self.enabled and state:
            self.scale, self.good_steps = state["scale"], int(state["good_steps"])
