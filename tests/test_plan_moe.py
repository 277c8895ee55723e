"""The planner on mixture-of-experts models: parameter counts, expert memory under ep and ZeRO,
all-to-all bytes and time, ep in the search, and dense plans unchanged by all of it.

The hand-computed figures use mixtral-tiny (dim 64, 4 layers, 4 heads / 2 KV heads, vocab 257,
8 experts of width 64, top 2, untied head). Per block: attention matrices 2*64*64 + 2*64*32 =
12288, router 64*8 = 512, two norms 128, routed experts 3*64*64*8 = 98304. Dense parameters:
4 * (12288 + 512 + 128) + 257*64 (table) + 257*64 (head) + 64 (final norm) = 84672; experts
4 * 98304 = 393216; 477888 in all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from meshloom.models.families import config_from_preset
from meshloom.plan import PlanError
from meshloom.plan.compute import rates_for
from meshloom.plan.formulas import FP32, MIXED
from meshloom.plan.hardware import LINK_EFFICIENCY, make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout, config_toml, parse_fix
from meshloom.plan.memory import layer_activation_bytes, memory_per_gpu, rank_model_states
from meshloom.plan.models import PRESETS, from_hf_config
from meshloom.plan.moe import activation_bytes_per_token, dispatch_bytes
from meshloom.plan.search import evaluate, layouts, search
from meshloom.plan.timing import step_time

TINY = PRESETS["mixtral-tiny"]
DENSE, EXPERTS = 84672, 393216


@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
    ("mixtral-8x22b", 140_620_634_112, 39_152_031_744),
    ("mixtral-tiny", DENSE + EXPERTS, DENSE + 4 * 3 * 64 * 64 * 2),
])
def test_total_and_active_parameters(name, total, active):
    shape = PRESETS[name]
    assert (shape.params, shape.active_params) == (total, active)
    cfg = config_from_preset(name)  # the model meshloom builds counts the same
    assert (cfg.num_params(), cfg.active_params()) == (total, active)
    if name == "mixtral-8x7b":  # the published figures
        assert (round(total / 1e9, 1), round(active / 1e9, 1)) == (46.7, 12.9)
    # FLOPs scale with the active matrices: the model's own flops_per_token, halved attention
    # aside (timing.model_flops does not halve it for the causal mask)
    seq = 64
    matmul_flops = 6 * (shape.layers * shape.layer_matmul_params + shape.vocab * shape.hidden)
    assert cfg.flops_per_token(seq) == pytest.approx(
        matmul_flops + 6 * shape.layers * seq * shape.q_dim, rel=1e-12)


def _states(lay: Layout, prec=FP32) -> dict:
    return rank_model_states(TINY, lay, 0, prec)


def test_expert_states_divide_by_ep_and_by_the_expert_shards():
    # DDP over 8 ranks: every GPU holds the dense part and 1/ep of the experts, all unsharded.
    for ep in (1, 2, 4, 8):
        s = _states(Layout(dp=8, ep=ep))
        assert s["params"] == 4 * (DENSE + EXPERTS / ep)
        assert s["optimizer"] == 8 * (DENSE + EXPERTS / ep)
    # ZeRO-1, dp 8, ep 4: optimizer state of the dense part over dp_shard 8, of the experts over
    # edp_shard = 8 / 4 = 2.
    s = _states(Layout(dp=8, ep=4, zero=1))
    assert s == {"params": 4 * (DENSE + EXPERTS / 4), "grads": 4 * (DENSE + EXPERTS / 4),
                 "optimizer": 8 * DENSE / 8 + 8 * (EXPERTS / 4) / 2}
    # ZeRO-2 and 3 shard grads, then params, the same two ways.
    s = _states(Layout(dp=8, ep=4, zero=2))
    assert s["grads"] == 4 * DENSE / 8 + 4 * (EXPERTS / 4) / 2
    s = _states(Layout(dp=8, ep=4, zero=3))
    assert s["params"] == 4 * DENSE / 8 + 4 * (EXPERTS / 4) / 2
    # cp is part of the expert shards: dp 4 x cp 2 with ep 4 gives edp_shard 2, while the dense
    # part is sharded over dp_shard = 4 only.
    s = _states(Layout(dp=4, cp=2, ep=4, zero=3))
    assert s["params"] == 4 * DENSE / 4 + 4 * (EXPERTS / 4) / 2
    # ep 8 over dp 4 x cp 2: one expert per GPU, nothing left to shard it over.
    s = _states(Layout(dp=4, cp=2, ep=8, zero=3))
    assert s["params"] == 4 * DENSE / 4 + 4 * EXPERTS / 8
    # ep 1: no expert groups, the experts are ordinary parameters sharded over dp_shard.
    s = _states(Layout(dp=4, cp=2, ep=1, zero=3))
    assert s["params"] == 4 * (DENSE + EXPERTS) / 4
    # HSDP: the experts are replicated over dp_replicate, sharded within a replica group.
    s = _states(Layout(dp=8, dp_replicate=2, ep=2, zero=3))
    assert s["params"] == 4 * DENSE / 4 + 4 * (EXPERTS / 2) / 2
    # Mixed precision: 2 + 2 + 12 bytes, the experts' optimizer state over edp_shard.
    s = _states(Layout(dp=8, ep=2, zero=1), MIXED)
    assert s["optimizer"] == 12 * DENSE / 8 + 12 * (EXPERTS / 2) / 4


def test_experts_are_not_split_over_tp_and_memory_per_gpu_uses_the_split():
    # tp 2 halves attention's matrices, the embedding and the head; router, norms and experts
    # stay whole: 4 * (12288/2 + 640) + 257*64 + 64 = 43648 dense parameters.
    lay = Layout(tp=2, dp=4, ep=4, zero=3)
    assert _states(lay)["params"] == 4 * 43648 / 4 + 4 * (EXPERTS / 4) / 1
    mem = memory_per_gpu(TINY, lay, 64, 8, dtype="fp32")
    assert mem.params == _states(lay)["params"]


def test_moe_activations_per_token_by_hand():
    # bf16, per local token: router scores and top-k weights in fp32, (8 + 2) * 4 = 40 bytes;
    # each of the 2 routed copies keeps its dispatched input, its output (2 * 64) and 4 SwiGLU
    # tensors of 64, 2 bytes each, times the 1.25 allowance once experts are spread (ep > 1).
    assert activation_bytes_per_token(TINY, Layout(dp=8, ep=2), 2, "none") == \
        40 + 1.25 * 2 * (2 * 64 + 4 * 64) * 2
    assert activation_bytes_per_token(TINY, Layout(dp=8, ep=1), 2, "none") == \
        40 + 2 * (2 * 64 + 4 * 64) * 2
    assert activation_bytes_per_token(TINY, Layout(dp=8, ep=2), 2, "selective") == \
        40 + 1.25 * 2 * (2 * 64 + 2 * 64) * 2
    # A fused SwiGLU (Megatron-Core's grouped experts) keeps gate, up and the product: 3 tensors.
    assert activation_bytes_per_token(TINY, Layout(dp=8, ep=2), 2, "none", fused_swiglu=True) \
        == 40 + 1.25 * 2 * (2 * 64 + 3 * 64) * 2
    assert activation_bytes_per_token(TINY, Layout(dp=8, ep=2), 2, "selective",
                                      fused_swiglu=True) == \
        activation_bytes_per_token(TINY, Layout(dp=8, ep=2), 2, "selective")
    allowance = replace(TINY, moe_imbalance=2.0)
    assert activation_bytes_per_token(allowance, Layout(dp=8, ep=2), 2, "none") == \
        40 + 2.0 * 2 * (2 * 64 + 4 * 64) * 2
    # A whole block, s*b = 64 tokens, tp 1, flash: norm and matmul-block inputs 4 * 64 * 2,
    # q and o plus k and v (2 * 64 + 2 * 32) * 2, log-sum-exp 4 * 4, and the MoE part.
    lay = Layout(dp=8, ep=2)
    moe = 40 + 1.25 * 2 * (2 * 64 + 4 * 64) * 2
    assert layer_activation_bytes(TINY, 64, 1, lay, "bf16") == 64 * (512 + 384 + 16 + moe)
    # ... and the block passes a trainer's fused SwiGLU on to its experts: 64 routed values
    # less per copy (a trainer whose attention takes the shared K/V heads as they are).
    fused = Implementation(meshloom_block=False, fused_swiglu=True, expand_kv=False)
    assert layer_activation_bytes(TINY, 64, 1, lay, "bf16", impl=fused) == \
        64 * (512 + 384 + 16 + moe - 1.25 * 2 * 64 * 2)
    # One that copies K and V out to every query head saves the copies: 2 * (64 - 32) more.
    copied = replace(fused, expand_kv=True)
    assert layer_activation_bytes(TINY, 64, 1, lay, "bf16", impl=copied) == \
        layer_activation_bytes(TINY, 64, 1, lay, "bf16", impl=fused) + 64 * 2 * (64 - 32) * 2


H100 = make_cluster("h100", 8)
BIG = PRESETS["mixtral-8x7b"]


def _a2a_bytes_s(lay: Layout, cluster, seq: int = 4096, batch: int = 8, shape=BIG) -> float:
    """A step's all-to-all seconds less the calls' starts (one start and one hop each, over the
    slowest link of the ep group): the part its payload's bytes make."""
    c = evaluate(shape, lay, cluster, seq, batch)
    return c.timing.ep - c.moe["all_to_alls_per_step"] * cluster.send_latency(lay.ep, lay.tp)


