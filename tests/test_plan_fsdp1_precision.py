"""FSDP1 as Composer and Lightning run it (plan/implementation.py): `fsdp_flat_param` (every
backward's gradients concatenated into the flat gradient, the cast to the wire dtype on the
post-backward stream) and `fp32_params` (Lightning's `bf16-mixed`: fp32 parameters, autocast
computes; under FSDP the gathers carry them)."""

from __future__ import annotations

import math

import pytest

from meshloom.plan.compute import casts_weights, rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import outer_params, rank_param_split
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate

SEQ, BATCH = 2048, 64
SHAPE = PRESETS["llama3-1b"]
LAY = Layout(dp=8, zero=3, micro_batch=2)
M = BATCH // (8 * LAY.micro_batch)
# Another trainer's loop (as planner_validation runs them, trainers.OTHER_LOOP), reducing in
# bf16.
OTHER = dict(meshloom_block=False, free_unbucketed_grads=False, clip_in_optimizer=False,
             fsdp_carry=False, grad_reduce_dtype="bf16")
FSDP1 = Implementation(**OTHER, fsdp_flat_param=True)
LIGHTNING = Implementation(**OTHER, fsdp_flat_param=True, fp32_params=True)


def _plan(impl, lay=LAY, batch=BATCH, dtype="bf16"):
    return evaluate(SHAPE, lay, make_cluster("h100", 8), SEQ, batch, dtype=dtype, impl=impl)


def _psi(lay=LAY):
    dense, experts = rank_param_split(SHAPE, lay, 0, SHAPE.layers)
    return dense + experts


def _dp(plan):
    return plan.timing.detail["comm_s"]["dp"]


def _one_step_in_buckets(cl, dp: dict, op: str, psi: float) -> None:
    """meshloom's ZeRO-2 gather / DDP all-reduce: one step's bf16 bytes, in DDP's buckets."""
    buckets = dp["calls"][op]["calls"]
    bucket = cl.collective(op, psi * 2 / buckets, 8, 1, "auto").seconds
    assert dp["ops"][op] == pytest.approx(buckets * bucket, rel=1e-12)


def _waited_and_no_sync(lay, fsdp1: dict) -> dict:
    """FSDP1 with `fsdp_prefetch` off (every collective on the step: exposed = all of it,
    more than prefetched) and the plan under `fsdp_no_sync`, returned."""
    waited = _dp(_plan(Implementation(**OTHER, fsdp_flat_param=True, fsdp_prefetch=False),
                       lay))
    assert waited["exposed"] == pytest.approx(sum(waited["ops"].values()), rel=1e-12)
    assert fsdp1["exposed"] < waited["exposed"]
    return _dp(_plan(Implementation(**OTHER, fsdp_flat_param=True, fsdp_no_sync=True), lay))


def test_flat_param_in_16_bits_is_the_packed_copy_in():
    """With bf16 gradients on a bf16 wire, FSDP1's concatenation moves what the packed copy-in
    does (4 bytes a parameter each micro-batch): the same plan, and no cast."""
    packed, flat = _plan(Implementation(**OTHER)), _plan(FSDP1)
    assert _dp(flat)["ops"]["reduce_scatter_copy_in"] == pytest.approx(
        _dp(packed)["ops"]["reduce_scatter_copy_in"], rel=1e-12)
    assert "reduce_scatter_cast" not in _dp(flat)["ops"]
    assert flat.timing.step_time_s == pytest.approx(packed.timing.step_time_s, rel=1e-12)


def test_flat_param_concatenates_every_micro_batch_even_under_no_sync():
    """Under `no_sync()` the flat parameter still receives each backward's gradients through
    the concatenation: m copies where the packed path copies once a step."""
    r = rates_for(make_cluster("h100", 8))
    packed = _plan(Implementation(**OTHER, fsdp_no_sync=True))
    flat = _plan(Implementation(**OTHER, fsdp_no_sync=True, fsdp_flat_param=True))
    one = r.stream(_psi() * 4, SHAPE.layers)
    assert _dp(packed)["ops"]["reduce_scatter_copy_in"] == pytest.approx(one, rel=1e-12)
    assert _dp(flat)["ops"]["reduce_scatter_copy_in"] == pytest.approx(M * one, rel=1e-12)


