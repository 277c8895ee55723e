"""The planner's loss memory (plan/memory.py, `logits_bytes`) against the loss itself, measured
on CPU with the profiler's allocation records: the high-water mark of the bytes allocated from
the head's matmul to the end of the loss's backward, per logit.

PyTorch's `F.cross_entropy` over an fp32 copy of the logits is torchtitan's loss
(`cross_entropy_loss`: `pred.flatten(0, 1).float()`, its train step deleting `pred` before the
backward; in 2024 its Llama's forward made the copy, `self.output(h).float()`) and meshloom's
eager one (`parallel.plain_loss`). Its forward holds the 16-bit logits,
the copy and the log-softmax (2 + 4 + 4 bytes), and the copy dies with the call; its backward
the saved log-softmax, the gradient the NLL's backward writes and the one log-softmax's backward
writes (4 + 4 + 4): 12 bytes a logit, `EAGER_CE_PEAK_BYTES`. The kernels' allocations are the
same on CUDA (each output a new tensor; nll_loss_backward's zeros)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from meshloom.parallel import plain_loss
from meshloom.parallel.tensor import vocab_parallel_cross_entropy
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout
from meshloom.plan.memory import EAGER_CE_PEAK_BYTES, LOSS_PARALLEL_PEAK_BYTES, logits_bytes
from meshloom.plan.models import from_dims

B, S, H, V = 2, 64, 8, 4096  # a narrow hidden size: the weights' bytes are a rounding error


def _titan_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def _titan_2024_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's 2024 loss, over the fp32 logits its Llama's forward returned
    (`self.output(h).float()`, `MODEL_UPCASTS`)."""
    return F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))


MODEL_UPCASTS = {_titan_2024_loss}


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


def _peak_per_logit(loss_fn, free_logits: bool = True, context=contextlib.nullcontext) -> float:
    """Bytes a logit at the high-water mark of head, loss and backward, all run in `context`."""
    torch.manual_seed(0)
    x = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    head = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (B, S))
    gc.collect()
    gc.disable()  # a collection inside the profile would free blocks allocated before it
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, context():
            pred = x @ head.t()
            if loss_fn in MODEL_UPCASTS:  # the 16-bit output dies with the cast
                pred = pred.float()
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


@pytest.mark.parametrize("loss_fn", [_titan_loss, _titan_2024_loss, plain_loss],
                         ids=["torchtitan", "torchtitan-2024", "meshloom"])
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


class _OneRankSlice:
    """The tp axis as `vocab_parallel_cross_entropy` sees it on any rank: its collectives act
    in place on [N]-sized tensors, so one rank's slice allocates what every rank's does."""

    def size(self, axis: str) -> int:
        return 1

    def coord(self, axis: str) -> int:
        return 0


def _meshloom_tp_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_cross_entropy(pred, labels, V, _OneRankSlice())


def _cpu_output_cast_temporary() -> float:
    """Bytes per element PyTorch's CPU path allocates for an fp32 product written into a bf16
    `out=` (the backward's softmax × gradient): its TensorIterator computes an op whose output
    dtype differs from the inputs' into a temporary of the common dtype and copies it out
    (`common_device == kCPU` in TensorIterator::compute_types), where CUDA kernels cast as they
    store. Measured here, so that a build without the temporary is not miscounted."""
    a, g = torch.rand(256, 256), torch.rand(256, 1)
    out = torch.empty(256, 256, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.mul(a, g, out=out)
    grabbed = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0),
                  default=0)
    return grabbed / a.numel()


def test_meshloom_vocab_parallel_loss_peaks_at_what_the_planner_counts():
    """meshloom's loss under tp > 1 (parallel/tensor.py): its one fp32 copy becomes the softmax
    in place, and the backward writes the 16-bit gradient beside it: e + 4 = 6 bytes a logit
    at either peak, where an up-cast F.cross_entropy holds 12; the planner counts that for
    meshloom at tp > 1, compiled or not (the step does not compile it)."""
    temporary = _cpu_output_cast_temporary()
    assert temporary in (0, 4)  # none, or one fp32 tensor the size of the output
    got = _peak_per_logit(_meshloom_tp_loss) - temporary
    assert got == pytest.approx(6, rel=2e-3) and got >= 6
    shape = from_dims("llama", H, 1, 1, V)
    for compiled in (False, True):
        lay = Layout(tp=2, micro_batch=B)
        counted = logits_bytes(shape, S, B, lay, "bf16", Implementation(compile=compiled))
        assert counted == 6 * B * S * V / 2


