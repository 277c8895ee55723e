"""The residual stream's dtype (`Implementation.residual_stream`): which trainers keep it in
fp32, the bytes and kernels its adds, norms and casts add to a fused block, and the
activations it keeps (planner arithmetic, no timing)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshloom.plan import PlanError
from meshloom.plan.compute import block_cost, rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import MESHLOOM, Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import final_norm_bytes, layer_activation_bytes
from meshloom.plan.models import from_dims
from meshloom.plan.search import search
from meshloom.plan.step_kernels import block_kernels, elementwise_bytes_per_token, norm_casts
from meshloom.plan.trainers import TRAINERS, trainer_impl

# TinyLlama 1.1B and flash-attention's GPT-3 125M as runs.json records them
TINY = from_dims("llama", 2048, 22, 32, 32000, kv_heads=4, ffn_hidden=5632, positions=0)
GPT = from_dims("gpt", 768, 12, 12, 50264, positions=2048, dropout=True)
H = TINY.hidden
OTHER = replace(MESHLOOM, meshloom_block=False, compile=True)  # Korthikanti's count, fused


def test_which_trainers_keep_an_fp32_stream():
    assert trainer_impl("tinyllama")["residual_stream"] == "fp32_cast"
    assert trainer_impl("tinyllama")["fused_swiglu"] is True  # xformers' packed SwiGLU
    assert trainer_impl("flash-attention")["residual_stream"] == "fp32"  # residual_in_fp32
    assert all(keys.get("residual_stream", "16bit") == "16bit" for name, keys in
               TRAINERS.items() if name not in ("tinyllama", "flash-attention"))
    assert MESHLOOM.residual_stream == "16bit"


def test_casts_count_the_projections_that_read_a_norm():
    moe = replace(from_dims("llama", 1024, 4, 16, 1000), n_experts=8, top_k=2, moe_hidden=512,
                  moe_imbalance=1.0)
    assert norm_casts(TINY, fused_qkv=True, fused_swiglu=True) == 2  # attn, packed SwiGLU
    assert norm_casts(TINY, fused_qkv=False, fused_swiglu=False) == 5  # wq wk wv, w1 w3
    assert norm_casts(GPT, fused_qkv=False, fused_swiglu=False) == 2  # qkv, fc1
    assert norm_casts(moe, fused_qkv=True, fused_swiglu=False) == 3  # qkv, router, dispatch


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_stream_bytes_per_token(tp, sp):
    """Adds (8 + e)h each; norms 8h (`fp32_cast`, plus a (4 + e)h cast per projection) or
    (4 + e)h (`fp32`), on the 1/t slice under SP; in place of the 16-bit 2·3h·e + 2·2h·e."""
    e, casts, whole = 2, 2, tp if sp else 1
    base = elementwise_bytes_per_token(TINY, tp, sp, e, "fused", expand_kv=False)
    stream16 = (2 * 3 * H * e + 2 * 2 * H * e) / whole
    want = {"fp32_cast": (2 * (8 + e) * H + 2 * 8 * H) / whole + casts * (4 + e) * H,
            "fp32": (2 * (8 + e) * H + 2 * (4 + e) * H) / whole}
    for stream, bytes32 in want.items():
        got = elementwise_bytes_per_token(TINY, tp, sp, e, "fused", expand_kv=False,
                                          stream=stream, casts=casts)
        assert got - base == pytest.approx(bytes32 - stream16, rel=1e-12), stream
        # the eager count has its own fp32 norms: the key does not touch it
        assert elementwise_bytes_per_token(TINY, tp, sp, e, "eager", stream=stream,
                                           casts=casts) == \
            elementwise_bytes_per_token(TINY, tp, sp, e, "eager")
    if tp == 1:  # the docs' 48h against 20h
        assert want["fp32_cast"] == 48 * H and stream16 == 20 * H


def test_gpt_keeps_its_dropout_masks_in_an_fp32_stream():
    h, e = GPT.hidden, 2
    base = elementwise_bytes_per_token(GPT, 1, False, e, "fused")
    fp32 = elementwise_bytes_per_token(GPT, 1, False, e, "fused", stream="fp32")
    # per pair: add 3he + mask -> (8 + e)h + mask, norm 2he -> (4 + e)h
    assert fp32 - base == pytest.approx(2 * ((8 + e) * h + (4 + e) * h - 5 * h * e))


def test_a_kernel_per_cast():
    assert block_kernels(TINY, "fused", True, False, casts=2) \
        - block_kernels(TINY, "fused", True, False) == 2


def test_the_block_pays_the_stream_in_elementwise_time_only():
    lay = Layout(tp=1, pp=1, dp=16, micro_batch=8, zero=3, recompute="none")
    rates = rates_for(make_cluster("a100-40g", 16))
    impl = Implementation(**trainer_impl("tinyllama"))
    off = replace(impl, residual_stream="16bit")
    on_cost = block_cost(TINY, lay, rates, 2048, 2, True, impl)
    off_cost = block_cost(TINY, lay, rates, 2048, 2, True, off)
    extra = 8 * 2048 * 28 * H  # 48h - 20h a token, at the table's bandwidth (bytes-bound)
    per_byte = rates.stream(1e12) / 1e12
    assert rates.stream(extra) > rates.stream(0.0, 2)  # not launch-bound
    assert on_cost.fwd.elementwise - off_cost.fwd.elementwise == pytest.approx(
        extra * per_byte, rel=1e-9)
    assert on_cost.bwd.elementwise - off_cost.bwd.elementwise == pytest.approx(
        2 * extra * per_byte, rel=1e-9)
    assert on_cost.fwd.gemm == off_cost.fwd.gemm and on_cost.bwd.gemm == off_cost.bwd.gemm
    # fp32 training has no 16-bit stream to widen
    assert block_cost(TINY, lay, rates, 2048, 4, True, impl).fwd.elementwise == \
        block_cost(TINY, lay, rates, 2048, 4, True, off).fwd.elementwise


def test_memory_keeps_fp32_norm_inputs_and_the_casts():
    s, b, e = 2048, 8, 2
    lay = Layout(tp=1, pp=1, dp=16, micro_batch=b, zero=3, recompute="none")
    cases = ((2, replace(OTHER, residual_stream="fp32_cast", fused_qkv=True, fused_swiglu=True)),
             (5, replace(OTHER, residual_stream="fp32_cast")),
             (2, replace(OTHER, residual_stream="fp32")))  # one 16-bit output per norm
    for casts, impl in cases:
        off = replace(impl, residual_stream="16bit")
        got = layer_activation_bytes(TINY, s, b, lay, "bf16", impl=impl)
        want = layer_activation_bytes(TINY, s, b, lay, "bf16", impl=off) \
            + s * b * (2 * H * (4 - e) + (casts - 2) * H * e)
        assert got == pytest.approx(want, rel=1e-12), (casts, impl.residual_stream)
    full = replace(lay, recompute="full")
    for stream in ("fp32", "fp32_cast"):
        impl = replace(OTHER, residual_stream=stream)
        assert layer_activation_bytes(TINY, s, b, full, "bf16", impl=impl) == s * b * H * 4
        assert final_norm_bytes(TINY, s, b, lay, "bf16", impl) == s * b * H * 4
    assert layer_activation_bytes(TINY, s, b, full, "bf16", impl=OTHER) == s * b * H * e


def test_the_key_parses_and_refuses_bad_values():
    assert parse_fix("residual_stream=fp32_cast")["residual_stream"] == "fp32_cast"
    with pytest.raises(PlanError, match="residual_stream=fp64 must be one of 16bit, fp32, "
                                        "fp32_cast"):
        parse_fix("residual_stream=fp64")


def test_an_eager_block_with_an_fp32_stream_is_refused():
    with pytest.raises(PlanError, match="residual_stream=fp32 is priced for fused blocks only"):
        search(TINY, make_cluster("a100-40g", 8), 2048, 64,
               {"residual_stream": "fp32", "compile": False})
    got = search(TINY, make_cluster("a100-40g", 8), 2048, 64,
                 {"residual_stream": "fp32", "compile": True}, top=1)
    assert got and got[0].fits
