"""What the planner prices for trainers built on PyTorch's own data parallelism, checked against
PyTorch itself on two Gloo ranks: FSDP1 (`fsdp_flat_param`, `fp32_params`, `fsdp_no_sync`:
plan/implementation.py) with a two-layer unit under Lightning's `bf16-mixed` mixed precision
(fp32 parameters, bf16 reduction, autocast), two micro-batches under `no_sync()` and a third
that synchronizes; and the ZeroRedundancyOptimizer over DDP (`zero_redundancy_optimizer`)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

M = 3  # micro-batches a step: M - 1 under no_sync(), the last synchronizes
IN, HID = 64, 128


def _census() -> dict:
    """Each rank's record of one step: the collectives (dtype, elements), and the autograd and
    copy ops the planner's terms stand for, by name and the elements they touch."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.profiler import ProfilerActivity, profile

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
    calls: list[tuple[str, str, int]] = []
    # FSDP1 on CPU gathers into a list of chunks (`_all_gather_flat_param`) and reduces with
    # `reduce_scatter_single` (`_reduce_grad`); each call is recorded on its way through.
    gather, scatter = dist.all_gather, dist.reduce_scatter_single

    def record_gather(outs, inp, *a, **k):
        calls.append(("all_gather", str(inp.dtype), inp.numel()))
        return gather(outs, inp, *a, **k)

    def record_scatter(out, inp, *a, **k):
        calls.append(("reduce_scatter", str(inp.dtype), inp.numel()))
        return scatter(out, inp, *a, **k)

    dist.all_gather, dist.reduce_scatter_single = record_gather, record_scatter
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(IN, HID, bias=False),
                              torch.nn.Linear(HID, IN, bias=False))
    fsdp = FSDP(net, device_id=torch.device("cpu"), use_orig_params=False,
                mixed_precision=MixedPrecision(param_dtype=torch.float32,
                                               reduce_dtype=torch.bfloat16))
    x = torch.randn(8, IN)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(M):
            sync = i == M - 1
            with fsdp.no_sync() if not sync else torch.enable_grad():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = fsdp(x)
                y.float().sum().backward()
    ops: dict[str, int] = {}
    for e in prof.events():  # by name, and by name and first input's shape
        shape = e.input_shapes[0] if e.input_shapes and e.input_shapes[0] else []
        for key in {e.name, f"{e.name}{shape}"}:
            ops[key] = ops.get(key, 0) + 1
    dist.destroy_process_group()
    return {"calls": calls, "ops": ops}


@pytest.fixture(scope="module")
def census():
    return run_ranks(_census, 2, timeout=120)[0]


def test_fp32_parameters_are_gathered_and_the_gradient_reduced_in_bf16_once(census):
    """`fp32_params`: the gathers carry the fp32 shard (4 bytes a parameter); under
    `no_sync` one reduce-scatter a step, in the reduce dtype."""
    numel = IN * HID + HID * IN
    gathers = [c for c in census["calls"] if c[0] == "all_gather"]
    assert gathers and all(c[1:] == ("torch.float32", numel // 2) for c in gathers)
    assert [c for c in census["calls"] if c[0] == "reduce_scatter"] == [
        ("reduce_scatter", "torch.bfloat16", numel)]


def test_the_root_unit_is_gathered_once_a_micro_batch(census):
    """FSDP1 does not reshard its root unit (here the only one) after forward: one gather a
    micro-batch, kept to the backward, where a block's is gathered twice (`fsdp_root`)."""
    assert len([c for c in census["calls"] if c[0] == "all_gather"]) == M


def test_every_backward_concatenates_and_later_ones_add(census):
    """`fsdp_flat_param`: each of the M backwards (no_sync or not) builds the flat gradient by
    autograd's concatenation of the views' gradients; the M - 1 after the first add into the
    kept whole gradient; the flat gradient is cast to the wire dtype once, before the one
    reduce-scatter."""
    ops, numel = census["ops"], IN * HID + HID * IN
    assert ops.get("SplitWithSizesBackward0", 0) == M
    assert ops.get(f"aten::add_[{numel}]", 0) == M - 1
    assert ops.get(f"aten::_to_copy[{numel}]", 0) == 1


def test_every_micro_batch_casts_each_weight_both_ways(census):
    """`casts_weights`: autocast casts each fp32 weight to bf16 in the forward and the weight's
    bf16 gradient back to fp32 in the backward, every micro-batch."""
    ops = census["ops"]
    assert ops.get(f"aten::_to_copy[{HID}, {IN}]", 0) == 2 * M
    assert ops.get(f"aten::_to_copy[{IN}, {HID}]", 0) == 2 * M


def _zero_redundancy_census() -> dict:
    """Each rank's collectives over one step of PyTorch's ZeroRedundancyOptimizer over DDP
    under autocast (flash-attention's `adamw-zero` with `DDPStrategyZero1`): a micro-batch under
    `no_sync()`, one that synchronizes, the optimizer step."""
    import os

    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(IN, HID, bias=False),
                              torch.nn.Linear(HID, IN, bias=False))
    ddp = DDP(net, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    x = torch.randn(8, IN)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for sync in (False, True):
            with ddp.no_sync() if not sync else torch.enable_grad():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = ddp(x)
                y.float().sum().backward()
        opt.step()
    calls = [(e.name, e.input_shapes[0]) for e in prof.events()
             if e.name in ("gloo:all_reduce", "gloo:broadcast")]
    dtypes = {str(p.dtype) for p in net.parameters()} | {str(p.grad.dtype)
                                                         for p in net.parameters()}
    dist.destroy_process_group()
    return {"calls": calls, "dtypes": sorted(dtypes)}


def test_zero_redundancy_optimizer_all_reduces_once_and_broadcasts_the_parameters():
    """`zero_redundancy_optimizer` with `fp32_params`: DDP all-reduces the whole fp32 gradient
    once a step (not under `no_sync`), in its bucket, and after the step the owners broadcast
    every parameter, a gather's worth of fp32 bytes; no reduce-scatter."""
    census = run_ranks(_zero_redundancy_census, 2, timeout=120)[0]
    assert census["dtypes"] == ["torch.float32"]
    reduces = [c for c in census["calls"] if c[0] == "gloo:all_reduce"]
    assert reduces == [("gloo:all_reduce", [IN * HID + HID * IN])]
    sent = [c[1] for c in census["calls"] if c[0] == "gloo:broadcast"]
    assert sorted(sent) == sorted([[HID, IN], [IN, HID]])
