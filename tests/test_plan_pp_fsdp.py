"""ZeRO-3 under a pipeline as PyTorch's pipelining drives FSDP2 (`pp_fsdp=pytorch`, what
`--trainer torchtitan` runs with pp > 1): every unit gathered once a step and held, whole
gradients accumulated in the reduce dtype, one reduce-scatter after the stage's last backward,
waited on (torch.distributed.pipelining stage.py `backward_maybe_with_nosync` and
`perform_reduce_grad`; FSDP2 `to_accumulated_grad_if_needed`). Before, the planner priced
torchtitan's pipelined layouts as meshloom's ZeRO-2, which keeps no whole gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshloom.plan import timing
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import MESHLOOM, Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import rank_param_split
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate
from meshloom.plan.stages import rank_layers, stage_layers
from meshloom.plan.trainers import trainer_impl

SEQ, BATCH = 2048, 32
PIPED = Implementation(pp_fsdp="pytorch")
LLAMA = PRESETS["llama3-8b"]
LAY = Layout(pp=2, dp=4, zero=3, micro_batch=1)


def _plan(lay, impl=MESHLOOM):
    return evaluate(LLAMA, lay, make_cluster("h100", 8), SEQ, BATCH, impl=impl)


def _dp(lay, impl=MESHLOOM):
    return _plan(lay, impl).timing.detail["comm_s"]["dp"]


def _rank_params(lay, rank):
    layers = rank_layers(stage_layers(LLAMA, lay.pp, lay.v, SEQ, MESHLOOM.pp_split), lay.pp)
    return sum(rank_param_split(LLAMA, lay, rank, layers[rank]))


def test_a_fix_key_and_torchtitans_choice():
    assert MESHLOOM.pp_fsdp == "meshloom"
    assert parse_fix("pp_fsdp=pytorch") == {"pp_fsdp": "pytorch"}
    assert trainer_impl("torchtitan")["pp_fsdp"] == "pytorch"


@pytest.mark.parametrize("lay", [Layout(dp=8, zero=3, micro_batch=1),
                                 Layout(pp=2, dp=4, zero=2, micro_batch=1),
                                 Layout(pp=2, dp=4, zero=1, micro_batch=1)])
def test_a_no_op_without_a_pipeline_or_zero3(lay):
    a, b = _plan(lay), _plan(lay, PIPED)
    assert a.memory == b.memory and a.timing.step_time_s == b.timing.step_time_s


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_memory_holds_the_stage_gathered_and_its_whole_gradients(reduce):
    """Every parameter of the stage gathered (bf16) and its whole gradients in the reduce
    dtype, in the shards' place (FSDP2 makes the shards only by the step's reduce, freeing the
    whole ones); the root unit's place is taken by the held units."""
    impl = replace(PIPED, grad_reduce_dtype=reduce)
    got = _plan(LAY, impl).memory
    base = _plan(LAY, replace(MESHLOOM, grad_reduce_dtype=reduce)).memory
    assert got.rank == base.rank
    psi = _rank_params(LAY, got.rank)
    assert got.held_units == psi * 2 and got.root_unit == 0
    assert got.grads == got.whole_grads == psi * (4 if reduce == "fp32" else 2) > base.grads
    assert got.params == base.params and got.optimizer == base.optimizer


def test_one_gather_and_one_reduce_scatter_a_unit_a_step():
    m = LAY.microbatches(BATCH)
    piped, base = _dp(LAY, PIPED), _dp(LAY)
    # meshloom's ZeRO-3 reduce-scatters every micro-batch; PyTorch's pipelining once.
    assert piped["ops"]["reduce_scatter"] == pytest.approx(
        base["ops"]["reduce_scatter"] / m, rel=1e-12)
    # Gathered once a step, as meshloom's held mode gathers (same calls, same seconds).
    held = _dp(LAY, Implementation(reshard_after_forward=False))
    assert piped["calls"]["all_gather"] == held["calls"]["all_gather"]
    assert piped["ops"]["all_gather"] == held["ops"]["all_gather"]
    assert piped["calls"]["reduce_scatter"]["calls"] == (
        held["calls"]["reduce_scatter"]["calls"] / m)


def test_the_reduce_scatter_waits_after_the_last_backward(monkeypatch):
    """Were every overlapped collective hidden for free, the step would still wait for the
    whole reduce-scatter (and its copy-in) on top of the first forward's opening gathers."""
    monkeypatch.setattr(timing, "_exposed", lambda comm, compute: 0.0)
    piped = _dp(LAY, PIPED)
    hidden = _dp(LAY, Implementation(reshard_after_forward=False, fsdp_no_sync=True))
    assert piped["exposed"] - hidden["exposed"] == pytest.approx(
        piped["ops"]["reduce_scatter"] + piped["ops"]["reduce_scatter_copy_in"]
        - hidden["ops"]["reduce_scatter_copy_in"], rel=1e-9)
    # The copy-in reads the fp32 accumulated gradients, not the bf16 ones.
    assert piped["ops"]["reduce_scatter_copy_in"] > hidden["ops"]["reduce_scatter_copy_in"]


def test_accumulation_upcasts_once_and_adds_the_rest():
    """First micro-batch: read bf16, write fp32 (6 bytes); each later one: read bf16 and fp32,
    write fp32 (10 bytes), over every parameter of the stage."""
    m = LAY.microbatches(BATCH)
    cluster = make_cluster("h100", 8)
    plan = _plan(LAY, PIPED)
    rank = plan.memory.rank
    psi = _rank_params(LAY, rank)
    rates = timing.rates_for(cluster)
    want = rates.stream(psi * (6 + (m - 1) * 10))
    layers = rank_layers(stage_layers(LLAMA, LAY.pp, LAY.v, SEQ, MESHLOOM.pp_split), LAY.pp)
    _, _, accumulate = timing._after_backward(LLAMA, LAY, cluster, "bf16", m, rank,
                                              layers[rank], 1.0, 1.0, rates, PIPED)
    assert accumulate == pytest.approx(want, rel=1e-12)


def test_torchtitan_plans_pipelines_as_zero3():
    from meshloom.plan.trainers import layout_problem
    assert layout_problem("torchtitan", LAY) is None
    assert "held gathered for the step" in layout_problem("torchtitan", replace(LAY, zero=2))


def test_one_micro_batch_still_reduces_after_the_backward(monkeypatch):
    """With a single micro-batch the reduce-scatter still waits for the stage's last backward
    (perform_reduce_grad), where meshloom's hides it behind that backward."""
    monkeypatch.setattr(timing, "_exposed", lambda comm, compute: 0.0)
    lay = Layout(pp=2, dp=4, zero=3, micro_batch=4)
    assert lay.microbatches(16) == 1
    got = evaluate(LLAMA, lay, make_cluster("h100", 8), SEQ, 16, impl=PIPED)
    dp = got.timing.detail["comm_s"]["dp"]
    assert dp["exposed"] >= dp["ops"]["reduce_scatter"] > 0


def test_explain_names_the_mode():
    from meshloom.plan.explain import explain
    text = explain(_plan(LAY, PIPED))
    assert "whole gradients in the reduce dtype, reduce-scattered once" in text
    assert "(pp_fsdp=pytorch, held for the step)" in text
    plain = explain(_plan(LAY, Implementation(reshard_after_forward=False)))
    assert "(reshard_after_forward=false)" in plain and "pp_fsdp=pytorch" not in plain
