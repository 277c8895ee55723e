"""Tensor-parallel layers: forward and backward equal the unsharded layer's on real Gloo ranks
(gradients of the shards are the shards of the gradients)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_ranks
from torch import nn

from meshloom import comm
from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims
from meshloom.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab,
    vocab_parallel_cross_entropy,
)


def _mesh(world: int) -> Mesh:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return Mesh(ParallelDims(tp=world), rank, "cpu", CommCounter())


def _data(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _linear(i, o, seed=1):
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=False)


def _column_job(world, sp, batch=2):
    mesh = _mesh(world)
    full = _linear(8, 12)
    x = _data(batch, 8, 8).requires_grad_()
    r = _data(batch, 8, 12, seed=3)
    (full(x) * r).sum().backward()
    layer = ColumnParallelLinear.from_module(full, mesh, sequence_parallel=sp)
    xs = x.detach().clone().requires_grad_()
    inp = comm.scatter_to_group(xs, mesh, "tp", dim=1) if sp else xs
    y = comm.gather_from_group(layer(inp), mesh, "tp", dim=-1)
    (y * r).sum().backward()
    return {"y": y.detach(), "y_ref": full(x).detach(), "gw": layer.weight.grad,
            "gw_ref": full.weight.grad.chunk(world, 0)[mesh.coord("tp")], "gx": xs.grad,
            "gx_ref": x.grad, "bytes": dict(mesh.counter.bytes)}


def _row_job(world, sp, batch=2):
    mesh = _mesh(world)
    full = _linear(12, 8)
    x = _data(batch, 8, 12).requires_grad_()
    r = _data(batch, 8, 8, seed=3)
    (full(x) * r).sum().backward()
    layer = RowParallelLinear.from_module(full, mesh, sequence_parallel=sp)
    xs = x.detach().clone().requires_grad_()
    y = layer(comm.scatter_to_group(xs, mesh, "tp", dim=-1))
    if sp:
        y = comm.gather_from_group(y, mesh, "tp", dim=1)
    (y * r).sum().backward()
    return {"y": y.detach(), "y_ref": full(x).detach(), "gw": layer.weight.grad,
            "gw_ref": full.weight.grad.chunk(world, 1)[mesh.coord("tp")], "gx": xs.grad,
            "gx_ref": x.grad, "bytes": dict(mesh.counter.bytes)}


def _check(res):
    for r in res:
        torch.testing.assert_close(r["y"], r["y_ref"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["gw"], r["gw_ref"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["gx"], r["gx_ref"], rtol=1e-5, atol=1e-6)


# A micro-batch of one sequence takes sequence parallel's copy-free path (comm._leading).
LAYOUTS = [(False, 2), (True, 2), (True, 1)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp, batch", LAYOUTS)
def test_column_parallel_linear(world, sp, batch):
    res = run_ranks(_column_job, world, world, sp, batch)
    _check(res)
    ops = {op for _, op in res[0]["bytes"]}
    # Sequence parallel swaps the input all-reduce (backward) for all-gather/reduce-scatter.
    assert ("reduce_scatter" in ops) == sp and ("all_reduce" in ops) != sp


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp, batch", LAYOUTS)
def test_row_parallel_linear(world, sp, batch):
    res = run_ranks(_row_job, world, world, sp, batch)
    _check(res)
    # Forward: one all-reduce of the output (4 bytes x b*8*8), or its reduce-scatter with SP.
    op = "reduce_scatter" if sp else "all_reduce"
    assert res[0]["bytes"][("tp", op)] == 4 * batch * 8 * 8


def _buffers_job(world, batch):
    """Which buffers the sequence-parallel pair hands its collectives, forward and backward."""
    mesh = _mesh(world)
    seen = {"gather_out": [], "scatter_in": []}
    gather, scatter = comm.all_gather_into, comm.reduce_scatter_into

    def gather_spy(out, shard, *a, **kw):
        seen["gather_out"].append(out.data_ptr())
        return gather(out, shard, *a, **kw)

    def scatter_spy(out, full, *a, **kw):
        seen["scatter_in"].append(full.data_ptr())
        return scatter(out, full, *a, **kw)

    comm.all_gather_into, comm.reduce_scatter_into = gather_spy, scatter_spy
    try:
        x = _data(batch, 4, 3, seed=mesh.coord("tp")).requires_grad_()
        y = comm.gather_seq(x, mesh, "tp")  # all-gather forward, reduce-scatter backward
        g = _data(batch, 4 * world, 3, seed=7)
        y.backward(g)
        z = _data(batch, 4 * world, 3, seed=9)
        w = comm.reduce_scatter_seq(z, mesh, "tp")
    finally:
        comm.all_gather_into, comm.reduce_scatter_into = gather, scatter
    return {"y": y.detach(), "x": x.detach(), "gx": x.grad, "g": g, "z": z, "w": w,
            "y_is_buffer": y.data_ptr() == seen["gather_out"][0],
            "grad_scattered_in_place": seen["scatter_in"][0] == g.data_ptr(),
            "z_scattered_in_place": seen["scatter_in"][1] == z.data_ptr()}


@pytest.mark.parametrize("batch", [1, 2])
def test_sequence_parallel_copies_only_when_the_batch_is_not_one(batch):
    """At one sequence a micro-batch, the gathered activations are the collective's own output
    buffer and the reduce-scatters read the tensor as it is: no cat, no stack (the planner's
    `sp_copies=batch` for meshloom). Values match either way."""
    world = 2
    res = run_ranks(_buffers_job, world, world, batch)
    xs = [r["x"] for r in res]
    for rank, r in enumerate(res):
        torch.testing.assert_close(r["y"], torch.cat(xs, dim=1), rtol=0, atol=0)
        summed = sum(q["g"] for q in res).chunk(world, dim=1)[rank]
        torch.testing.assert_close(r["gx"], summed)
        torch.testing.assert_close(r["w"], sum(q["z"] for q in res).chunk(world, dim=1)[rank])
        copy_free = batch == 1
        assert r["y_is_buffer"] == copy_free
        assert r["grad_scattered_in_place"] == copy_free
        assert r["z_scattered_in_place"] == copy_free


def _embedding_job(world, padding_idx=None):
    mesh = _mesh(world)
    torch.manual_seed(0)
    full = nn.Embedding(257, 8, padding_idx=padding_idx)
    ids = torch.tensor([[0, 5, 128, 129, 256, 3], [256, 255, 1, 2, 200, 64]])
    r = _data(2, 6, 8, seed=3)
    (full(ids) * r).sum().backward()
    layer = VocabParallelEmbedding.from_module(full, mesh)
    y = layer(ids)
    (y * r).sum().backward()
    padded = padded_vocab(257, world)
    ref_grad = torch.cat([full.weight.grad, torch.zeros(padded - 257, 8)])
    return {"y": y.detach(), "y_ref": full(ids).detach(), "gw": layer.weight.grad,
            "gw_ref": ref_grad.chunk(world, 0)[mesh.coord("tp")]}


@pytest.mark.parametrize("world,padding_idx", [(2, None), (4, None), (2, 200), (4, 5)])
def test_vocab_parallel_embedding_pads_and_matches(world, padding_idx):
    """Also with nn.Embedding's padding_idx: that row gets no gradient from its lookups."""
    for r in run_ranks(_embedding_job, world, world, padding_idx):
        torch.testing.assert_close(r["y"], r["y_ref"])
        torch.testing.assert_close(r["gw"], r["gw_ref"])


