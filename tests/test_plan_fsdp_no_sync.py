"""`fsdp_no_sync`: ZeRO-3 accumulating whole gradients over a step's micro-batches and
reduce-scattering once (FSDP's `no_sync()`, as Lightning Fabric's `no_backward_sync` runs it)."""

from __future__ import annotations

import pytest

from meshloom.plan.compute import rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import rank_param_split
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate

SEQ, BATCH = 2048, 64
SHAPE = PRESETS["llama3-1b"]
NO_SYNC = Implementation(fsdp_no_sync=True)


def _plans(lay, batch=BATCH):
    cl = make_cluster("h100", 8)
    return (evaluate(SHAPE, lay, cl, SEQ, batch),
            evaluate(SHAPE, lay, cl, SEQ, batch, impl=NO_SYNC))


def test_one_reduce_scatter_a_step_and_every_gather_kept():
    """Four micro-batches: the reduce-scatters and the gradient copy-in happen once, not four
    times; both gathers of every micro-batch stay."""
    lay = Layout(dp=8, zero=3, micro_batch=2)
    m = BATCH // (8 * lay.micro_batch)
    assert m == 4
    each, once = (p.timing.detail["comm_s"]["dp"] for p in _plans(lay))
    assert once["ops"]["all_gather"] == each["ops"]["all_gather"]
    assert once["ops"]["reduce_scatter"] == pytest.approx(each["ops"]["reduce_scatter"] / m)
    assert once["ops"]["reduce_scatter_copy_in"] == pytest.approx(
        each["ops"]["reduce_scatter_copy_in"] / m)
    assert once["calls"]["reduce_scatter"]["calls"] == each["calls"]["reduce_scatter"]["calls"] / m


def test_whole_gradients_are_kept_and_added_into():
    """The rank's whole bf16 gradients stay in memory beside the shards, and the three later
    micro-batches each add into them (read new, read kept, write: 6 bytes a parameter)."""
    lay = Layout(dp=8, zero=3, micro_batch=2)
    each, once = _plans(lay)
    dense, experts = rank_param_split(SHAPE, lay, 0, SHAPE.layers)
    psi = dense + experts
    assert once.memory.grads - each.memory.grads == pytest.approx(2 * psi)
    expected = rates_for(make_cluster("h100", 8)).stream(psi * 6 * 3)
    assert once.timing.detail["accumulate_s"] == pytest.approx(expected, rel=1e-12)
    assert once.timing.compute == each.timing.compute


@pytest.mark.parametrize("lay, batch", [(Layout(dp=8, zero=3, micro_batch=2), 16),
                                        (Layout(dp=8, zero=2, micro_batch=2), BATCH),
                                        (Layout(dp=8, zero=1, micro_batch=2), BATCH)])
def test_a_no_op_with_one_micro_batch_or_without_zero3(lay, batch):
    each, once = _plans(lay, batch)
    assert once.timing.step_time_s == each.timing.step_time_s
    assert once.memory.total == each.memory.total


def test_the_key_parses_as_a_flag():
    assert parse_fix("fsdp_no_sync=true") == {"fsdp_no_sync": True}
    assert Implementation().fsdp_no_sync is False
