"""ZeRO-3 between two micro-batches of a step (`fsdp_carry`, plan/timing.py `_dp_time`):
meshloom's ZeRO-3 under plain accumulation keeps the first block (and a root holding the token
table) gathered from one micro-batch's backward to the next one's forward and gathers the
embedding behind that backward, so each later micro-batch makes fewer gathers and exposes none
of its first ones. FSDP1 and FSDP2 regather them. tests/test_fsdp_carry.py checks meshloom's
ZeRO-3 does so on real ranks, tests/test_zero.py its exact bytes."""

from __future__ import annotations

import pytest

from meshloom.plan import timing
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import MESHLOOM, Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import memory_per_gpu, outer_params
from meshloom.plan.models import PRESETS, from_dims
from meshloom.plan.search import evaluate
from meshloom.plan.trainers import TRAINERS, trainer_impl

SEQ, BATCH = 2048, 32
OFF = Implementation(fsdp_carry=False)
LLAMA = PRESETS["llama3-8b"]  # untied
TIED = from_dims("llama", LLAMA.hidden, LLAMA.layers, LLAMA.heads, LLAMA.vocab,
                 kv_heads=LLAMA.kv_heads, ffn_hidden=LLAMA.ffn_hidden, tied=True)


def _dp(lay, impl=MESHLOOM, shape=LLAMA):
    plan = evaluate(shape, lay, make_cluster("h100", 8), SEQ, BATCH, impl=impl)
    return plan.timing.detail["comm_s"]["dp"]


def _gather_s(params: float) -> float:
    return make_cluster("h100", 8).collective("all_gather", params * 2, 8, 1, "auto").seconds


def test_only_meshloom_carries():
    assert MESHLOOM.fsdp_carry
    for name in TRAINERS:
        assert trainer_impl(name)["fsdp_carry"] is False
    assert parse_fix("fsdp_carry=false") == {"fsdp_carry": False}


@pytest.mark.parametrize("shape, kept", [(LLAMA, 1), (TIED, 2)])
def test_later_micro_batches_make_fewer_gathers(shape, kept):
    """Untied: the first block is not gathered again (the embedding still is, behind the
    backward). Tied: nor is the root, which holds the table the embedding reads."""
    lay = Layout(dp=8, zero=3, micro_batch=1)
    m = BATCH // 8
    on, off = _dp(lay, shape=shape), _dp(lay, OFF, shape)
    assert off["calls"]["all_gather"]["calls"] - on["calls"]["all_gather"]["calls"] == (
        kept * (m - 1))
    block = _gather_s(shape.layer_params)
    lead = _gather_s(outer_params(shape, lay, 0)) if kept == 2 else 0.0
    assert off["ops"]["all_gather"] - on["ops"]["all_gather"] == pytest.approx(
        (m - 1) * (block + lead), rel=1e-9)
    assert on["ops"]["reduce_scatter"] == off["ops"]["reduce_scatter"]


@pytest.mark.parametrize("lay", [Layout(dp=8, zero=3, micro_batch=4),  # one micro-batch
                                 Layout(pp=2, dp=4, zero=3, micro_batch=1),  # a pipeline
                                 Layout(dp=8, zero=2, micro_batch=1)])  # not ZeRO-3
def test_nothing_to_carry(lay):
    on, off = _dp(lay), _dp(lay, OFF)
    assert on == off


def test_only_the_first_micro_batch_opens_exposed(monkeypatch):
    """Were every overlapped gather hidden for free, the step would wait for the first
    micro-batch's embedding and first block only (without carrying: every micro-batch's)."""
    monkeypatch.setattr(timing, "_exposed", lambda comm, compute: 0.0)
    lay = Layout(dp=8, zero=3, micro_batch=1)
    m = BATCH // 8
    opening = _gather_s(LLAMA.embedding_params) + _gather_s(LLAMA.layer_params)
    on, off = _dp(lay), _dp(lay, OFF)
    assert on["exposed"] == pytest.approx(
        opening + on["ops"]["reduce_scatter_copy_in"], rel=1e-9)
    assert off["exposed"] == pytest.approx(
        m * opening + off["ops"]["reduce_scatter_copy_in"], rel=1e-9)


def test_the_embedding_is_gathered_behind_the_backward_before(monkeypatch):
    """Each backward but the last carries the next forward's embedding gather beside its own
    gathers and reduce-scatters; each forward but the first hides its gathers less the
    first block's."""
    seen: list[tuple[float, float]] = []
    monkeypatch.setattr(timing, "_exposed",
                        lambda comm, compute: seen.append((comm, compute)) or 0.0)
    _dp(Layout(dp=8, zero=3, micro_batch=1))
    # Two windows each: a forward's (f) and a backward's (b) compute, the shorter first.
    f_mb, b_mb = sorted({compute for _, compute in seen})
    fwd = sorted(comm for comm, compute in seen if compute == f_mb)
    bwd = sorted(comm for comm, compute in seen if compute == b_mb)
    assert len(fwd) == len(bwd) == 2
    assert fwd[1] - fwd[0] == pytest.approx(_gather_s(LLAMA.layer_params), rel=1e-9)
    assert bwd[1] - bwd[0] == pytest.approx(_gather_s(LLAMA.embedding_params), rel=1e-9)


def test_carrying_is_faster_and_holds_no_more_memory():
    """What is held from the first block's backward to the next forward is what that forward
    opens with, never more than the planner's peak (where the backward begins) holds."""
    lay = Layout(dp=8, zero=3, micro_batch=1)
    cluster = make_cluster("h100", 8)
    for shape in (LLAMA, TIED):
        on = evaluate(shape, lay, cluster, SEQ, BATCH)
        off = evaluate(shape, lay, cluster, SEQ, BATCH, impl=OFF)
        assert on.timing.step_time_s < off.timing.step_time_s
        assert memory_per_gpu(shape, lay, SEQ, BATCH).total == memory_per_gpu(
            shape, lay, SEQ, BATCH, impl=OFF).total


@pytest.mark.parametrize("shape,root", [(LLAMA, "head"), (TIED, "head"), (LLAMA, "outer")])
def test_a_carried_unit_is_not_copied_out_again(shape, root):
    """With FSDP2's copy-out (`fsdp_copy_out`) priced beside carrying, every micro-batch after
    the first copies out one unit (and a root holding the first outer parameters) fewer: its
    gather is not made again. Counted in bytes through the stream rate, one kernel per copy."""
    lay = Layout(dp=8, zero=3, micro_batch=1)
    m = lay.microbatches(BATCH)
    on = Implementation(fsdp_copy_out=True, fsdp_root=root)
    off = Implementation(fsdp_copy_out=True, fsdp_root=root, fsdp_carry=False)
    rates = timing.rates_for(make_cluster("h100", 8))
    outer = outer_params(shape, lay, 0) * 2
    units = shape.layers
    gathered = sum(timing.rank_param_split(shape, lay, 0, units)) * 2
    whole = 2 * (gathered + gathered - outer)
    kernels = 2 * units + 1
    lead = timing.zero3_first_outer_params(shape, lay, 0, on) * 2
    root_held = root == "outer" or shape.tied
    held = (gathered - outer) / units + (lead if root_held else 0.0)
    want = (rates.stream(whole, kernels)
            + (m - 1) * rates.stream(whole - 2 * held, kernels - (2 if root_held else 1)))
    assert _dp(lay, on, shape)["ops"]["all_gather_copy_out"] == pytest.approx(want, rel=1e-12)
    assert _dp(lay, off, shape)["ops"]["all_gather_copy_out"] == pytest.approx(
        m * rates.stream(whole, kernels), rel=1e-12)
