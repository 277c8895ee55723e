"""Megatron-style fused q/k/v projection (`Implementation.fused_qkv`, compute.launched_gemms):
which trainers launch one GEMM, that it has the three's FLOPs, and what the step pays for it
(planner arithmetic on the kernel tables, no timing)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshloom.plan import PlanError
from meshloom.plan.compute import block_cost, launched_gemms, rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import MESHLOOM
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.models import PRESETS, from_dims
from meshloom.plan.step_kernels import block_gemms
from meshloom.plan.trainers import trainer_impl

LLAMA405B = PRESETS["llama3-405b"]
FUSED = replace(MESHLOOM, fused_qkv=True)


@pytest.mark.parametrize("trainer, fused", [("megatron-lm", True), ("nemo", True),
                                             ("tinyllama", True), ("torchtitan", False),
                                             ("llm-foundry", False)])
def test_which_trainers_fuse(trainer, fused):
    assert trainer_impl(trainer).get("fused_qkv", False) is fused
    assert MESHLOOM.fused_qkv is False  # meshloom's Llama runs wq, wk and wv


def test_one_gemm_of_the_three_widths_and_their_flops():
    gemms = block_gemms(LLAMA405B, 8192, 8)
    fused = launched_gemms(gemms, FUSED)
    assert [g.name for g in fused] == ["qkv", "wo", "w1", "w3", "w2"]
    q, k, v = gemms[:3]
    assert (fused[0].m, fused[0].n, fused[0].k) == (8192, q.n + k.n + v.n, q.k)
    assert fused[0].n == (128 + 2 * 8) * 128 // 8  # (heads + 2 kv heads) x head_dim / tp
    assert fused[0].flops == pytest.approx(q.flops + k.flops + v.flops, rel=1e-12)
    assert launched_gemms(gemms, MESHLOOM) is gemms
    gpt = from_dims("gpt", 1024, 4, 16, 1000)  # one projection already
    assert launched_gemms(block_gemms(gpt, 64, 1), FUSED) == block_gemms(gpt, 64, 1)


def test_the_block_pays_the_fused_gemm_and_nothing_else():
    """Forward and backward GEMM time change by exactly the three GEMMs' price against the
    one's; the elementwise work (and its kernel count) does not move."""
    lay = Layout(tp=8, pp=1, dp=8, micro_batch=1, zero=1, recompute="selective", sp=True)
    rates = rates_for(make_cluster("h100", 64))
    split = block_cost(LLAMA405B, lay, rates, 8192, 2, True, MESHLOOM)
    fused = block_cost(LLAMA405B, lay, rates, 8192, 2, True, FUSED)
    gemms = block_gemms(LLAMA405B, 8192, 8)
    three, one = gemms[:3], launched_gemms(gemms, FUSED)[:1]
    fwd = sum(rates.gemm(g) for g in three) - sum(rates.gemm(g) for g in one)
    bwd = (sum(rates.gemm(b) for g in three for b in g.backward())
           - sum(rates.gemm(b) for g in one for b in g.backward()))
    assert split.fwd.gemm - fused.fwd.gemm == pytest.approx(fwd, rel=1e-9)
    assert split.bwd.gemm - fused.bwd.gemm == pytest.approx(bwd, rel=1e-9)
    assert fwd > 0 and bwd > 0  # GQA's 128-column K and V are dearer apart
    assert fused.fwd.elementwise == split.fwd.elementwise
    assert fused.bwd.elementwise == split.bwd.elementwise


def test_the_key_parses_and_refuses_bad_values():
    assert parse_fix("fused_qkv=true")["fused_qkv"] is True
    with pytest.raises(PlanError, match="fused_qkv=sometimes must be true or false"):
        parse_fix("fused_qkv=sometimes")