def test_all_to_all_bytes_and_time_by_hand():
    # One dispatch (or combine) moves local tokens x top_k x hidden x bytes per GPU.
    assert dispatch_bytes(TINY, 1024, 2) == 1024 * 2 * 64 * 2
    assert dispatch_bytes(BIG, 4096, 2) == 4096 * 2 * 4096 * 2 == 67_108_864
    # Mixtral 8x7B on 8 H100s of one node, ep 8, one sequence of 4096 per GPU per step: 4
    # all-to-alls per block, each sending 7/8 of 64 MiB over NVLink (370 GB/s effective), the
    # busiest rank receiving 1.25 x the mean; 32 blocks. Each call starts in NCCL's 8.4 us
    # plus one NVLink hop of 3.4 us (its sends to the 7 peers run at once).
    bw = 450e9 * LINK_EFFICIENCY
    one = 1.25 * 7 / 8 * 67_108_864 / bw + 11.8e-6
    t = step_time(BIG, Layout(dp=8, ep=8, zero=1), H100, 4096, 8)
    assert t.ep == pytest.approx(32 * 4 * one, rel=1e-12)
    assert t.breakdown()["ep_comm"] == t.ep
    # Full recompute reruns the forward's dispatch and combine: 6 per block.
    t = step_time(BIG, Layout(dp=8, ep=8, zero=1, recompute="full"), H100, 4096, 8)
    assert t.ep == pytest.approx(32 * 6 * one, rel=1e-12)
    # Two micro-batches: twice the calls.
    t = step_time(BIG, Layout(dp=8, ep=8, zero=1), H100, 4096, 16)
    assert t.ep == pytest.approx(2 * 32 * 4 * one, rel=1e-12)
    # No expert parallel, no all-to-all.
    assert step_time(BIG, Layout(dp=8, ep=1, zero=1), H100, 4096, 8).ep == 0.0
    assert evaluate(BIG, Layout(dp=8, ep=1, zero=1), H100, 4096, 8).moe[
        "all_to_alls_per_step"] == 0
    # The candidate's record says the same.
    c = evaluate(BIG, Layout(dp=8, ep=8, zero=1), H100, 4096, 8)
    assert c.moe["all_to_all_bytes"] == 67_108_864 and c.moe["all_to_alls_per_step"] == 128
    assert c.moe["all_to_all_crosses_nodes"] is False
    a2a = c.timing.detail["comm_s"]["ep"]
    assert a2a["calls"]["all_to_all"] == {"calls": 128, "fixed_s": pytest.approx(128 * 11.8e-6)}
    assert a2a["ops"]["all_to_all"] == pytest.approx(32 * 4 * one, rel=1e-12)
    # Across two nodes (ep 16, tp 1) the slowest link a call uses is the network: 14 us a hop.
    assert make_cluster("h100", 16).send_latency(16, 1) == pytest.approx(22.4e-6, rel=1e-12)
    assert make_cluster("h100", 16).send_latency(8, 1) == pytest.approx(11.8e-6, rel=1e-12)
    assert make_cluster("h100", 16).send_latency(8, 2) == pytest.approx(22.4e-6, rel=1e-12)
    assert c.to_dict()["moe"]["ep"] == 8
    full = evaluate(BIG, Layout(dp=8, ep=8, zero=1, recompute="full"), H100, 4096, 8)
    assert full.moe["all_to_alls_per_step"] == 6 * 32


