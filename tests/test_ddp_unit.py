"""DataParallel mechanics on real Gloo ranks: overlap, ordering, no_sync, unused parameters,
and agreement with torch.nn.parallel.DistributedDataParallel."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch import nn

from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.llama import build_model, config_from_preset
from meshloom.parallel.ddp import DataParallel


def _setup(world: int) -> Mesh:
    rank = int(__import__("os").environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return Mesh(ParallelDims(dp_replicate=world), rank, "cpu", CommCounter())


def _model(seed=0):
    return build_model(config_from_preset("tiny", n_layers=2), seed)


def _batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, 257, (2, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _overlap_job(world):
    """Bucket all-reduces start from backward hooks, before backward has finished."""
    mesh = _setup(world)
    model = _model()
    ddp = DataParallel(model, mesh, bucket_mb=0.01)
    events = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append("grad"))
    launch = ddp._launch_ready

    def spy(force=False):
        before = ddp._next
        launch(force)
        events.extend(["launch"] * (ddp._next - before))
    ddp._launch_ready = spy
    x, y = _batch(mesh.rank)
    _loss(model, x, y).backward()
    launched_in_backward = sum(b.launched for b in ddp.buckets)
    ddp.finish()
    return {"events": events, "launched": launched_in_backward, "buckets": len(ddp.buckets)}


def test_buckets_launch_during_backward():
    for res in run_ranks(_overlap_job, 2, 2):
        assert res["buckets"] > 3
        # All buckets were launched by the hooks, none left for finish()...
        assert res["launched"] == res["buckets"]
        # ...and the first launch came before the last gradient was produced (overlap).
        assert res["events"].index("launch") < len(res["events"]) - 1 - \
            res["events"][::-1].index("grad")


def _grads_job(world, mode):
    """Gradients after one step, from our DDP or torch's, for the same data."""
    mesh = _setup(world)
    model = _model()
    x, y = _batch(mesh.rank)
    if mode == "torch":
        wrapped = nn.parallel.DistributedDataParallel(model)
        _loss(wrapped, x, y).backward()
    else:
        ddp = DataParallel(model, mesh, bucket_mb=0.05)
        if mode == "set_to_none":
            model.zero_grad(set_to_none=True)  # a user's optimizer.zero_grad() must not break it
        _loss(model, x, y).backward()
        ddp.finish()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradients_equal_torch_ddp():
    ours = run_ranks(_grads_job, 2, 2, "ours")
    theirs = run_ranks(_grads_job, 2, 2, "torch")
    reset = run_ranks(_grads_job, 2, 2, "set_to_none")
    for name, g in theirs[0].items():
        torch.testing.assert_close(ours[0][name], g, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(reset[0][name], g, rtol=1e-6, atol=1e-7, msg=name)
        assert torch.equal(ours[0][name], ours[1][name])


def _no_sync_job(world):
    mesh = _setup(world)
    model = _model()
    ddp = DataParallel(model, mesh)
    start = mesh.counter.total(op="all_reduce")
    x, y = _batch(mesh.rank)
    with ddp.no_sync():
        _loss(model, x, y).backward()
        _loss(model, x, y).backward()
    during = mesh.counter.total(op="all_reduce") - start
    _loss(model, x, y).backward()
    ddp.finish()
    after = mesh.counter.total(op="all_reduce") - start
    return during, after, ddp.grad_bytes


def test_no_sync_moves_nothing():
    for during, after, grad_bytes in run_ranks(_no_sync_job, 2, 2):
        assert during == 0
        assert after == grad_bytes


class _Partly(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def _unused_job(world):
    """A parameter without a gradient must not hang the step (its bucket goes out in finish)."""
    mesh = _setup(world)
    torch.manual_seed(0)
    model = _Partly()
    ddp = DataParallel(model, mesh, bucket_mb=1e-5)  # one bucket per parameter
    model(torch.ones(2, 4) * (mesh.rank + 1)).sum().backward()
    ddp.finish()
    return model.used.weight.grad.clone(), model.unused.weight.grad.clone()


def test_unused_parameter_does_not_hang():
    (g0, u0), (g1, u1) = run_ranks(_unused_job, 2, 2, timeout=60)
    assert torch.equal(g0, g1)
    torch.testing.assert_close(g0, torch.full((4, 4), 1.5 * 2))  # mean of 2 and 4 over batch 2
    assert torch.count_nonzero(u0) == 0


def _broadcast_job(world):
    mesh = _setup(world)
    model = _model(seed=mesh.rank)  # deliberately different start on each rank
    DataParallel(model, mesh)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_parameters_identical_at_start():
    a, b = run_ranks(_broadcast_job, 2, 2)
    for name in a:
        assert torch.equal(a[name], b[name]), name
