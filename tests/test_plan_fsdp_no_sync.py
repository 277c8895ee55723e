"""`fsdp_no_sync`: ZeRO-3 accumulating whole gradients over a step's micro-batches and
reduce-scattering once (FSDP's `no_sync()`, as Lightning Fabric's `no_backward_sync` runs it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshloom.plan.compute import rates_for
from meshloom.plan.explain import explain
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
    """FSDP1 (`fsdp_flat_param`): the rank's whole bf16 gradients stay in memory, and the
    three later micro-batches each add into them (read new, read kept, write: 6 bytes a
    parameter). meshloom (`parallel.reduce_once`) sums them in fp32: 4 bytes a parameter held,
    the first micro-batch's bf16 gradients copied in (2 + 4 bytes), each later one added
    (2 + 4 + 4). Both make their shards only by the step's last reduce, as the whole gradients
    are freed (the previous step's were freed by `zero_grad`), so the peak holds the whole
    gradients instead of the shards."""
    lay = Layout(dp=8, zero=3, micro_batch=2)
    dense, experts = rank_param_split(SHAPE, lay, 0, SHAPE.layers)
    psi = dense + experts
    stream = rates_for(make_cluster("h100", 8)).stream
    cl = make_cluster("h100", 8)
    fsdp1 = Implementation(fsdp_flat_param=True)
    for impl, held, moved in ((fsdp1, 2, 6 * 3), (Implementation(), 4, 6 + 10 * 3)):
        each = evaluate(SHAPE, lay, cl, SEQ, BATCH, impl=impl)
        once = evaluate(SHAPE, lay, cl, SEQ, BATCH, impl=replace(impl, fsdp_no_sync=True))
        assert once.memory.grads == pytest.approx(held * psi)
        assert once.memory.grads > each.memory.grads
        # named apart in the breakdown, and in --explain
        assert once.memory.whole_grads == pytest.approx(held * psi) and not each.memory.whole_grads
        assert once.memory.to_dict()["grads_whole"] == once.memory.whole_grads
        assert (f"reduce-scattered once (fsdp_no_sync): {held * psi / 1e9:.2f} GB"
                in explain(once))
        assert once.timing.detail["accumulate_s"] == pytest.approx(stream(psi * moved),
                                                                   rel=1e-12)
        assert once.timing.compute == each.timing.compute


def test_the_peak_holds_the_shards_where_they_are_larger():
    """FSDP1's ZeRO-2 keeps fp32 gradient shards; Mixtral's experts split over ep 8 = dp 8 have
    no data-parallel shard degree left, so after the last reduce their fp32 shards outweigh the
    whole bf16 gradients the step accumulated, and the peak holds them."""
    shape = PRESETS["mixtral-8x7b"]
    lay = Layout(dp=8, ep=8, zero=2, micro_batch=1, recompute="full")
    cl = make_cluster("h200", 8)
    fsdp1 = Implementation(fsdp_flat_param=True)
    each = evaluate(shape, lay, cl, 1024, 32, impl=fsdp1)
    once = evaluate(shape, lay, cl, 1024, 32, impl=replace(fsdp1, fsdp_no_sync=True))
    dense, experts = rank_param_split(shape, lay, 0, shape.layers)
    assert once.memory.whole_grads == pytest.approx(2 * (dense + experts))
    assert once.memory.grads == each.memory.grads > once.memory.whole_grads


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


def test_the_search_takes_it_only_when_clearly_faster():
    """Llama 3 8B on 16 H100s, ZeRO-3 with full recompute, 4 micro-batches: summing once plans
    0.2% faster for 32 GB more, under the search's ALT_MARGIN, so the search keeps plain ZeRO-3;
    on the small model with memory to spare it is several percent faster and stands."""
    from meshloom.plan import search as search_mod

    big = PRESETS["llama3-8b"]
    cl = make_cluster("h100", 16)
    fix = parse_fix("tp=1,pp=1,dp=16,cp=1,micro_batch=1,zero=3,recompute=full")
    lay = Layout(dp=16, zero=3, micro_batch=1, recompute="full")
    plain = evaluate(big, lay, cl, 8192, 64)
    once = evaluate(big, lay, cl, 8192, 64, impl=NO_SYNC)
    gain = 1 - once.timing.step_time_s / plain.timing.step_time_s
    assert 0 < gain < search_mod.ALT_MARGIN
    found = search_mod.search(big, cl, 8192, 64, fix, top=1, try_once=True)[0]
    assert not found.reduce_once and "reduce-once" not in found.short()
    small = search_mod.search(PRESETS["small"], make_cluster("h100", 4), 1024, 16,
                              parse_fix("zero=3,micro_batch=1"), top=1, try_once=True)[0]
    assert small.reduce_once and small.short().endswith("reduce-once")