def test_sequence_parallel_runs_the_feed_forward_on_the_rank_slice():
    """Under SP each tp rank routes its 1/tp slice of the sequence (models/moe.py): the MoE
    part's all-to-all, buffers, activations and expert GEMMs are those of s/tp tokens."""
    from meshloom.plan.compute import block_cost, rates_for
    from meshloom.plan.memory import layer_activation_bytes

    cluster = make_cluster("h100", 16)
    whole = Layout(tp=2, dp=8, ep=8, zero=1)
    sliced = replace(whole, sp=True)
    a, b = evaluate(BIG, whole, cluster, 4096, 8), evaluate(BIG, sliced, cluster, 4096, 8)
    assert a.moe["all_to_all_bytes"] == 2 * b.moe["all_to_all_bytes"] == 67_108_864
    assert _a2a_bytes_s(whole, cluster) == pytest.approx(2 * _a2a_bytes_s(sliced, cluster),
                                                         rel=1e-12)
    # The same number of calls, each starting in 22.4 us: the ep 8 x tp 2 group leaves the node.
    assert step_time(BIG, whole, cluster, 4096, 8).ep - step_time(BIG, sliced, cluster, 4096,
                                                                  8).ep \
        == pytest.approx(_a2a_bytes_s(sliced, cluster), rel=1e-12)
    moe = activation_bytes_per_token(BIG, whole, 2, "none")  # Korthikanti-style, per token
    assert layer_activation_bytes(BIG, 4096, 1, whole, "bf16") \
        - layer_activation_bytes(BIG, 4096, 1, sliced, "bf16") \
        == 4096 * moe / 2 + 4096 * 4 * BIG.hidden * 2 / 2  # the MoE part, and SP's own /t
    rates = rates_for(cluster)
    cost = {lay.sp: block_cost(BIG, lay, rates, 4096, 2, True, Implementation())
            for lay in (whole, sliced)}
    # Attention's GEMMs see the whole sequence either way; the feed-forward's half of it.
    assert cost[False].fwd.gemm / 2 < cost[True].fwd.gemm < cost[False].fwd.gemm