def _ce_job(world, ignore=False):
    mesh = _mesh(world)
    v, padded = 257, padded_vocab(257, world)
    logits = _data(10, v).requires_grad_()
    targets = torch.tensor([0, 1, 256, 128, 129, 7, 255, 64, 200, 3])
    if ignore:  # F.cross_entropy's ignore_index: no part in the mean, no gradient
        targets[[1, 4, 8]] = -100
    ref = F.cross_entropy(logits, targets)
    ref.backward()
    full_padded = torch.cat([logits.detach(), torch.full((10, padded - v), 123.0)], dim=1)
    local = full_padded.chunk(world, 1)[mesh.coord("tp")].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, v, mesh)
    loss.backward()
    ref_grad = torch.cat([logits.grad, torch.zeros(10, padded - v)], dim=1)
    return {"loss": loss.item(), "ref": ref.item(), "g": local.grad,
            "g_ref": ref_grad.chunk(world, 1)[mesh.coord("tp")]}


@pytest.mark.parametrize("world,ignore", [(2, False), (4, False), (2, True)])
def test_vocab_parallel_cross_entropy(world, ignore):
    """Equal to F.cross_entropy on the whole logits; padding columns (set to a large value
    here) neither change the loss nor get a gradient."""
    for r in run_ranks(_ce_job, world, world, ignore):
        assert abs(r["loss"] - r["ref"]) < 1e-5
        torch.testing.assert_close(r["g"], r["g_ref"], rtol=1e-5, atol=1e-7)
