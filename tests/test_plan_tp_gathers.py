"""`tp_input_gathers`: how many tensor-parallel collectives a block issues when DTensor's
`ColwiseParallel(input_layouts=Shard(1))` sits on each projection (KempnerForge's plan,
`per_linear`) against one gather shared by the projections that read a norm (`shared`:
meshloom, Megatron, torchtitan's `PrepareModuleInput`). The counts are taken from PyTorch
itself on two Gloo ranks, eager (CommDebugMode) and compiled (the graphs AOTAutograd hands its
compiler), and compared with what the planner charges (plan/reruns.py `tp_pass_worths`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout
from meshloom.plan.models import PRESETS
from meshloom.plan.reruns import tp_pass_worths
from meshloom.plan.search import evaluate
from meshloom.plan.trainers import trainer_impl

D = 32


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) * self.k(x) + self.v(x))  # the core's stand-in: no collective


class _SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False)
        self.down = nn.Linear(2 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(D), _Attention()
        self.norm2, self.mlp = nn.RMSNorm(D), _SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _plan(per_linear: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    plan = {"norm1": SequenceParallel(), "norm2": SequenceParallel(), "attn.o": row,
            "mlp.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    if per_linear:  # KempnerForge: each projection gathers its own input
        for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
            plan[name] = ColwiseParallel(input_layouts=Shard(1))
    else:  # one gather per norm output, as torchtitan prepares the attention and the MLP
        for name in ("attn", "mlp"):
            plan[name] = PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),))
        for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
            plan[name] = ColwiseParallel()
    return plan


def _ops(names) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in names:
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
            if op in name:
                out[op] = out.get(op, 0) + 1
    return out


def _count_job(per_linear: bool, compiled: bool) -> tuple[dict, dict]:
    """(forward, backward) collective counts of one block pass on this rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        block = parallelize_module(_Block(), mesh, _plan(per_linear))
        x = DTensor.from_local(torch.randn(2, 4, D, requires_grad=True), mesh, [Shard(1)])
        if compiled:
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            graphs: list[dict] = []

            def count(gm, _):
                graphs.append(_ops(str(n.target) for n in gm.graph.nodes
                                   if n.op == "call_function"))
                return make_boxed_func(gm.forward)

            fn = torch.compile(block, fullgraph=True,
                               backend=aot_autograd(fw_compiler=count, bw_compiler=count))
            fn(x).to_local().sum().backward()
            return graphs[0], graphs[1]
        with CommDebugMode() as comm:
            y = block(x)
        fwd = _ops(str(k) for k, n in comm.get_comm_counts().items() for _ in range(n))
        with CommDebugMode() as comm:
            y.to_local().sum().backward()
        bwd = _ops(str(k) for k, n in comm.get_comm_counts().items() for _ in range(n))
        return fwd, bwd
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_pytorch_issues_what_the_planner_charges(compiled):
    """Per linear: 5 all-gathers and 2 reduce-scatters forward, 2 and 5 backward, in eager
    DTensor and in the graphs torch.compile builds (it does not merge the five gathers of
    the same input); shared: 2 and 2 each way. The planner's worths (an all-gather or a
    reduce-scatter half an all-reduce) are those counts halved."""
    from dist_harness import run_ranks

    llama = PRESETS["llama3-8b"]
    lay = Layout(tp=2, sp=True)
    for per_linear in (True, False):
        fwd, bwd = run_ranks(_count_job, 2, per_linear, compiled, timeout=300)[0]
        gathers = 5 if per_linear else 2
        assert fwd == {"all_gather_into_tensor": gathers, "reduce_scatter_tensor": 2}
        assert bwd == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": gathers}
        impl = Implementation(meshloom_block=False,
                              tp_input_gathers="per_linear" if per_linear else "shared")
        assert tp_pass_worths(llama, lay, impl) == ((gathers + 2) / 2, (gathers + 2) / 2)


def test_recompute_reruns_every_gather_and_fused_projections_need_none_extra():
    llama, gpt = PRESETS["llama3-8b"], PRESETS["gpt2"]
    per = Implementation(meshloom_block=False, tp_input_gathers="per_linear")
    shared = Implementation(meshloom_block=False)
    full = Layout(tp=4, sp=True, recompute="full")
    assert tp_pass_worths(llama, full, per) == (3.5, 7.0)  # 7 forward, and 7 + 7 backward
    assert tp_pass_worths(llama, full, shared) == (2.0, 4.0)
    # one q/k/v projection: only the SwiGLU's up gathers again; GPT blocks read each norm once
    assert tp_pass_worths(llama, full, Implementation(
        meshloom_block=False, tp_input_gathers="per_linear", fused_qkv=True)) == (2.5, 5.0)
    assert tp_pass_worths(gpt, full, per) == tp_pass_worths(gpt, full, shared)
    # without SP each projection all-reduces its input gradient: 5 backward, 2 forward
    assert tp_pass_worths(llama, Layout(tp=4, pp=2, schedule="1f1b"), per) == (2.0, 5.0)
    assert tp_pass_worths(llama, Layout(), per) == (0.0, 0.0)


def test_kempnerforges_tp_step_pays_for_each_gather_and_its_copies():
    """KempnerForge's TP 2 row: the blocks' collectives cost 21/12 of the shared gathers' (7 a
    pass, the forward again under full recompute), and at four sequences a micro-batch every
    one of them also copies its tensor (`sp_copies`); nothing else moves."""
    from dataclasses import replace

    shape, cluster = PRESETS["llama3-8b"], make_cluster("h200", 2, 4, nvlink_mesh=4)
    lay = Layout(tp=2, sp=True, micro_batch=4, recompute="full")
    kf = Implementation(**trainer_impl("kempnerforge"))
    assert kf.tp_input_gathers == "per_linear"

    def step(impl: Implementation):
        return evaluate(shape, lay, cluster, 4096, 8, impl=impl).timing.detail

    per, shared = step(kf), step(replace(kf, tp_input_gathers="shared"))
    got = per["comm_s"]["tp"]["ops"]["collectives"]
    base = shared["comm_s"]["tp"]["ops"]["collectives"]
    assert got == pytest.approx(base * 21 / 12, rel=1e-12)
    assert per["comm_s"]["tp"]["calls"]["collectives"]["calls"] == \
        shared["comm_s"]["tp"]["calls"]["collectives"]["calls"] * 21 // 12
    assert per["compute_s"]["gemm"] == shared["compute_s"]["gemm"]
    assert per["compute_s"]["elementwise"] > shared["compute_s"]["elementwise"]  # the copies