def _loss_parallel_job() -> float:
    """torchtitan's eager loss under TP: `F.cross_entropy` inside PyTorch's `loss_parallel` on
    logits split over the vocabulary (one rank's slice: a one-rank mesh runs the handlers'
    every pass; their collectives act on [N]-sized tensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _titan_loss(DTensor.from_local(pred, mesh, [Shard(-1)], run_check=False), labels)

    try:
        return _peak_per_logit(loss_fn, context=loss_parallel)
    finally:
        dist.destroy_process_group()


def test_loss_parallel_peaks_at_what_the_planner_counts():
    """PyTorch's `loss_parallel` (torchtitan with TP, loss not compiled): its NLL backward
    computes `(zeros with the targets' -1 + exp(log-softmax)) * gradient` beside the kept
    log-softmax, five fp32 tensors of the slice, 20 bytes a logit; the planner counts that for
    an eager cross entropy under tp > 1 and prices its passes apart (38 bytes each way)."""
    from dist_harness import run_ranks

    got = run_ranks(_loss_parallel_job, 1)[0]
    assert got == pytest.approx(LOSS_PARALLEL_PEAK_BYTES, rel=2e-3)
    assert got >= LOSS_PARALLEL_PEAK_BYTES
    shape = from_dims("llama", H, 1, 1, V)
    titan = Implementation(cross_entropy="eager", meshloom_block=False)
    lay = Layout(tp=2, micro_batch=B)
    assert logits_bytes(shape, S, B, lay, "bf16", titan) == \
        LOSS_PARALLEL_PEAK_BYTES * B * S * V / 2


def test_one_kernel_and_megatron_losses_keep_their_counts():
    """What the change to the eager count left alone: 2e for a one-kernel loss or a compiled
    one, e + 4 for Megatron's in-place softmax (and with no implementation given)."""
    assert _planned_per_logit(Implementation(compile=True)) == 4
    assert _planned_per_logit(Implementation(cross_entropy="xentropy")) == 4
    assert _planned_per_logit(Implementation(cross_entropy="megatron")) == 6
    shape = from_dims("llama", H, 1, 1, V)
    assert logits_bytes(shape, S, B, Layout(micro_batch=B), "bf16") == 6 * B * S * V


def test_explain_names_the_loss_held_at_the_peak():
    """torchtitan's Llama 3 8B on 8 GPUs (two 8192-token sequences a rank): the peak holds the
    eager loss's 12 bytes over 16384 × 128256 logits and the final norm's input, and --explain
    says so; under full recompute of a small vocabulary the recomputed block is the larger and
    no loss is named."""
    from meshloom.plan.explain import explain
    from meshloom.plan.hardware import make_cluster
    from meshloom.plan.memory import final_norm_bytes
    from meshloom.plan.models import PRESETS
    from meshloom.plan.search import evaluate
    from meshloom.plan.trainers import trainer_impl

    shape, lay = PRESETS["llama3-8b"], Layout(dp=8, zero=3, micro_batch=2, recompute="selective")
    impl = Implementation(**trainer_impl("torchtitan"))
    plan = evaluate(shape, lay, make_cluster("h100", 8), 8192, 16, impl=impl)
    held = (logits_bytes(shape, 8192, 2, lay, "bf16", impl)
            + final_norm_bytes(shape, 8192, 2, lay, "bf16", impl))
    assert held == pytest.approx(8192 * 2 * (128256 * EAGER_CE_PEAK_BYTES + 4096 * 2))
    assert plan.memory.loss == pytest.approx(held)
    assert plan.memory.to_dict()["activations_loss"] == plan.memory.loss
    assert f"the loss (eager) over its logits and the final norm's input, held at the peak: " \
           f"{held / 1e9:.2f} GB" in explain(plan)
    small = from_dims("llama", 1024, 4, 8, 512)
    full = Layout(dp=8, zero=3, micro_batch=2, recompute="full")
    plain = evaluate(small, full, make_cluster("h100", 8), 2048, 16, impl=impl)
    assert plain.memory.loss == 0 and "the loss (" not in explain(plain)