def test_fp32_params_gather_four_bytes_and_cast_before_each_reduce_scatter():
    """fp32 working parameters: every gather carries twice the bf16 gather's bytes in the same
    calls; the fp32 gradients are concatenated (8 bytes a parameter each micro-batch) and cast
    to the bf16 wire before each reduce-scatter (6 bytes), on the post-backward stream, so the
    cast is reported apart from the compute stream's copy-in."""
    cl = make_cluster("h100", 8)
    r = rates_for(cl)
    bf16, fp32 = _dp(_plan(FSDP1)), _dp(_plan(LIGHTNING))
    assert fp32["calls"]["all_gather"]["calls"] == bf16["calls"]["all_gather"]["calls"]
    psi, outer = _psi(), outer_params(SHAPE, LAY, 0)  # the blocks twice, the rest once
    one = cl.collective("all_gather", (psi - outer) * 4 / SHAPE.layers, 8, 1, "auto")
    rest = cl.collective("all_gather", outer * 4, 8, 1, "auto")
    assert fp32["ops"]["all_gather"] == pytest.approx(
        M * (2 * SHAPE.layers * one.seconds + rest.seconds), rel=1e-12)
    assert fp32["ops"]["all_gather"] > 1.5 * bf16["ops"]["all_gather"]
    assert fp32["ops"]["reduce_scatter"] == pytest.approx(bf16["ops"]["reduce_scatter"],
                                                          rel=1e-12)
    assert fp32["ops"]["reduce_scatter_copy_in"] == pytest.approx(
        M * r.stream(psi * 8, SHAPE.layers), rel=1e-12)
    assert fp32["ops"]["reduce_scatter_cast"] == pytest.approx(
        M * r.stream(psi * 6, SHAPE.layers), rel=1e-12)


def test_fp32_params_cast_every_weight_each_way():
    """Autocast casts the weights every forward and their gradients back every backward, as in
    meshloom's unsharded layouts, whatever the trainer shards; not in fp32 training."""
    assert casts_weights(LAY, 2, LIGHTNING)
    assert not casts_weights(LAY, 2, FSDP1)
    assert not casts_weights(LAY, 4, LIGHTNING)
    for zero in (0, 1, 2):
        lay = Layout(dp=8, zero=zero, micro_batch=2)
        assert casts_weights(lay, 2, LIGHTNING)
        assert not casts_weights(lay, 2, Implementation(**OTHER))
    bf16, fp32 = _plan(FSDP1), _plan(LIGHTNING)
    assert fp32.timing.detail["compute_s"]["gemm"] == bf16.timing.detail["compute_s"]["gemm"]
    assert (fp32.timing.detail["compute_s"]["elementwise"]
            > bf16.timing.detail["compute_s"]["elementwise"])


def test_fp32_params_memory():
    """Model states: fp32 parameter and gradient shards, Adam's moments, no separate master
    (16 bytes a parameter over n, as the bf16 path's 2 + 2 + 12 but for the gradient: 2/n more);
    without recompute the saved bf16 casts of every GEMM weight; under `no_sync` whole fp32
    gradients in the shards' place (the shards come with the step's last reduce)."""
    psi, n = _psi(), 8
    bf16, fp32 = _plan(FSDP1).memory, _plan(LIGHTNING).memory
    assert fp32.params == pytest.approx(4 * psi / n, rel=1e-12)
    assert fp32.grads == pytest.approx(4 * psi / n, rel=1e-12)
    assert fp32.optimizer == pytest.approx(8 * psi / n, rel=1e-12)
    gemm_weights = SHAPE.layers * SHAPE.tp_split_params + SHAPE.vocab * SHAPE.hidden
    assert fp32.activations - bf16.activations == pytest.approx(2 * gemm_weights, rel=1e-9)
    full = Layout(dp=8, zero=3, micro_batch=2, recompute="full")
    assert _plan(LIGHTNING, full).memory.activations == pytest.approx(
        _plan(FSDP1, full).memory.activations, rel=1e-12)
    no_sync = Implementation(**OTHER, fsdp_flat_param=True, fp32_params=True,
                             fsdp_no_sync=True)
    assert _plan(no_sync).memory.grads == pytest.approx(4 * psi, rel=1e-12)


def test_fp32_params_accumulate_fp32_gradients_under_no_sync():
    """Later micro-batches add into the whole fp32 gradients: 12 bytes a parameter each."""
    r = rates_for(make_cluster("h100", 8))
    impl = Implementation(**OTHER, fsdp_flat_param=True, fp32_params=True,
                          fsdp_no_sync=True)
    assert _plan(impl).timing.detail["accumulate_s"] == pytest.approx(
        r.stream(_psi() * 12 * (M - 1)), rel=1e-12)