def test_all_to_all_priced_inside_a_node_or_across_nodes():
    lay = Layout(dp=8, ep=8, zero=1)
    inside = _a2a_bytes_s(lay, make_cluster("h100", 8, 8))
    across = _a2a_bytes_s(lay, make_cluster("h100", 8, 4))  # 4 GPUs per node
    # Only the link differs: NVLink 450 GB/s against 50 GB/s of network per GPU; and each of
    # the 128 calls starts in 8.4 us plus one hop, 3.4 us over NVLink, 14.0 across nodes.
    assert across / inside == pytest.approx(450 / 50, rel=1e-12)
    assert step_time(BIG, lay, make_cluster("h100", 8, 4), 4096, 8).ep - across \
        == pytest.approx(128 * 22.4e-6, rel=1e-9)
    assert step_time(BIG, lay, make_cluster("h100", 8, 8), 4096, 8).ep - inside \
        == pytest.approx(128 * 11.8e-6, rel=1e-9)
    # ep groups are ep ranks at stride tp: ep 8 x tp 2 = 16 ranks leave an 8-GPU node, ep 4 x
    # tp 2 does not.
    c16 = make_cluster("h100", 16, 8)
    wide_lay, narrow_lay = Layout(tp=2, dp=8, ep=8, zero=1), Layout(tp=2, dp=8, ep=4, zero=1)
    wide = evaluate(BIG, wide_lay, c16, 4096, 8)
    narrow = evaluate(BIG, narrow_lay, c16, 4096, 8)
    assert wide.moe["all_to_all_crosses_nodes"] and not narrow.moe["all_to_all_crosses_nodes"]
    # Per call ep 8 sends 7/8 of the payload and ep 4 3/4; the link is 9x slower.
    assert _a2a_bytes_s(wide_lay, c16) / _a2a_bytes_s(narrow_lay, c16) \
        == pytest.approx((7 / 8) / (3 / 4) * 9, rel=1e-12)


def test_imbalance_scales_expert_compute_only_when_experts_are_spread():
    even = replace(BIG, moe_imbalance=1.0)
    lay = Layout(dp=8, ep=8, zero=1)
    a, b = step_time(even, lay, H100, 4096, 8), step_time(BIG, lay, H100, 4096, 8)
    # The busiest GPU receives 1.25 x the bytes; the calls' starts are the same.
    assert _a2a_bytes_s(lay, H100) == pytest.approx(
        1.25 * _a2a_bytes_s(lay, H100, shape=even), rel=1e-12)
    assert b.ep - _a2a_bytes_s(lay, H100) == pytest.approx(
        a.ep - _a2a_bytes_s(lay, H100, shape=even), rel=1e-12)
    assert b.compute > a.compute
    # Priced at the datasheet peak and bandwidth (no table, so every FLOP and byte costs the
    # same) with fused elementwise kernels, the extra is exactly the busiest GPU's extra 0.25 x
    # top_k expert passes, forward and twice backward, 32 blocks: 3 GEMMs of h x F_e per routed
    # copy, SwiGLU (3 x 14336) and the permutations (2 x 2 x 4096) per extra copy.
    flat = make_cluster("h100", 8, kernels="datasheet")
    fused = Implementation(compile=True)
    a, b = (step_time(s, lay, flat, 4096, 8, impl=fused) for s in (even, BIG))
    extra = 0.25 * 2 * 4096  # routed copies beyond the mean, over the GPU's 4096 tokens
    per_layer = extra * 2 * 3 * 4096 * 14336 / 989e12 \
        + extra * (3 * 14336 + 4 * 4096) * 2 / 3350e9
    assert b.compute - a.compute == pytest.approx(3 * 32 * per_layer, rel=1e-9)
    assert b.model_flops == a.model_flops  # the allowance is waiting, not model FLOPs
    lay1 = Layout(dp=8, ep=1, zero=1)
    assert step_time(even, lay1, H100, 4096, 8).compute == \
        step_time(BIG, lay1, H100, 4096, 8).compute


