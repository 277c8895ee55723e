"""The gradient copy-in: before a reduce-scatter, the gradients are copied into a flat send buffer
in the reduce dtype on the compute stream (plan/timing.py `_dp_time`): ZeRO-3 per unit in every
implementation, meshloom's ZeRO-2 per bucket every micro-batch, its ZeRO-1 once a step."""

from __future__ import annotations

import pytest

from meshloom.plan.compute import rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import MESHLOOM, Implementation
from meshloom.plan.layout import Layout
from meshloom.plan.memory import rank_param_split
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate

SEQ, BATCH = 2048, 32


@pytest.mark.parametrize("wire, impl", [(4, Implementation()),
                                        (2, Implementation(grad_reduce_dtype="bf16"))])
def test_each_micro_batch_copies_its_gradients_into_the_send_buffer(wire, impl):
    """A read of the bf16 gradients and a write at the wire's bytes, for every parameter of
    the rank, every micro-batch, one kernel a unit; exposed, so the step carries it."""
    shape, lay = PRESETS["llama3-1b"], Layout(dp=8, zero=3, micro_batch=2)
    cl = make_cluster("h100", 8)
    plan = evaluate(shape, lay, cl, SEQ, BATCH, impl=impl)
    dense, experts = rank_param_split(shape, lay, 0, shape.layers)
    m = BATCH // (8 * lay.micro_batch)
    expected = m * rates_for(cl).stream((dense + experts) * (2 + wire), shape.layers)
    dp = plan.timing.detail["comm_s"]["dp"]
    assert dp["ops"]["reduce_scatter_copy_in"] == pytest.approx(expected, rel=1e-12)
    assert dp["exposed"] > expected


def test_fp32_training_copies_fp32_gradients():
    shape, lay = PRESETS["llama3-1b"], Layout(dp=8, zero=3, micro_batch=2)
    cl = make_cluster("h100", 8)
    plan = evaluate(shape, lay, cl, SEQ, BATCH, dtype="fp32")
    dense, experts = rank_param_split(shape, lay, 0, shape.layers)
    m = BATCH // (8 * lay.micro_batch)
    expected = m * rates_for(cl).stream((dense + experts) * 8, shape.layers)
    assert plan.timing.detail["comm_s"]["dp"]["ops"]["reduce_scatter_copy_in"] == (
        pytest.approx(expected, rel=1e-12))


def _copy_in(lay, impl=MESHLOOM):
    plan = evaluate(PRESETS["llama3-1b"], lay, make_cluster("h100", 8), SEQ, BATCH, impl=impl)
    return plan.timing.detail["comm_s"]["dp"]["ops"].get("reduce_scatter_copy_in")


def test_meshloom_zero2_packs_every_micro_batch_and_zero1_casts_once():
    """meshloom's ZeRO-2 packs each bucket's bf16 gradients into the fp32 send buffer every
    micro-batch (parallel/zero.py `_launch_ready`), as ZeRO-3 does per unit; its ZeRO-1 keeps
    whole bf16 gradient buffers and casts them to fp32 once a step (`finish`), and not at all
    when it reduces in bf16."""
    shape, cl = PRESETS["llama3-1b"], make_cluster("h100", 8)
    r = rates_for(cl)
    zero2, zero1 = Layout(dp=8, zero=2, micro_batch=2), Layout(dp=8, zero=1, micro_batch=2)
    dense, experts = rank_param_split(shape, zero2, 0, shape.layers)
    m = BATCH // (8 * zero2.micro_batch)
    one = r.stream((dense + experts) * 6)
    assert _copy_in(zero2) == pytest.approx(m * one, rel=1e-12)
    assert _copy_in(zero1) == pytest.approx(one, rel=1e-12)
    assert _copy_in(zero1, Implementation(grad_reduce_dtype="bf16")) is None


@pytest.mark.parametrize("lay", [Layout(dp=8, zero=1, micro_batch=2),
                                 Layout(dp=8, zero=2, micro_batch=2)])
def test_buffer_reducing_zero12_copies_nothing(lay):
    """Megatron-style ZeRO-1/2 (`meshloom_block` off) reduce their gradient buffers in place."""
    assert _copy_in(lay, Implementation(meshloom_block=False)) is None


def test_ddp_copies_nothing():
    """meshloom's DDP keeps every gradient in its bucket (`param.grad` is a view)."""
    assert _copy_in(Layout(dp=8, zero=0, micro_batch=2)) is None
