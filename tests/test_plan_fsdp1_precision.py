"""FSDP1 as Composer and Lightning run it (plan/implementation.py): `fsdp_flat_param` (every
backward's gradients concatenated into the flat gradient, the cast to the wire dtype on the
post-backward stream) and `fsdp_fp32_params` (Lightning's `bf16-mixed` FSDP: fp32 parameters
gathered, autocast computes)."""

from __future__ import annotations

import pytest

from meshloom.plan.compute import casts_weights, rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import rank_param_split
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate

SEQ, BATCH = 2048, 64
SHAPE = PRESETS["llama3-1b"]
LAY = Layout(dp=8, zero=3, micro_batch=2)
M = BATCH // (8 * LAY.micro_batch)
# Another trainer's loop (as planner_validation runs them), reducing in bf16.
OTHER = dict(meshloom_block=False, free_unbucketed_grads=False, clip_in_optimizer=False,
             grad_reduce_dtype="bf16")
FSDP1 = Implementation(**OTHER, fsdp_flat_param=True)
LIGHTNING = Implementation(**OTHER, fsdp_flat_param=True, fsdp_fp32_params=True)


def _plan(impl, lay=LAY, batch=BATCH, dtype="bf16"):
    return evaluate(SHAPE, lay, make_cluster("h100", 8), SEQ, batch, dtype=dtype, impl=impl)


def _psi(lay=LAY):
    dense, experts = rank_param_split(SHAPE, lay, 0, SHAPE.layers)
    return dense + experts


def _dp(plan):
    return plan.timing.detail["comm_s"]["dp"]


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
    psi = _psi()
    one = cl.collective("all_gather", psi * 4 / SHAPE.layers, 8, 1, "auto")
    assert fp32["ops"]["all_gather"] == pytest.approx(2 * M * SHAPE.layers * one.seconds,
                                                      rel=1e-12)
    assert fp32["ops"]["all_gather"] > 1.5 * bf16["ops"]["all_gather"]
    assert fp32["ops"]["reduce_scatter"] == pytest.approx(bf16["ops"]["reduce_scatter"],
                                                          rel=1e-12)
    assert fp32["ops"]["reduce_scatter_copy_in"] == pytest.approx(
        M * r.stream(psi * 8, SHAPE.layers), rel=1e-12)
    assert fp32["ops"]["reduce_scatter_cast"] == pytest.approx(
        M * r.stream(psi * 6, SHAPE.layers), rel=1e-12)


def test_fp32_params_cast_every_weight_each_way():
    """Autocast casts the weights every forward and their gradients back every backward, as in
    meshloom's unsharded layouts; only ZeRO-3 in bf16 under the flag."""
    assert casts_weights(LAY, 2, LIGHTNING)
    assert not casts_weights(LAY, 2, FSDP1)
    assert not casts_weights(LAY, 4, LIGHTNING)
    assert not casts_weights(Layout(dp=8, zero=2, micro_batch=2), 2, LIGHTNING)
    bf16, fp32 = _plan(FSDP1), _plan(LIGHTNING)
    assert fp32.timing.detail["compute_s"]["gemm"] == bf16.timing.detail["compute_s"]["gemm"]
    assert (fp32.timing.detail["compute_s"]["elementwise"]
            > bf16.timing.detail["compute_s"]["elementwise"])


def test_fp32_params_memory():
    """Model states: fp32 parameter and gradient shards, Adam's moments, no separate master
    (16 bytes a parameter over n, as the bf16 path's 2 + 2 + 12 but for the gradient: 2/n more);
    without recompute the saved bf16 casts of every GEMM weight; under `no_sync` whole fp32
    gradients."""
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
    no_sync = Implementation(**OTHER, fsdp_flat_param=True, fsdp_fp32_params=True,
                             fsdp_no_sync=True)
    assert _plan(no_sync).memory.grads == pytest.approx(4 * psi + 4 * psi / n, rel=1e-12)


def test_fp32_params_accumulate_fp32_gradients_under_no_sync():
    """Later micro-batches add into the whole fp32 gradients: 12 bytes a parameter each."""
    r = rates_for(make_cluster("h100", 8))
    impl = Implementation(**OTHER, fsdp_flat_param=True, fsdp_fp32_params=True,
                          fsdp_no_sync=True)
    assert _plan(impl).timing.detail["accumulate_s"] == pytest.approx(
        r.stream(_psi() * 12 * (M - 1)), rel=1e-12)


@pytest.mark.parametrize("lay, dtype", [(Layout(dp=8, zero=2, micro_batch=2), "bf16"),
                                        (Layout(dp=8, zero=1, micro_batch=2), "bf16"),
                                        (LAY, "fp32")])
def test_no_op_off_zero3_or_in_fp32(lay, dtype):
    off = _plan(Implementation(**OTHER), lay, dtype=dtype)
    on = _plan(LIGHTNING, lay, dtype=dtype)
    assert on.timing.step_time_s == pytest.approx(off.timing.step_time_s, rel=1e-12)
    assert on.memory.total == pytest.approx(off.memory.total, rel=1e-12)


def test_the_keys_parse_as_flags():
    assert parse_fix("fsdp_flat_param=true,fsdp_fp32_params=true") == {
        "fsdp_flat_param": True, "fsdp_fp32_params": True}
    assert not Implementation().fsdp_flat_param and not Implementation().fsdp_fp32_params
