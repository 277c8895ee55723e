"""What meshloom's backward runs again of a layer's forward collectives under selective and full
recompute, counted with the comm counter on 2 Gloo ranks, against what the planner charges
(plan/reruns.py): tensor parallel with and without SP, dense and MoE blocks, eager and compiled;
context parallel's ring, alone and with tp (4 ranks); an MoE block's dispatch and combine under
expert parallel."""

from __future__ import annotations

import functools
import math

import pytest
from dist_harness import run_ranks

from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout
from meshloom.plan.models import from_llama_config
from meshloom.plan.reruns import dispatch_reruns, ring_reruns, tp_reruns

LAYERS = 2
SEQ = 64


def _config(moe: bool):
    from meshloom.models.llama import LlamaConfig

    extra = dict(n_experts=4, top_k=2, moe_hidden=64) if moe else {}
    return LlamaConfig(dim=64, n_layers=LAYERS, n_heads=4, n_kv_heads=2, vocab_size=128,
                       max_seq_len=SEQ, **extra)


def _calls_job(axes: dict, sp: bool, recompute: str, compiled: bool, moe: bool):
    """Collective calls per (axis, op) of one forward, and of forward + backward."""
    import os

    import torch
    import torch.distributed as dist

    import meshloom.parallel.context as context
    from meshloom.comm import CommCounter
    from meshloom.config import ParallelConfig
    from meshloom.mesh import Mesh, ParallelDims
    from meshloom.models.llama import Llama
    from meshloom.parallel import parallelize

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=_world(axes))
    mesh = Mesh(ParallelDims(**axes), rank, "cpu", CommCounter())
    torch.manual_seed(0)
    model = Llama(_config(moe))
    pcfg = ParallelConfig(**{"dp_shard": 1, **axes}, sequence_parallel=sp, zero_stage=0)
    par = parallelize(model, mesh, pcfg, activation_checkpointing=recompute,
                      compile_blocks=compiled, compile_backend="aot_eager")
    torch.manual_seed(rank)  # each rank its own tokens (ep routes them apart)
    tokens = torch.randint(0, 128, (2, SEQ))
    args = (tokens,)
    if "cp" in axes:  # the rank's zigzag slice, with its positions
        idx = context.zigzag_indices(SEQ, axes["cp"], mesh.coord("cp"))
        args = (tokens[:, idx], idx)
    out = par.model(*args)
    forward = dict(mesh.counter.calls)
    out.float().square().mean().backward()
    return forward, dict(mesh.counter.calls)


def _world(axes: dict) -> int:
    return math.prod(n for axis, n in axes.items() if axis != "ep")  # ep lies inside dp x cp


@functools.cache
def _calls(axes: tuple, sp: bool, recompute: str, compiled: bool, moe: bool) -> tuple:
    """Rank 0's `_calls_job`. Cached: a layout's run without recompute is the baseline of both
    modes' tests (the same job with the same arguments), so it runs and compiles once."""
    return run_ranks(_calls_job, _world(dict(axes)), dict(axes), sp, recompute, compiled, moe,
                     timeout=600)[0]


def _rerun(axes, sp, recompute, compiled=False, moe=False):
    """(forward calls, extra backward calls over no recompute), rank 0's."""
    fwd, none = _calls(tuple(axes.items()), sp, "none", compiled, moe)
    _, got = _calls(tuple(axes.items()), sp, recompute, compiled, moe)
    return fwd, {k: n - none.get(k, 0) for k, n in got.items() if n != none.get(k, 0)}


def _plan(moe: bool, recompute: str, impl: Implementation, **axes):
    return from_llama_config(_config(moe)), Layout(recompute=recompute, **axes), impl


@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("sp, moe, compiled", [(False, False, False), (True, False, False),
                                               (True, True, False), (True, True, True)],
                         ids=["dense", "dense SP", "MoE SP", "MoE SP compiled"])
def test_tensor_parallel_reruns(sp, moe, compiled, recompute):
    """meshloom's checkpoint reruns the forward's collectives up to the last one the backward
    needs: the attention's all-reduce (with SP its reduce-scatter and both all-gathers; one in
    an MoE block); an MoE block compiles in pieces, and reruns as eager does. (A compiled dense
    block: tests/test_tensor_parallel.py::test_compiled_tp_block_is_one_graph.)"""
    _, extra = _rerun({"tp": 2}, sp, recompute, compiled, moe)
    per_layer = (extra.get(("tp", "all_reduce"), 0) + (extra.get(("tp", "all_gather"), 0)
                 + extra.get(("tp", "reduce_scatter"), 0)) / 2) / LAYERS
    shape, lay, impl = _plan(moe, recompute, Implementation(compile=compiled), tp=2, sp=sp)
    assert per_layer == tp_reruns(shape, lay, impl) > 0
    # A whole-graph implementation (Megatron's) reruns both pairs under full, none under
    # selective.
    megatron = Implementation(compile=True, meshloom_block=False)
    assert tp_reruns(shape, lay, megatron) == (2 if recompute == "full" else 0)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_tensor_and_context_parallel_compiled_reruns(recompute):
    """tp 2 x cp 2 with SP, compiled, on 4 ranks: the ring's sends break the block's graph, so
    selective reruns the tp collectives as eager does (1.5 per layer), full the whole compiled
    block (2); both rerun the ring."""
    fwd, extra = _rerun({"tp": 2, "cp": 2}, True, recompute, compiled=True)
    tp = (extra.get(("tp", "all_gather"), 0) + extra.get(("tp", "reduce_scatter"), 0)) / 2
    shape, lay, impl = _plan(False, recompute, Implementation(compile=True), tp=2, cp=2, sp=True)
    assert tp / LAYERS == tp_reruns(shape, lay, impl) == (2 if recompute == "full" else 1.5)
    assert extra[("cp", "send")] == fwd[("cp", "send")] and ring_reruns(lay, impl)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_context_parallel_ring_reruns(recompute):
    """Both modes rerun the attention core, and with it the ring's sends."""
    fwd, extra = _rerun({"cp": 2}, False, recompute)
    ring = fwd[("cp", "send")]
    assert ring == LAYERS  # cp 2: one hop per layer
    assert extra == {("cp", "send"): ring}
    shape, lay, impl = _plan(False, recompute, Implementation(), cp=2)
    assert ring_reruns(lay, impl)
    assert ring_reruns(lay, Implementation(op_sac=True)) == (recompute == "full")


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_expert_parallel_dispatch_reruns(recompute):
    """meshloom's selective recompute reruns the routing and the dispatch (it keeps no received
    rows), as full does: both forward all-to-alls again, with their split sizes."""
    fwd, extra = _rerun({"dp_shard": 2, "ep": 2}, False, recompute, moe=True)
    assert fwd[("ep", "all_to_all")] == 2 * LAYERS
    assert extra == {("ep", "all_to_all"): 2 * LAYERS, ("ep", "all_to_all_splits"): LAYERS}
    shape, lay, impl = _plan(True, recompute, Implementation(), dp=2, ep=2)
    assert dispatch_reruns(lay, impl)
    assert dispatch_reruns(lay, Implementation(meshloom_block=False)) == (recompute == "full")