def test_expert_gradients_reduce_over_their_own_groups():
    # ZeRO-1 exposes its reduce-scatter and all-gather: the dense part's over dp_shard 8 (7/8
    # of 84672 x 4 bytes of fp32 gradients, meshloom's default reduce dtype, and x 2 bytes of
    # bf16 parameters), the experts' (98304 per GPU at ep 4) over edp_shard 2 (1/2 of 98304,
    # x 4 and x 2 bytes), all inside the node; each of the four is one call (one bucket),
    # paying NCCL's ring start and one NVLink step per rank after the first (the Simple ring:
    # NCCL's own choice for these few kilobytes is LL, tests/test_plan_nccl.py).
    # Before it, meshloom's ZeRO-1 casts the reduced bf16 gradients to fp32 (2 + 4 bytes, one
    # kernel a bucket: here each side's one, at the copy rate or the launch floor).
    bw = 450e9 * LINK_EFFICIENCY
    call = {n: 1e-6 * (8.4 + (n - 1) * 3.4) for n in (2, 8)}
    simple = Implementation(nccl_protocols="simple")
    rates = rates_for(H100)
    t = step_time(TINY, Layout(dp=8, ep=4, zero=1), H100, 64, 8, impl=simple)
    assert t.dp == pytest.approx((4 + 2) * (7 / 8 * DENSE + 1 / 2 * EXPERTS / 4) / bw
                                 + 2 * (call[8] + call[2])
                                 + rates.stream(6 * (DENSE + EXPERTS / 4), 1), rel=1e-12)
    # ep = dp_shard: every GPU holds its own experts, nothing to reduce for them.
    t = step_time(TINY, Layout(dp=8, ep=8, zero=1), H100, 64, 8, impl=simple)
    assert t.dp == pytest.approx((4 + 2) * 7 / 8 * DENSE / bw + 2 * call[8]
                                 + rates.stream(6 * DENSE, 1), rel=1e-12)


def test_search_enumerates_ep_for_moe_and_never_for_dense():
    cluster = make_cluster("h100", 8)
    fixed = {"tp": 1, "pp": 1, "recompute": "none", "micro_batch": 1}
    eps = {(lay.dp_shard * lay.cp, lay.ep) for lay in layouts(TINY, cluster, 64, 8, fixed)}
    assert {ep for _, ep in eps} == {1, 2, 4, 8}
    assert all(n % ep == 0 and 8 % ep == 0 for n, ep in eps)
    for name in ("llama3-8b", "gpt2"):
        dense = PRESETS[name]
        assert {lay.ep for lay in layouts(dense, cluster, 256, 8, {})} == {1}
        with pytest.raises(PlanError, match=r"ep=2 needs a mixture-of-experts model"):
            search(dense, cluster, 256, 8, parse_fix("ep=2"))
    with pytest.raises(PlanError, match=r"ep=3 does not divide dp_shard x cp"):
        evaluate(TINY, Layout(dp=8, ep=3), cluster, 64, 8)
    six = replace(TINY, n_experts=6)
    with pytest.raises(PlanError, match=r"ep=4 does not divide the 6 experts"):
        evaluate(six, Layout(dp=8, ep=4), cluster, 64, 8)


