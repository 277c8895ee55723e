"""A gradient strategy that wraps another (tensor- or pipeline-parallel around data parallel)
and hands every part of the GradSync protocol it does not change to the inner one."""

from __future__ import annotations

import contextlib

import torch


class DelegatingGrads:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name: str):
        # Everything else (buckets, units, grad_bytes, full_state_dict, ...) is the inner one's.
        return getattr(self.inner, name)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.inner.no_sync()

    def finish(self) -> None:
        self.inner.finish()

    def optim_param_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.inner.optim_param_groups()

    def after_step(self) -> None:
        self.inner.after_step()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.inner.optimizer_state(optimizer)

    def model_state(self) -> dict:
        return self.inner.model_state()


def backward_scope(grads, params: list) -> contextlib.AbstractContextManager:
    """`grads.backward_of(params)` where the strategy narrows what a `no_sync()` reduces to the
    parameters one backward reaches (ZeRO-2, ZeRO-3; through any wrapper); nothing elsewhere."""
    scope = getattr(grads, "backward_of", None)
    return scope(params) if scope is not None else contextlib.nullcontext()
