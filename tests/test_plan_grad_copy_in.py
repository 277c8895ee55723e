"""ZeRO-3's gradient copy-in: before each unit's reduce-scatter, its gradients are copied into a
flat send buffer in the reduce dtype on the compute stream (plan/timing.py `_dp_time`)."""

from __future__ import annotations

import pytest

from meshloom.plan.compute import rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
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


@pytest.mark.parametrize("lay", [Layout(dp=8, zero=1, micro_batch=2),
                                 Layout(dp=8, zero=2, micro_batch=2),
                                 Layout(dp=8, zero=0, micro_batch=2)])
def test_only_zero3_units_copy_in(lay):
    """ZeRO-1/2 reduce whole buckets and DDP its buckets: no per-unit copy-in is priced."""
    plan = evaluate(PRESETS["llama3-1b"], lay, make_cluster("h100", 8), SEQ, BATCH)
    assert "reduce_scatter_copy_in" not in plan.timing.detail["comm_s"]["dp"]["ops"]