def test_cli_prints_active_parameters_and_ep():
    cmd = [sys.executable, "-m", "meshloom", "plan", "--model", "mixtral-8x7b", "--gpus", "8",
           "--seq", "4096", "--global-batch", "8", "--top", "3",
           "--fix", "ep=8,tp=1,pp=1,cp=1,recompute=none"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "46.7B parameters, 12.9B active per token (8 experts, top 2" in out.stdout
    assert " ep8 " in out.stdout and "all-to-all 128 x 67.1 MB" in out.stdout
    assert "inside a node" in out.stdout
    bad = subprocess.run(cmd[:6] + ["--moe-imbalance", "0.5"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "moe_imbalance=0.5 must be a number >= 1" in bad.stderr


def test_written_config_names_the_preset_and_ep():
    text = config_toml(Layout(dp=8, ep=8, zero=1), BIG, 4096, 8, "bf16")
    assert 'preset = "mixtral-8x7b"' in text and "ep = 8" in text
    custom = config_toml(Layout(dp=8, ep=2), replace(TINY, name="custom"), 64, 8, "bf16")
    assert "n_experts = 8" in custom and "moe_hidden = 64" in custom and "ep = 2" in custom


# Dense plans pinned to the last bit, so that a change to the MoE terms (or anything else) that
# moves a dense model's plan is seen. Regenerated when the planner moved from the fitted matmul
# efficiency to kernel tables (issue 19), and again when memory counted meshloom's own block
# (its autograd graph's saved tensors) and dropped the 10% allocator allowance, and when kept
# gradients were charged their accumulation pass per micro-batch, and when the census grew to
# ZeRO's bf16 working parameters and to GPT-2 (whose presets lost dropout, as meshloom trains
# them), and when meshloom's ZeRO-1 accumulated into bf16 gradients, and when recompute's
# reruns of tp collectives and of the cp ring were charged as measured (plan/reruns.py), and
# when pipeline stages were priced with the blocks meshloom's split gives them (plan/stages.py:
# Llama 3 8B's heavy head leaves the last of 2 stages 15 blocks, the first 17), and when
# meshloom's loop clipped inside the fused optimizer and freed the gradients no data-parallel
# bucket holds (implementation.keeps_grads), and when autocast's weight casts of its unsharded
# fp32 layouts were priced (compute.casts_weights), and when the H100 table took the measured
# attention rows where nothing was published (causal 4096 tokens: backward 248 TF/s, not the
# 8192-token 287), and when the default attention became SDPA's pick (cuDNN's on an H100),
# and when every collective call paid NCCL's fixed cost (hardware.Cluster.collective), per
# layer for TP, per unit for ZeRO-3 and per 25 MiB bucket for DDP and ZeRO-1/2, and when
# point-to-point sends (pipeline, context ring) did too (hardware.Cluster.send_latency), and
# when the token table's lookup and the two ends' tp collectives were priced
# (compute.embedding_cost, timing.end_collectives), and when a tied table split over the
# pipeline's ends was summed by an all-reduce each step (timing.tied_table_sync: GPT-2 XL's
# over the Titans' PCIe), and when context parallel's ring was priced as meshloom's runs it
# (plan/cp_ring.py: FlashAttention-2 per ring step, fp32 merges; the cp = 2 layout, whose
# selective recompute reruns the ring, 2.565 -> 2.841 s), and when each collective call ran
# with the algorithm and protocol NCCL's tuner picks (plan/nccl.py: DDP's 25 MiB buckets over
# two nodes take LL128, 2.038 -> 2.031 s; HSDP's replica all-reduce pays the multi-node ring's
# plateau, 1.916 -> 1.917 s); memory and DP did not move then; and when gradients crossed the
# data-parallel group in meshloom's default fp32 (`grad_reduce_dtype`, parallel.reduce_dtype),
# not 16 bits (DP 0.022 -> 0.037, 0.057 -> 0.075, 0.028 -> 0.056, 0.132 -> 0.207 s; memory did
# not move), and when ZeRO-3 packed each unit's gradients into its fp32 send buffer on the
# compute stream before the reduce-scatter (parallel/fsdp.py `_reduce`, 6 bytes a parameter a
# micro-batch: DP 0.075 -> 0.108 s, step 1.849 -> 1.882 s), and meshloom's ZeRO-2 likewise
# per bucket every micro-batch (HSDP's DP 0.207 -> 0.240 s) and its ZeRO-1 cast its whole bf16
# gradients to fp32 once a step (DP 0.037 -> 0.041 s), and when meshloom's SP collectives paid
# the copy of the whole tensor they gather or scatter (compute.sp_copies: the tp = 2 layout
# 2.860 -> 2.931 s; the embedding's and the head's pairs too, end_sp_copies, 2.9310 -> 2.9318 s),
# and when meshloom's SP collectives stopped copying at one sequence a micro-batch, which this
# layout is (comm._leading, sp_copies=batch: 2.9318 -> 2.8601 s, the value before the copies);
# and when ZeRO-3 gathered what lies outside the blocks once a micro-batch, first and exposed,
# and kept its root (the head) gathered to the backward (`fsdp_root`: DP 0.108 -> 0.115 s, step
# 1.882 -> 1.889 s, memory 1.05 GB more); and when meshloom's ZeRO-3 started its root's gather
# as the last block's prefetch, leaving the embedding's alone exposed first (DP 0.115 ->
# 0.110 s, step 1.889 -> 1.884 s); and when meshloom's ZeRO-3 held the next micro-batch's
# opening units from the backward before (`fsdp_carry`: DP 0.110 -> 0.106 s, step 1.884 ->
# 1.880 s; memory did not move); and when meshloom's loss under tp > 1 was priced as its own
# vocabulary-parallel one (compute `vocab_parallel`: 38 + 6 bytes a logit where eager's are
# 18 + 22, in 6 + 1 kernels: the tp = 2 layout 2.8601 -> 2.8605 s; memory did not move);
# the structural checks below are what keeps MoE terms out of dense plans.
DENSE_EVALUATIONS = [
    (Layout(tp=2, pp=2, dp=2, cp=2, micro_batch=1, zero=1, recompute="selective", sp=True),
     2.860473634402427, 26103253504.0, 0.04116867629301025),
    (Layout(dp=16, micro_batch=2, zero=3), 1.8802720853677661, 84498430464.0,
     0.10632875570099534),
    (Layout(dp=16, micro_batch=2, zero=0), 2.0592143028696883, 224097192448.0,
     0.056017824954641596),
    (Layout(dp=16, dp_replicate=2, micro_batch=2, zero=2), 2.025116955589568, 104274724352.0,
     0.2400974035117629),
]


@pytest.mark.parametrize("lay, step, mem, dp", DENSE_EVALUATIONS)
def test_dense_evaluations_unchanged(lay, step, mem, dp):
    c = evaluate(PRESETS["llama3-8b"], lay, make_cluster("h100", 16), 4096, 64)
    assert (c.timing.step_time_s, c.memory.total, c.timing.dp) == \
        pytest.approx((step, mem, dp), rel=1e-12)
    assert c.timing.ep == 0.0 and c.moe is None and "moe" not in c.to_dict()
    assert "ep" not in c.timing.detail["comm_s"]
    assert "n_experts" not in PRESETS["llama3-8b"].to_dict()


@pytest.mark.parametrize("name, gpu, n, seq, batch, best", [
    # The interleaved zero-bubble schedule, once searched, leads both pipelines (interleaved
    # 1F1B led with v8 at 0.21915 s and, for the 8B, 8.1193 s at 74.7 GB).
    ("gpt2-xl", "titan-rtx-24g", 2, 1024, 2,
     [("tp1 pp2 dp1 cp1 mb1 zero0 none interleaved_zb/v4", 0.21219580616830114,
       19434406400.0),
      ("tp1 pp2 dp1 cp1 mb1 zero0 none interleaved_zb/v6", 0.21247958296494987,
       19434406400.0)]),
    ("llama3-8b", "h100", 64, 8192, 512,
     # With every collective paying NCCL's fixed cost, ZeRO-2's reduce-scatter of every bucket
     # after every micro-batch cost the pipeline its lead over ZeRO-3 (it was 7.698 s); with
     # NCCL's protocol choice those 25 MiB reduce-scatters over 4 nodes run LL128 (184 us a
     # call, not the Simple ring's 223), and ZeRO-2's pipeline came second again (7.839 s).
     # With the gradients in meshloom's default fp32 its per-micro-batch reduce-scatters carry
     # twice the bytes and calls, and ZeRO-3's pipeline is second. With ZeRO-3's gradient
     # copy-in priced (6 bytes a parameter a micro-batch on the compute stream) the leader
     # slows from 7.837 s, and with ZeRO-2's pack of every bucket priced too ZeRO-3's pipeline
     # stays second (7.949 -> 8.089 s). ZeRO-3's exposed gather of what lies outside the
     # blocks and its root kept gathered (`fsdp_root`) slow both and add the head's 1.05 GB;
     # the root's gather as the last block's prefetch gives the leader back 20 ms of it, and
     # holding the next micro-batch's opening units (`fsdp_carry`) 33 ms more (the pipeline,
     # whose stages regather them, is unchanged). Since interleaved_zb warms up by one forward
     # less per later rank (every rank at p micro-batches of its layers, as torch's lists), its
     # v4 pipeline here takes 8.137 s, not 8.064: at pp 2 the forward it dropped absorbed the
     # gathers' and transfers' latency, and its memory is set by the last rank's head, so
     # nothing is gained; interleaved 1F1B is second again.
     [("tp1 pp1 dp64 cp1 mb1 zero3 none", 7.948736732353624, 78475734528.0),
      ("tp1 pp2 dp32 cp1 mb1 zero3 none interleaved_1f1b/v8", 8.119349718577647,
       74740572672.0)]),
])
def test_dense_searches_unchanged(name, gpu, n, seq, batch, best):
    found = search(PRESETS[name], make_cluster(gpu, n), seq, batch, {}, top=2)
    got = [(c.layout.short(), c.timing.step_time_s, c.memory.total) for c in found]
    assert [g[0] for g in got] == [b[0] for b in best]
    assert [g[1:] for g in got] == [pytest.approx(b[1:], rel=1e-12) for b in best]


def test_hf_mixtral_config(tmp_path):
    # mistralai/Mixtral-8x7B-v0.1's config.json (the keys the count reads).
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "sliding_window": None, "tie_word_embeddings": False}))
    shape = from_hf_config(tmp_path)
    assert (shape.params, shape.active_params) == (BIG.params, BIG.active_params)
    assert (shape.n_experts, shape.top_k, shape.moe_hidden) == (8, 2, 14336)
    # Four experts, one per token: 4 fewer experts and router rows per block, 3 idle per token.
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        cfg | {"num_local_experts": 4, "num_experts_per_tok": 1}))
    four = from_hf_config(tmp_path)
    expert = 3 * 4096 * 14336
    assert four.params == BIG.params - 32 * (4 * expert + 4 * 4096)
    assert four.active_params == four.params - 32 * 3 * expert


