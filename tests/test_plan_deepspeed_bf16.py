"""`deepspeed_bf16_optimizer`: ZeRO-1 as DeepSpeed's 2022 BF16_Optimizer runs it (BLOOM): whole
fp32 gradients and master copy on every rank, an fp32 copy added in per micro-batch, the whole
gradient all-reduced after the backward (plan/implementation.py, plan/timing.py, plan/memory.py).
"""

from __future__ import annotations

import pytest

from meshloom.plan.compute import ACCUMULATE_BF16_TO_FP32, rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import rank_param_split
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate
from meshloom.plan.timing import tied_table_sync

SEQ, BATCH = 2048, 64
DS = Implementation(deepspeed_bf16_optimizer=True, grad_reduce_dtype="fp32")
ZERO1 = Implementation(grad_reduce_dtype="fp32")


def _plans(shape, lay, cl):
    return (evaluate(shape, lay, cl, SEQ, BATCH, impl=ZERO1),
            evaluate(shape, lay, cl, SEQ, BATCH, impl=DS))


def test_the_whole_fp32_gradient_is_all_reduced_not_reduce_scattered():
    """The gradients go out in one all-reduce of the rank's whole buffer (4 bytes a parameter,
    in calls of DeepSpeed's 5e8-element buckets), exposed with the parameter gather after the
    step, which is the same as ZeRO-1's."""
    shape, lay = PRESETS["llama3-8b"], Layout(dp=8, zero=1, micro_batch=2)
    cl = make_cluster("h100", 8)
    impl = Implementation(deepspeed_bf16_optimizer=True, grad_reduce_dtype="fp32",
                          dp_buckets="deepspeed")
    zero1 = evaluate(shape, lay, cl, SEQ, BATCH, impl=Implementation(dp_buckets="deepspeed"))
    ds = evaluate(shape, lay, cl, SEQ, BATCH, impl=impl)
    dense, experts = rank_param_split(shape, lay, 0, shape.layers)
    psi = dense + experts
    calls = -(-psi // 5e8)
    one = cl.collective("all_reduce", psi * 4 / calls, 8, 1, "auto")
    dp = ds.timing.detail["comm_s"]["dp"]
    assert "reduce_scatter" not in dp["ops"]
    assert dp["ops"]["all_reduce"] == pytest.approx(calls * one.seconds, rel=1e-12)
    assert dp["calls"]["all_reduce"]["calls"] == calls
    gather = zero1.timing.detail["comm_s"]["dp"]["ops"]["all_gather"]
    assert dp["ops"]["all_gather"] == gather
    assert ds.timing.dp == pytest.approx(dp["ops"]["all_reduce"] + gather, rel=1e-12)
    assert ds.timing.dp > zero1.timing.dp


def test_every_micro_batch_adds_an_fp32_copy_of_its_gradients():
    """18 bytes a parameter for every micro-batch of the step, the first too (the fp32 buffer
    is zeroed after the step), where autograd's accumulation into fp32 gradients moves 12."""
    shape, lay = PRESETS["llama3-1b"], Layout(dp=8, zero=1, micro_batch=2)
    cl = make_cluster("h100", 8)
    zero1, ds = _plans(shape, lay, cl)
    m = BATCH // (8 * lay.micro_batch)
    dense, experts = rank_param_split(shape, lay, 0, shape.layers)
    expected = rates_for(cl).stream((dense + experts) * ACCUMULATE_BF16_TO_FP32 * m)
    assert ds.timing.detail["accumulate_s"] == pytest.approx(expected, rel=1e-12)
    assert ds.timing.detail["accumulate_s"] > zero1.timing.detail["accumulate_s"]
    assert ds.timing.compute == zero1.timing.compute


def test_every_rank_keeps_whole_fp32_gradients_and_master_copy():
    """Beside the bf16 parameters and gradients, 4 bytes of fp32 gradient and 4 of fp32 master
    for every parameter of the rank; only the 8 bytes of moments are sharded."""
    shape, lay = PRESETS["llama3-1b"], Layout(dp=8, zero=1, micro_batch=2)
    cl = make_cluster("h100", 8)
    zero1, ds = _plans(shape, lay, cl)
    dense, experts = rank_param_split(shape, lay, 0, shape.layers)
    psi = dense + experts
    assert zero1.memory.grads == pytest.approx(2 * psi)
    assert ds.memory.params == zero1.memory.params
    assert ds.memory.grads == pytest.approx(6 * psi)
    assert ds.memory.optimizer == pytest.approx(4 * psi + 8 * psi / 8)
    assert zero1.memory.optimizer == pytest.approx(12 * psi / 8)
    assert ds.memory.activations == zero1.memory.activations


def test_the_tied_table_is_summed_in_fp32():
    """With a tied table split between the first and last stage, the two copies' fp32
    gradients (`_hp_grad`) are all-reduced: twice the bf16 gradient's bytes."""
    shape = PRESETS["llama3-1b"]
    assert shape.tied
    lay = Layout(pp=2, dp=4, zero=1, micro_batch=1, schedule="1f1b")
    cl = make_cluster("h100", 8)
    zero1, ds = _plans(shape, lay, cl)
    fp32 = tied_table_sync(shape, lay, cl, "bf16", "auto", 4)
    bf16 = tied_table_sync(shape, lay, cl, "bf16", "auto")
    assert fp32.seconds > bf16.seconds > 0
    def tied(plan):
        return plan.timing.detail["comm_s"]["pp"]["ops"]["tied_table_all_reduce"]

    assert tied(ds) == pytest.approx(fp32.seconds)
    assert tied(zero1) == pytest.approx(bf16.seconds)


@pytest.mark.parametrize("lay, dtype", [
    (Layout(dp=8, zero=0, micro_batch=2), "bf16"),
    (Layout(dp=8, zero=2, micro_batch=2), "bf16"),
    (Layout(dp=8, zero=3, micro_batch=2), "bf16"),
    (Layout(dp=8, zero=1, micro_batch=2), "fp32"),
])
def test_a_no_op_off_zero1_in_bf16(lay, dtype):
    shape, cl = PRESETS["llama3-1b"], make_cluster("h100", 8)
    off = evaluate(shape, lay, cl, SEQ, BATCH, dtype=dtype, impl=ZERO1)
    on = evaluate(shape, lay, cl, SEQ, BATCH, dtype=dtype, impl=DS)
    assert on.timing.step_time_s == off.timing.step_time_s
    assert on.memory.total == off.memory.total


def test_the_key_parses_as_a_flag():
    assert parse_fix("deepspeed_bf16_optimizer=true") == {"deepspeed_bf16_optimizer": True}
    assert Implementation().deepspeed_bf16_optimizer is False