def test_ddp_and_zero1_under_autocast_keep_fp32_states_and_gather_fp32():
    """DDP and ZeRO-1 over fp32 parameters (Lightning's `bf16` AMP): whole fp32 parameters and
    gradients, Adam's moments (sharded by ZeRO-1), no separate master; ZeRO-1's gather after
    the step carries 4 bytes a parameter (in twice the calls: the buckets hold bytes)."""
    psi = _psi()
    ddp = _plan(LIGHTNING, Layout(dp=8, zero=0, micro_batch=2)).memory
    assert (ddp.params, ddp.grads, ddp.optimizer) == pytest.approx((4 * psi, 4 * psi, 8 * psi),
                                                                   rel=1e-12)
    zero1 = Layout(dp=8, zero=1, micro_batch=2)
    on, off = _plan(LIGHTNING, zero1), _plan(Implementation(**OTHER), zero1)
    assert (on.memory.params, on.memory.grads, on.memory.optimizer) == pytest.approx(
        (4 * psi, 4 * psi, 8 * psi / 8), rel=1e-12)
    on_calls, off_calls = (_dp(p)["calls"]["all_gather"]["calls"] for p in (on, off))
    assert on_calls == math.ceil(psi * 4 / (25 * 2**20)) and off_calls == math.ceil(
        psi * 2 / (25 * 2**20))
    assert _dp(on)["ops"]["all_gather"] > 1.5 * _dp(off)["ops"]["all_gather"]


def test_zero_redundancy_optimizer_all_reduces_in_ddp_buckets_and_broadcasts_after():
    """PyTorch's ZeroRedundancyOptimizer over DDP: ZeRO-1's gradient is all-reduced in DDP's
    buckets (hidden behind the last backward as DDP's is, not after it), then the parameters
    go out as a gather's bytes after the step, exposed; a no-op off ZeRO-1."""
    lay = Layout(dp=8, zero=1, micro_batch=2)
    zro = Implementation(**OTHER, fsdp_flat_param=True, fp32_params=True,
                         zero_redundancy_optimizer=True)
    on, off = _dp(_plan(zro, lay)), _dp(_plan(LIGHTNING, lay))
    cl = make_cluster("h100", 8)
    calls = on["calls"]["all_reduce"]["calls"]  # in DDP's 25 MiB buckets, on OTHER's bf16 wire
    assert calls == math.ceil(_psi() * 2 / (25 * 2**20))
    one = cl.collective("all_reduce", _psi() * 2 / calls, 8, 1, "auto")
    assert "reduce_scatter" not in on["ops"] and "reduce_scatter" in off["ops"]
    assert on["ops"]["all_reduce"] == pytest.approx(calls * one.seconds, rel=1e-12)
    assert on["ops"]["all_gather"] == pytest.approx(off["ops"]["all_gather"], rel=1e-12)
    assert on["exposed"] < on["ops"]["all_reduce"] + on["ops"]["all_gather"]
    assert on["exposed"] >= on["ops"]["all_gather"]
    for other in (LAY, Layout(dp=8, zero=2, micro_batch=2), Layout(dp=8, zero=0, micro_batch=2)):
        a, b = _plan(zro, other), _plan(LIGHTNING, other)
        assert a.timing.step_time_s == pytest.approx(b.timing.step_time_s, rel=1e-12)


def test_fp32_params_are_a_no_op_in_fp32_training():
    for lay in (LAY, Layout(dp=8, zero=1, micro_batch=2), Layout(dp=8, zero=0, micro_batch=2)):
        off = _plan(FSDP1, lay, dtype="fp32")
        on = _plan(LIGHTNING, lay, dtype="fp32")
        assert on.timing.step_time_s == pytest.approx(off.timing.step_time_s, rel=1e-12)
        assert on.memory.total == pytest.approx(off.memory.total, rel=1e-12)


def test_the_keys_parse_as_flags():
    assert parse_fix("fsdp_flat_param=true,fp32_params=true,zero_redundancy_optimizer=1") == {
        "fsdp_flat_param": True, "fp32_params": True, "zero_redundancy_optimizer": True}
    assert not any((Implementation().fsdp_flat_param, Implementation().fp32_params,
                    Implementation().zero_redundancy_optimizer))