def test_hf_mixtral_config_counts_as_transformers_builds_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2, vocab_size=300)
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert from_hf_config(tmp_path).params == model.num_parameters()


def test_expert_tp_splits_each_expert_over_tp_as_megatron_core_does():
    """`expert_tp` (Megatron-Core's expert tensor parallel): at tp 2 each GPU holds half of each
    of its experts and runs the tp group's gathered tokens through its half, the same FLOPs;
    each dispatch is followed by an all-gather over tp and each combine preceded by a
    reduce-scatter (and the reverse in backward); each expert keeps the gathered input, twice
    the rows. Worked by hand for Mixtral 8x7B, tp 2 x ep 8 on 16 H100s, one micro-batch."""
    from meshloom.plan.compute import block_cost, rates_for
    from meshloom.plan.step_kernels import block_gemms

    cluster = make_cluster("h100", 16)
    lay = Layout(tp=2, dp=8, ep=8, zero=1, sp=True)
    off, on = Implementation(meshloom_block=False), Implementation(meshloom_block=False,
                                                                    expert_tp=True)
    a, b = (evaluate(BIG, lay, cluster, 4096, 8, impl=i) for i in (off, on))
    assert b.moe["expert_params_per_gpu"] == a.moe["expert_params_per_gpu"] / 2
    assert a.timing.model_flops == b.timing.model_flops
    # The experts' GEMMs: twice the rows, half the width, the same FLOPs; priced at the
    # datasheet peak (every FLOP the same), the block's GEMMs take the same time.
    rows = 2048 * 2 * 1.25 * 8 / 8  # one local expert's routed rows (top 2, load 1.25)
    gemms = {etp: [g for g in block_gemms(BIG, 4096, 2, etp * rows, 1, 2048, etp)
                   if g.name.startswith("experts.")] for etp in (1, 2)}
    for g0, g1 in zip(gemms[1], gemms[2], strict=True):
        assert g1.flops == pytest.approx(g0.flops, rel=1e-12)
        assert g1.m == 2 * g0.m and g1.n * g1.k * 2 == g0.n * g0.k
    flat = rates_for(make_cluster("h100", 16, kernels="datasheet"))
    assert block_cost(BIG, lay, flat, 4096, 2, True, on).fwd.gemm == pytest.approx(
        block_cost(BIG, lay, flat, 4096, 2, True, off).fwd.gemm, rel=1e-12)
    # Communication: beside each of the 128 all-to-alls, a gather (or scatter) over the 2 tp
    # ranks of the tp group's received tokens: 2 x 1.25 x one rank's dispatch payload.
    payload = 1.25 * 2 * dispatch_bytes(BIG, 4096 // 2, 2)
    one = cluster.collective("all_gather", payload, 2, 1)
    assert b.timing.ep - a.timing.ep == pytest.approx(128 * one.seconds, rel=1e-12)
    ops = b.timing.detail["comm_s"]["ep"]["calls"]
    assert ops["expert_tp_gather_scatter"]["calls"] == ops["all_to_all"]["calls"] == 128
    assert ops["expert_tp_gather_scatter"]["nccl"] == one.name  # the all-to-all has none
    assert "nccl" not in ops["all_to_all"]
    assert "expert_tp_gather_scatter" not in a.timing.detail["comm_s"]["ep"]["calls"]
    # Activations: each routed copy keeps the gathered input, one more hidden-wide row.
    extra = 2048 * 1.25 * 2 * 4096 * 2
    assert layer_activation_bytes(BIG, 4096, 1, lay, "bf16", impl=on) \
        - layer_activation_bytes(BIG, 4096, 1, lay, "bf16", impl=off) == pytest.approx(extra)
    # Megatron-Core asks for sequence parallel when it splits experts over tp; tp 1 is a no-op.
    with pytest.raises(PlanError, match="expert_tp splits the experts over tp, which "
                                        "Megatron-Core runs only with sequence parallel"):
        evaluate(BIG, replace(lay, sp=False), cluster, 4096, 8, impl=on)
    one_tp = Layout(dp=16, ep=8, zero=1)
    assert evaluate(BIG, one_tp, cluster, 4096, 16, impl=on).timing.step_time_s == \
        evaluate(BIG, one_tp, cluster, 4096, 16, impl=off).timing.step_time_s
