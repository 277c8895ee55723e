"""The planner's loss memory (plan/memory.py, `logits_bytes`) against the loss itself, measured
on CPU with the profiler's allocation records: the high-water mark of the bytes allocated from
the head's matmul to the end of the loss's backward, per logit.

PyTorch's `F.cross_entropy` over an fp32 copy of the logits is torchtitan's loss
(`cross_entropy_loss`: `pred.flatten(0, 1).float()`, its train step deleting `pred` before the
backward) and meshloom's eager one (`parallel.plain_loss`). Its forward holds the 16-bit logits,
the copy and the log-softmax (2 + 4 + 4 bytes), and the copy dies with the call; its backward
the saved log-softmax, the gradient the NLL's backward writes and the one log-softmax's backward
writes (4 + 4 + 4): 12 bytes a logit, `EAGER_CE_PEAK_BYTES`. The kernels' allocations are the
same on CUDA (each output a new tensor; nll_loss_backward's zeros)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from meshloom.parallel import plain_loss
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout
from meshloom.plan.memory import EAGER_CE_PEAK_BYTES, logits_bytes
from meshloom.plan.models import from_dims

B, S, H, V = 2, 64, 8, 4096  # a narrow hidden size: the weights' bytes are a rounding error


def _titan_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def _high_water(events) -> int:
    """The most bytes alive at once. An operator with operators inside it (autograd's
    evaluate_function nodes) allocates through them and frees its inputs after they return, so
    its own net bytes are applied at its end; a leaf operator's at its start."""
    steps = []
    for e in events:
        if e.self_cpu_memory_usage:
            at = e.time_range.end if e.cpu_children else e.time_range.start
            steps.append((at, e.self_cpu_memory_usage))
    alive = top = 0
    for _, delta in sorted(steps, key=lambda x: x[0]):
        alive += delta
        top = max(top, alive)
    return top


def _peak_per_logit(loss_fn, free_logits: bool = True) -> float:
    torch.manual_seed(0)
    x = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    head = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (B, S))
    gc.collect()
    gc.disable()  # a collection inside the profile would free blocks allocated before it
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            pred = x @ head.t()
            loss = loss_fn(pred, labels)
            if free_logits:
                del pred
            loss.backward()
    finally:
        gc.enable()
    return _high_water(prof.events()) / (B * S * V)


def _planned_per_logit(impl: Implementation) -> float:
    shape = from_dims("llama", H, 1, 1, V)
    return logits_bytes(shape, S, B, Layout(micro_batch=B), "bf16", impl) / (B * S * V)


@pytest.mark.parametrize("loss_fn", [_titan_loss, plain_loss], ids=["torchtitan", "meshloom"])
def test_eager_cross_entropy_peaks_at_what_the_planner_counts(loss_fn):
    got = _peak_per_logit(loss_fn)
    # the NLL's few scalars and the targets' indices come on top: well under 1% of a byte
    assert got == pytest.approx(EAGER_CE_PEAK_BYTES, rel=2e-3)
    assert got >= EAGER_CE_PEAK_BYTES
    for impl in (Implementation(cross_entropy="eager", meshloom_block=False),  # torchtitan
                 Implementation()):  # meshloom, eager
        assert _planned_per_logit(impl) == EAGER_CE_PEAK_BYTES


def test_the_measurement_sees_logits_kept_through_the_backward():
    """A loop that keeps its logits (no `del pred`) holds their 2 bytes through the backward:
    the census is fine enough to tell."""
    assert _peak_per_logit(_titan_loss, free_logits=False) == pytest.approx(
        EAGER_CE_PEAK_BYTES + 2, rel=2e-3)


def test_one_kernel_and_megatron_losses_keep_their_counts():
    """What the change to the eager count left alone: 2e for a one-kernel loss or a compiled
    one, e + 4 for Megatron's in-place softmax (and with no implementation given)."""
    assert _planned_per_logit(Implementation(compile=True)) == 4
    assert _planned_per_logit(Implementation(cross_entropy="xentropy")) == 4
    assert _planned_per_logit(Implementation(cross_entropy="megatron")) == 6
    shape = from_dims("llama", H, 1, 1, V)
    assert logits_bytes(shape, S, B, Layout(micro_batch=B), "bf16") == 6 * B * S * V