def test_flat_param_zero2_is_shard_grad_op():
    """ZeRO-2 under `fsdp_flat_param` is FSDP1's SHARD_GRAD_OP: each unit is gathered in every
    micro-batch's forward and kept to its backward, where it is reduce-scattered, unit by unit;
    meshloom's ZeRO-2 gathers once a step. `fsdp_prefetch` off waits on all of it, and
    `fsdp_no_sync` reduce-scatters on the last micro-batch only."""
    cl = make_cluster("h100", 8)
    lay = Layout(dp=8, zero=2, micro_batch=2)
    psi, units = _psi(lay), SHAPE.layers
    fsdp1, mine = _dp(_plan(FSDP1, lay)), _dp(_plan(Implementation(**OTHER), lay))
    gather = cl.collective("all_gather", psi * 2 / units, 8, 1, "auto").seconds
    scatter = cl.collective("reduce_scatter", psi * 2 / units, 8, 1, "auto").seconds
    assert fsdp1["calls"]["all_gather"]["calls"] == M * units
    assert fsdp1["ops"]["all_gather"] == pytest.approx(M * units * gather, rel=1e-12)
    assert fsdp1["calls"]["reduce_scatter"]["calls"] == M * units
    assert fsdp1["ops"]["reduce_scatter"] == pytest.approx(M * units * scatter, rel=1e-12)
    _one_step_in_buckets(cl, mine, "all_gather", psi)
    zero3 = _dp(_plan(FSDP1))  # twice each block, once the rest (`fsdp_root`)
    assert zero3["calls"]["all_gather"]["calls"] == (
        2 * fsdp1["calls"]["all_gather"]["calls"] + M)
    once = _waited_and_no_sync(lay, fsdp1)
    assert once["calls"]["reduce_scatter"]["calls"] == units
    assert once["calls"]["all_gather"]["calls"] == M * units


def test_flat_param_zero2_keeps_fp32_gradient_shards():
    """FSDP1's SHARD_GRAD_OP keeps each reduce-scattered gradient shard in its flat parameter's
    fp32: 4 bytes a parameter over dp where meshloom's ZeRO-2 keeps 2, nothing else in memory
    moves. Under FULL_SHARD the planner's bf16 shards stay (2 + 2 + 4 + 8 over dp already total
    FSDP1's 4 + 4 + 8), and in fp32 training the shards are fp32 either way."""
    lay = Layout(dp=8, zero=2, micro_batch=2)
    fsdp1, mine = _plan(FSDP1, lay).memory, _plan(Implementation(**OTHER), lay).memory
    psi = _psi(lay)
    assert mine.grads == pytest.approx(2 * psi / 8, rel=1e-12)
    assert fsdp1.grads == pytest.approx(4 * psi / 8, rel=1e-12)
    assert (fsdp1.params, fsdp1.optimizer, fsdp1.activations) == \
        (mine.params, mine.optimizer, mine.activations)
    zero3 = [_plan(impl).memory for impl in (FSDP1, Implementation(**OTHER))]
    assert zero3[0].grads == zero3[1].grads == pytest.approx(2 * _psi() / 8, rel=1e-12)
    fp32 = [_plan(impl, lay, dtype="fp32").memory.grads
            for impl in (FSDP1, Implementation(**OTHER))]
    assert fp32[0] == fp32[1] == pytest.approx(4 * psi / 8, rel=1e-12)


def test_flat_param_zero0_is_no_shard():
    """ZeRO-0 under `fsdp_flat_param` is FSDP1's NO_SHARD: every micro-batch's backward
    all-reduces each unit's flat gradient (after autograd's concatenation into it), where
    meshloom's DDP all-reduces its buckets once a step; `fsdp_prefetch` off waits on them and
    `fsdp_no_sync` all-reduces on the last micro-batch only."""
    cl = make_cluster("h100", 8)
    r = rates_for(cl)
    lay = Layout(dp=8, zero=0, micro_batch=2)
    psi, units = _psi(lay), SHAPE.layers
    fsdp1, ddp = _dp(_plan(FSDP1, lay)), _dp(_plan(Implementation(**OTHER), lay))
    one = cl.collective("all_reduce", psi * 2 / units, 8, 1, "auto").seconds
    assert fsdp1["calls"]["all_reduce"]["calls"] == M * units
    assert fsdp1["ops"]["all_reduce"] == pytest.approx(M * units * one, rel=1e-12)
    assert fsdp1["ops"]["reduce_scatter_copy_in"] == pytest.approx(
        M * r.stream(psi * 4, units), rel=1e-12)
    _one_step_in_buckets(cl, ddp, "all_reduce", psi)
    once = _waited_and_no_sync(lay, fsdp1)
    assert once["calls"]["all_reduce"]["calls"] == units
