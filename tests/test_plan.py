"""The planner's pieces: activation formulas, micro-batches in flight, the simulator shortcut,
the search and the `meshloom plan` command (output, --json, --fix, --write-config, errors)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from meshloom.config import load_config
from meshloom.parallel.pipeline_schedule import build_schedule, simulate
from meshloom.plan import PlanError
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation, dp_calls
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import in_flight, layer_activation_bytes, outer_params
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate, layouts, search
from meshloom.plan.timing import _makespan, model_flops
from meshloom.validation import validate


@pytest.mark.parametrize("t,sp,rec,coef", [
    (1, False, "none", lambda s, h, a, t: 34 + 5 * a * s / h),
    (4, False, "none", lambda s, h, a, t: 10 + 24 / t + 5 * a * s / (h * t)),
    (4, True, "none", lambda s, h, a, t: 34 / t + 5 * a * s / (h * t)),
    (4, False, "selective", lambda s, h, a, t: 10 + 24 / t),
    (4, True, "selective", lambda s, h, a, t: 34 / t),
    (4, False, "full", lambda s, h, a, t: 2),
])
def test_korthikanti_activation_formulas(t, sp, rec, coef):
    """Table 2 of Korthikanti et al.: bytes per layer for the GPT block, 16-bit, eager attention."""
    shape = PRESETS["megatron-7.5b"]
    s, b, h, a = 2048, 2, shape.hidden, shape.heads
    got = layer_activation_bytes(shape, s, b, Layout(tp=t, sp=sp, recompute=rec), "bf16",
                                 flash=False)
    assert got == pytest.approx(s * b * h * coef(s, h, a, t))


def test_flash_attention_drops_the_score_terms():
    shape = PRESETS["llama3-8b"]
    eager = layer_activation_bytes(shape, 4096, 1, Layout(), "bf16", flash=False)
    flash = layer_activation_bytes(shape, 4096, 1, Layout(), "bf16", flash=True)
    assert eager - flash == pytest.approx(4096 * shape.heads * 4096 * 2 - 4096 * shape.heads * 4)


def test_fused_swiglu_keeps_one_feed_forward_tensor_less():
    """Megatron-Core's fused SwiGLU saves only gate and up (the second GEMM keeps the product):
    per token of a tp rank, F/t values fewer than eager's gate, up, silu(gate) and product.
    Nothing changes for a GeLU block, under recompute, or for meshloom's own block."""
    llama, gpt = PRESETS["llama3-8b"], PRESETS["megatron-7.5b"]
    s, b, t = 4096, 1, 4
    fused = Implementation(meshloom_block=False, fused_swiglu=True)
    eager = Implementation(meshloom_block=False)

    def count(shape, impl, rec="none", sp=True):
        return layer_activation_bytes(shape, s, b, Layout(tp=t, sp=sp, recompute=rec), "bf16",
                                      impl=impl)

    assert count(llama, eager) - count(llama, fused) == s * b * llama.ffn_hidden * 2 / t
    assert count(llama, eager, sp=False) - count(llama, fused, sp=False) == (
        s * b * llama.ffn_hidden * 2 / t)
    assert count(gpt, eager) == count(gpt, fused)
    for rec in ("selective", "full"):
        assert count(llama, eager, rec) == count(llama, fused, rec)
    ours = Implementation()
    assert count(llama, ours) == count(llama, replace(ours, fused_swiglu=True))
    assert parse_fix("fused_swiglu=true")["fused_swiglu"] is True


def test_optimizer_state_bytes_per_parameter():
    """fp32 master + moments 12 bytes per parameter, apex's remainders 10, bf16 moments 4, all
    sharded over dp_shard under ZeRO; parameters and gradients unchanged; fp32 training and
    meshloom's unsharded block (fp32 masters are the parameters) unaffected."""
    from meshloom.plan.memory import memory_per_gpu, rank_params
    shape = PRESETS["llama3-8b"]
    lay = Layout(tp=2, dp=4, zero=1, micro_batch=1)
    psi = rank_params(shape, lay, 0)
    base = Implementation(meshloom_block=False)
    got = {k: memory_per_gpu(shape, lay, 4096, 4, impl=replace(base, optimizer_state=k))
           for k in ("fp32", "fp32_remainders", "bf16")}
    for state, per in (("fp32", 12), ("fp32_remainders", 10), ("bf16", 4)):
        assert got[state].optimizer == pytest.approx(per * psi / 4)
        assert (got[state].params, got[state].grads) == (got["fp32"].params, got["fp32"].grads)
    for k in ("fp32_remainders", "bf16"):
        impl = replace(base, optimizer_state=k)
        assert memory_per_gpu(shape, lay, 4096, 4, "fp32", impl=impl).optimizer == \
            memory_per_gpu(shape, lay, 4096, 4, "fp32", impl=base).optimizer
        ddp, ours = Layout(tp=2, dp=4, micro_batch=1), replace(Implementation(), optimizer_state=k)
        assert memory_per_gpu(shape, ddp, 4096, 4, impl=ours).optimizer == \
            memory_per_gpu(shape, ddp, 4096, 4, impl=Implementation()).optimizer
    assert parse_fix("optimizer_state=fp32_remainders")["optimizer_state"] == "fp32_remainders"
    with pytest.raises(PlanError, match="optimizer_state=fp16 must be one of fp32, "
                                        "fp32_remainders, bf16"):
        parse_fix("optimizer_state=fp16")


def test_in_flight_per_schedule():
    p, m = 4, 16
    assert in_flight("1f1b", p, m, 1) == (p, 1)  # first stage p, last stage 1 (Narayanan)
    assert in_flight("gpipe", p, m, 1) == (m, m)
    assert in_flight("zb_h1", p, m, 1) == (p, p)
    v = 2  # interleaved: first stage p (1 + (p - 1) / (p v)) in units of its whole share
    assert in_flight("interleaved_1f1b", p, m, v)[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))
    # Interleaved zero bubble: every rank p micro-batches of its layers, 1F1B's first rank.
    assert in_flight("interleaved_zb", p, m, v) == (p, p)


@pytest.mark.parametrize("schedule,p,v", [("1f1b", 4, 1), ("interleaved_1f1b", 4, 2),
                                          ("zb_h1", 6, 1), ("gpipe", 4, 1), ("1f1b", 8, 1),
                                          ("interleaved_zb", 4, 2), ("interleaved_zb", 3, 3)])
def test_steady_state_extrapolation_matches_the_simulator(schedule, p, v):
    """The search simulates 2p and 3p micro-batches and extrapolates; uneven stage costs (a
    heavier last stage) and a p2p latency included, it stays within 2% of simulating all."""
    n = p * v
    costs = []
    for st in range(n):
        f = 1.0 + 0.1 * (st % 3) + (0.5 if st == n - 1 else 0.0)
        costs += [f, 2 * f, f, f]  # F, B, I, W
    key, m = tuple(costs), 10 * p
    table = {(k, st): costs[4 * st + i] for st in range(n) for i, k in enumerate("FBIW")}
    direct = simulate(build_schedule(schedule, p, m, v), lambda a: table[(a.kind, a.stage)],
                      0.2).makespan
    assert _makespan(schedule, p, m, v, key, 0.2) == pytest.approx(direct, rel=0.02)


def test_model_flops_is_megatrons_formula():
    shape, B, s = PRESETS["megatron-18.4b"], 1024, 2048
    h, L, V = shape.hidden, shape.layers, shape.vocab
    megatron = 72 * B * L * s * h ** 2 * (1 + s / (6 * h) + V / (12 * h * L))
    # Ours counts every matrix exactly (biases excluded): the same to 0.1%.
    assert model_flops(shape, s, B) == pytest.approx(megatron, rel=1e-3)


def test_ring_time_uses_the_bus_bandwidth_convention():
    """The Simple ring's bytes: an all-reduce moves 2(n-1)/n of the tensor through each
    GPU's link, an all-gather or reduce-scatter (n-1)/n, at the bus bandwidth."""
    cl = make_cluster("h100", 64)
    bw = cl.bus_bandwidth(8, 1)
    assert bw > cl.bus_bandwidth(8, 8)  # NVLink inside, network across

    def bytes_s(op, nbytes, n):
        c = cl.collective(op, nbytes, n, 1, "simple")
        return c.seconds - c.start
    assert bytes_s("all_reduce", 8e9, 8) == pytest.approx(2 * 7 / 8 * 8e9 / bw)
    assert bytes_s("all_gather", 8e9, 8) == pytest.approx(7 / 8 * 8e9 / bw)
    assert bytes_s("reduce_scatter", 8e9, 8) == pytest.approx(7 / 8 * 8e9 / bw)
    assert cl.collective("all_reduce", 8e9, 1, 1).seconds == 0.0  # one rank: no call
    assert cl.collective("all_gather", 0.0, 8, 1).seconds == 0.0  # no bytes, no call


def test_ring_latency_is_nccls_ring_model():
    """NCCL's cost model for a ring with the Simple protocol (tuning.cc): 8.4 us to start, then
    3.4 us per NVLink step, 5.7 per PCIe step and 14.0 per network step; n - 1 steps for a
    gather or reduce-scatter, of which nodes - 1 cross the network, 2(n - 1) for an all-reduce,
    of which 2 x nodes do."""
    cl = make_cluster("h100", 1024)

    def start_us(cluster, op, n, stride):  # a small call: no plateau (tests/test_plan_nccl.py)
        return 1e6 * cluster.collective(op, 1e3, n, stride, "simple").start
    us = {(k, n, stride): start_us(cl, k, n, stride) for k, n, stride in (
        ("all_gather", 8, 1), ("all_reduce", 8, 1), ("all_gather", 16, 1),
        ("reduce_scatter", 16, 8), ("all_reduce", 16, 1), ("all_gather", 1, 1))}
    assert us[("all_gather", 8, 1)] == pytest.approx(8.4 + 7 * 3.4)
    assert us[("all_reduce", 8, 1)] == pytest.approx(8.4 + 14 * 3.4)
    assert us[("all_gather", 16, 1)] == pytest.approx(8.4 + 14 * 3.4 + 1 * 14.0)  # 2 nodes
    assert us[("reduce_scatter", 16, 8)] == pytest.approx(8.4 + 15 * 14.0)  # one rank a node
    assert us[("all_reduce", 16, 1)] == pytest.approx(8.4 + 26 * 3.4 + 4 * 14.0)
    assert start_us(cl, "all_reduce", 16, 8) == pytest.approx(8.4 + 30 * 14.0)
    assert us[("all_gather", 1, 1)] == 0.0
    assert [cl.nodes_spanned(n, s) for n, s in ((8, 1), (16, 1), (16, 8), (3, 4))] == [1, 2, 16, 2]
    pci = make_cluster("titan-rtx-24g", 2)
    assert start_us(pci, "all_gather", 2, 1) == pytest.approx(8.4 + 5.7)


def test_zero3_pays_a_call_per_unit_and_pass():
    """ZeRO-3 gathers each block's parameters twice per micro-batch, what lies outside the
    blocks once (`fsdp_root`), and reduce-scatters every gradient once, each unit a collective
    of its own: over many ranks a small model's step is dominated by the calls' fixed cost,
    which bytes alone would not show."""
    shape = PRESETS["gpt2"]
    cl = make_cluster("h100", 512)
    lay = Layout(dp=512, zero=3, micro_batch=1)
    simple = Implementation(nccl_protocols="simple")  # the Simple ring's start, by hand
    dp = evaluate(shape, lay, cl, 1024, 512, impl=simple).timing.detail["comm_s"]["dp"]
    got = dp["ops"]
    units = shape.layers
    calls = {op: dp["calls"][op]["fixed_s"] / dp["calls"][op]["calls"]
             for op in ("all_gather", "reduce_scatter")}
    assert calls["all_gather"] == pytest.approx(1e-6 * (8.4 + 448 * 3.4 + 63 * 14.0))
    assert dp["calls"]["all_gather"]["calls"] == 2 * units + 1
    bytes_only = {op: got[op] - dp["calls"][op]["fixed_s"]
                  for op in ("all_gather", "reduce_scatter")}
    # bf16 parameters, the blocks' twice and the rest once, against one reduce-scatter of
    # every fp32 gradient (meshloom's default reduce dtype).
    blocks, outer = units * shape.layer_params, outer_params(shape, lay, 0)
    assert bytes_only["all_gather"] / bytes_only["reduce_scatter"] == pytest.approx(
        2 * (2 * blocks + outer) / (4 * (blocks + outer)), rel=1e-9)
    assert got["all_gather"] > 10 * bytes_only["all_gather"]


def test_explain_counts_the_calls_and_their_start():
    """--explain says, per collective, how many calls a step makes and how long their starts
    take: ZeRO-2 reduce-scatters every 25 MiB bucket after every micro-batch, ZeRO-1 once;
    TP makes SP's all-gather and reduce-scatter pair per all-reduce's worth, recompute's too."""
    from meshloom.plan.explain import explain

    shape, cl = PRESETS["llama3-70b"], make_cluster("h100", 64)
    lay = Layout(tp=4, pp=4, dp=4, micro_batch=1, zero=2, recompute="selective",
                 schedule="interleaved_1f1b", v=20, sp=True)
    simple = Implementation(nccl_protocols="simple")  # every call the Simple ring's start
    c = evaluate(shape, lay, cl, 8192, 256, impl=simple)
    dp = c.timing.detail["comm_s"]["dp"]["calls"]
    m, layers = 64, 20
    buckets = math.ceil(c.memory.params / (25 * 2**20))  # bf16 parameters
    grads = math.ceil(2 * c.memory.params / (25 * 2**20))  # fp32 gradients (reduce dtype)
    assert dp["reduce_scatter"]["calls"] == m * grads and dp["all_gather"]["calls"] == buckets
    start = cl.collective("reduce_scatter", 1e3, 4, 4, "simple").start  # 4 ranks, 2 a node
    assert dp["reduce_scatter"]["fixed_s"] == pytest.approx(m * grads * start)
    tp = c.timing.detail["comm_s"]["tp"]["calls"]["collectives"]
    assert tp["calls"] == m * layers * 2 * (4 + 1.5)  # 1.5 rerun all-reduces' worth
    assert tp["fixed_s"] == pytest.approx(m * layers * (4 + 1.5) * 2
                                          * cl.collective("all_gather", 1e3, 4, 1, "simple").start)
    # The busiest pipeline rank, the last (it holds the head), runs stages 3, 7, ..., 79: each
    # sends its activation forward but stage 79, and its input's gradient back: 39 sends per
    # micro-batch, each starting in 8.4 + 14.0 us (the next stage is 16 ranks on, another node).
    pp = c.timing.detail["comm_s"]["pp"]["calls"]["sends"]
    assert pp["calls"] == m * 39
    assert pp["fixed_s"] == pytest.approx(m * 39 * 22.4e-6, rel=1e-12)
    text = explain(c)
    assert f"{m * grads:,} calls starting in" in text
    assert f"{m * 39:,} calls starting in" in text
    one = evaluate(shape, replace(lay, zero=1), cl, 8192, 256, impl=simple)
    assert one.timing.detail["comm_s"]["dp"]["calls"]["reduce_scatter"]["calls"] == grads


def test_dp_buckets_count_calls_as_each_trainer_buckets():
    """DDP's and ZeRO-1/2's collectives are cut into calls as the trainer buckets them: 25 MiB
    (meshloom, PyTorch DDP), max(40M, 1M x dp) parameters (Megatron-Core, only when it
    overlaps), 5e8 elements (DeepSpeed), or one call for the whole buffer (Megatron-LM 2021)."""
    mib = 2**20
    assert dp_calls("torch", True, 100 * mib, 50e6, 8) == 4
    assert dp_calls("torch", True, 100 * mib + 1, 50e6, 8) == 5
    assert dp_calls("mcore", True, 200e6, 100e6, 16) == 3  # 40M a bucket
    assert dp_calls("mcore", True, 200e6, 100e6, 64) == 2  # 64M a bucket
    assert dp_calls("mcore", False, 200e6, 100e6, 64) == 1
    assert dp_calls("deepspeed", True, 2.4e9, 1.2e9, 8) == 3
    assert dp_calls("whole", True, 2.4e9, 1.2e9, 8) == 1
    assert dp_calls("torch", True, 0.0, 0.0, 8) == 0
    # A DDP all-reduce after the backward (Megatron-LM 2021): its bytes and one start, or one
    # start per 25 MiB bucket.
    shape, cl = PRESETS["llama3-1b"], make_cluster("h100", 64)
    lay = Layout(dp=64, micro_batch=1)
    times = {b: evaluate(shape, lay, cl, 2048, 64, impl=Implementation(
        ddp_overlap=False, dp_buckets=b, nccl_protocols="simple",
        grad_reduce_dtype="bf16")).timing.dp  # Megatron-LM 2021: 16-bit gradients
             for b in ("whole", "torch")}
    grad = 2 * shape.params
    call = cl.collective("all_reduce", 25 * mib, 64, 1, "simple").start
    assert times["whole"] == pytest.approx(
        2 * 63 / 64 * grad / cl.bus_bandwidth(64, 1) + call)
    assert times["torch"] - times["whole"] == pytest.approx(
        (math.ceil(grad / (25 * mib)) - 1) * call)
    assert parse_fix("dp_buckets=mcore") == {"dp_buckets": "mcore"}
    with pytest.raises(PlanError, match="dp_buckets=nccl must be one of torch, mcore, "
                                        "deepspeed, whole"):
        parse_fix("dp_buckets=nccl")


def test_more_sharding_less_memory_and_search_respects_fix():
    shape, cl = PRESETS["llama3-8b"], make_cluster("h100", 8)
    mems = [evaluate(shape, Layout(dp=8, zero=z), cl, 4096, 8).memory.total for z in range(4)]
    assert mems == sorted(mems, reverse=True)
    fixed = {"tp": 2, "recompute": "full"}
    for lay in layouts(shape, cl, 4096, 16, fixed):
        assert lay.tp == 2 and lay.recompute == "full" and lay.gpus == 8
    best = search(shape, cl, 4096, 16, fixed, top=3)
    assert len(best) == 3 and all(c.fits for c in best)
    times = [c.timing.step_time_s for c in best]
    assert times == sorted(times)
    for c in best:  # the breakdown adds up to the step
        assert sum(c.timing.breakdown().values()) == pytest.approx(c.timing.step_time_s)


def test_search_tries_interleaved_zero_bubble_only_where_it_interleaves():
    """interleaved_zb with one chunk a rank is zb_h1's lists: searched with every v > 1 that
    divides layers / pp (as interleaved 1F1B), never at v = 1 unless the user pins it."""
    shape, cl = PRESETS["llama3-8b"], make_cluster("h100", 8)  # 32 layers
    for pp, want in ((2, {2, 4, 8, 16}), (8, {2, 4})):
        got = {lay.v for lay in layouts(shape, cl, 4096, 16, {"pp": pp, "tp": 1, "dp": 8 // pp})
               if lay.schedule == "interleaved_zb"}
        assert got == want, pp
    pinned = {"pp": 8, "tp": 1, "dp": 1, "schedule": "interleaved_zb", "v": 1}
    assert {lay.v for lay in layouts(shape, cl, 4096, 16, pinned)} == {1}


@pytest.mark.parametrize("text,msg", [
    ("tp=8,pp", "not key=value"), ("tq=2", "did you mean 'tp'"), ("tp=0", "positive integer"),
    ("recompute=some", "one of none, selective, full"), ("zero=4", "0, 1, 2 or 3"),
    ("sp=maybe", "true or false"), ("schedule=fast", "one of gpipe"),
    ("tp=2,pp=2,tp=4", "tp is pinned twice"),
])
def test_fix_errors_are_one_line(text, msg):
    with pytest.raises(PlanError, match=msg):
        parse_fix(text)


def test_invalid_pinned_layout_says_why():
    shape, cl = PRESETS["llama3-8b"], make_cluster("h100", 8)
    with pytest.raises(PlanError, match="tp=16 does not divide|not --gpus"):
        search(shape, cl, 4096, 16, {"tp": 16, "dp": 1, "pp": 1, "cp": 1})
    with pytest.raises(PlanError, match="does not divide --gpus 8"):
        search(shape, cl, 4096, 16, {"tp": 3})
    with pytest.raises(PlanError, match="global-batch 6 is not a multiple"):
        search(shape, cl, 4096, 6, {"tp": 1, "pp": 1, "cp": 1})


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshloom", "plan", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_table_json_and_config(tmp_path):
    r = _plan("--model", "small", "--gpus", "8", "--seq", "1024", "--global-batch", "32",
              "--top", "4")
    assert r.returncode == 0, r.stderr
    assert "model small" in r.stdout and "MFU" in r.stdout and "best: memory per GPU" in r.stdout
    out = tmp_path / "best.toml"
    r = _plan("--model", "small", "--gpus", "4", "--seq", "1024", "--global-batch", "16",
              "--json", "--write-config", str(out), "--fix", "tp=2")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    c = data["candidates"][0]
    for key in ("layout", "fits", "memory_per_gpu_bytes", "step_time_s", "tflops_per_gpu",
                "mfu", "tokens_per_s_per_gpu", "time_breakdown_s"):
        assert key in c
    assert set(c["memory_per_gpu_bytes"]) >= {"params", "grads", "optimizer", "activations",
                                               "buffers"}
    assert set(c["time_breakdown_s"]) == {"compute", "tp_comm", "cp_comm", "pp_comm",
                                          "dp_comm", "bubble", "optimizer"}
    assert c["layout"]["tp"] == 2 and c["fits"]
    # The written config is a valid meshloom config with the chosen layout.
    cfg = load_config(out, [])
    validate(cfg, world_size=4)
    assert cfg.parallel.tp == 2 and cfg.model.preset == "small" and cfg.data.seq_len == 1024


def _write(tmp_path, capsys, fix: str) -> tuple[int, str, str]:
    from meshloom.commands import main
    out = tmp_path / "best.toml"
    code = main(["plan", "--model", "small", "--gpus", "4", "--seq", "1024", "--global-batch",
                 "16", "--top", "1", "--write-config", str(out), "--fix", fix])
    return code, out.read_text() if out.exists() else "", capsys.readouterr().err.strip()


def test_written_config_carries_the_reduce_dtype(tmp_path, capsys):
    code, text, _ = _write(tmp_path, capsys, "tp=2,grad_reduce_dtype=bf16")
    assert code == 0 and 'reduce_dtype = "bf16"' in text
    cfg = load_config(tmp_path / "best.toml", [])
    validate(cfg, world_size=4)
    assert cfg.parallel.reduce_dtype == "bf16"
    code, text, _ = _write(tmp_path, capsys, "tp=2")
    assert code == 0 and "reduce_dtype" not in text


def test_written_config_carries_reduce_once(tmp_path, capsys):
    """ZeRO-3 planned with `fsdp_no_sync` is meshloom's `parallel.reduce_once`."""
    code, text, err = _write(tmp_path, capsys, "zero=3,micro_batch=1,fsdp_no_sync=true")
    assert code == 0 and "reduce_once = true" in text, err
    cfg = load_config(tmp_path / "best.toml", [])
    validate(cfg, world_size=4)
    assert cfg.parallel.reduce_once and cfg.parallel.zero_stage == 3
    code, text, _ = _write(tmp_path, capsys, "zero=3,micro_batch=1,fsdp_no_sync=false")
    assert code == 0 and "reduce_once" not in text


def test_the_search_tries_reduce_once_for_meshloom_only():
    """Unpinned, meshloom's ZeRO-3 with four micro-batches on a small model (memory to spare)
    sums once: planned faster by more than ALT_MARGIN. Another trainer's is not tried."""
    r = _plan("--model", "small", "--gpus", "4", "--seq", "1024", "--global-batch", "16",
              "--top", "1", "--fix", "zero=3,micro_batch=1", "--json")
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)["candidates"][0]
    assert c["summary"].endswith("reduce-once")
    assert c["time_detail_s"]["implementation"]["fsdp_no_sync"] is True
    r = _plan("--model", "small", "--gpus", "4", "--seq", "1024", "--global-batch", "16",
              "--top", "1", "--fix", "zero=3,micro_batch=1", "--trainer", "torchtitan",
              "--json")
    assert r.returncode == 0, r.stderr
    assert "reduce-once" not in json.loads(r.stdout)["candidates"][0]["summary"]


@pytest.mark.parametrize("fix,said", [("fsdp_prefetch=false", "fsdp_prefetch=false"),
                                      ("zero=3,pp_fsdp=pytorch", "pp_fsdp=pytorch"),
                                      ("attention_kernel=triton", "attention_kernel=triton")])
def test_no_config_for_a_run_meshloom_would_not_be(tmp_path, capsys, fix, said):
    """A key pinned with --fix that a meshloom config cannot say: the written config would run
    otherwise than planned, so none is written (one line, exit 2)."""
    code, text, err = _write(tmp_path, capsys, fix)
    assert code == 2 and text == ""
    assert err == ("meshloom plan: error: --write-config writes a meshloom config, which "
                   f"cannot say {said} (from --fix); drop one of them")


def test_the_environment_is_not_refused(tmp_path, capsys):
    """What SDPA picks and NCCL's protocols are the run's environment, not its config."""
    code, _, err = _write(tmp_path, capsys, "tp=2,attention_kernel=cudnn,nccl_protocols=simple")
    assert code == 0, err


def test_cli_hf_config_and_explicit_dims(tmp_path):
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 512,
                              "num_hidden_layers": 4, "num_attention_heads": 8,
                              "num_key_value_heads": 4, "intermediate_size": 1376,
                              "vocab_size": 32000}))
    r = _plan("--model", str(hf), "--gpus", "2", "--seq", "512", "--global-batch", "4",
              "--json", "--top", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["hidden"] == 512
    r = _plan("--arch", "gpt", "--hidden", "768", "--layers", "12", "--heads", "12",
              "--vocab", "50257", "--gpus", "1", "--seq", "1024", "--global-batch", "8",
              "--top", "1")
    assert r.returncode == 0, r.stderr
    assert "0.125B parameters (gpt" in r.stdout  # GPT-2 small + 2048 positions


@pytest.mark.parametrize("args,msg", [
    (["--model", "llama9"], "unknown"),
    (["--gpu", "h1000", "--model", "tiny"], "did you mean 'h100'"),
    (["--arch", "llama", "--hidden", "64"], "needs --layers"),
    (["--model", "tiny", "--gpus", "0"], "--gpus=0"),
    (["--model", "tiny", "--gpus", "8", "--gpus-per-node", "3"],
     "--gpus=8 is 2 nodes of --gpus-per-node=3 and 2 over"),
    (["--model", "tiny", "--fix", "tp=3"], "does not divide"),
    (["--model", "tiny", "--gpu-memory-gb", "nan"], "--gpu-memory-gb=nan must be positive"),
    (["--model", "tiny", "--intra-node-gbps", "0"], "--intra-node-gbps=0.0 must be positive"),
    (["--model", "tiny", "--inter-node-gbps", "-1"], "--inter-node-gbps=-1.0 must be positive"),
    (["--model", "tiny", "--peak-tflops", "0"], "--peak-tflops=0.0 must be positive"),
    (["--model", "tiny", "--hbm-gbps", "-3"], "--hbm-gbps=-3.0 must be positive"),
    (["--model", "tiny", "--gpu", "b200"], "the nearest preset with its figures given"),
    (["--model", "gpt2", "--write-config", "/nonexistent/x.toml"], "does not exist"),
    (["--model", "tiny", "--write-config", "/nonexistent/x.toml"], "does not exist"),
    (["--model", "tiny", "--head-dim", "16"], "(--head-dim with --model tiny)"),
    (["--model", "tiny", "--positions", "0"], "(--positions with --model tiny)"),
    (["--arch", "gpt", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "100",
      "--qk-norm"], "gpt blocks take linear_bias, not the llama options"),
    (["--arch", "llama", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "100",
      "--sliding-window", "0"], "sliding_window=0 must be a positive integer"),
    (["--model", "mixtral-tiny", "--gpus", "4", "--seq", "64", "--global-batch", "4", "--fix",
      "tp=2,ep=2,sp=false,expert_tp=true"], "which Megatron-Core runs only with sequence "
                                            "parallel: add sp=true"),
])
def test_cli_bad_input_one_line_exit_2(args, msg, capsys):
    from meshloom.commands import main
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1, err


def test_cli_dimensions_state_every_shape_option(capsys):
    """A shape given by flags takes every option an HF config can: the Nemotron-style block of
    tests/test_plan_models.py (6 heads of 16 on 64, 2 k/v heads, no biases, RoPE, untied, no
    dropout) counts the 95,360 parameters transformers' NemotronForCausalLM has, and a head
    width equal to hidden / heads is the default, not an option."""
    from meshloom.commands import main
    flags = ["--arch", "gpt", "--hidden", "64", "--layers", "2", "--heads", "6", "--kv-heads",
             "2", "--head-dim", "16", "--ffn-hidden", "192", "--vocab", "100", "--positions",
             "0", "--no-tied", "--no-linear-bias", "--no-dropout", "--sliding-window", "32"]
    run = ["plan", "--gpus", "2", "--seq", "64", "--global-batch", "4", "--top", "1", "--json"]
    assert main([*run, *flags]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["params"] == 95_360
    assert (model["q_dim"], model["kv_dim"], model["sliding_window"]) == (96, 32, 32)
    assert (model["linear_bias"], model["tied"], model["positions"], model["dropout"]) == (
        False, False, 0, False)
    assert main([*run, "--arch", "llama", "--hidden", "64", "--layers", "2", "--heads", "4",
                 "--vocab", "100", "--head-dim", "16", "--qkv-bias", "--qk-norm"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["explicit_head_dim"] is None and model["qkv_bias"] and model["qk_norm"]


def test_fix_help_names_every_key(capsys):
    """`meshloom plan --help` lists every key --fix takes, layout and implementation alike."""
    from meshloom.commands import main
    from meshloom.plan.layout import FIX_KEYS
    with pytest.raises(SystemExit) as done:
        main(["plan", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    fix = text.split("--fix KEY=V,...", 2)[-1].split("--top", 1)[0]
    listed = {k.strip(" ,;.:()") for k in fix.replace(":", ",").replace(";", ",").split(",")}
    assert set(FIX_KEYS) <= listed, set(FIX_KEYS) - listed


def test_action_variability_lengthens_the_pipeline():
    """--action-cv: the mean span of seeded simulations with each action's time varied. It only
    adds time, grows with cv, is the same on every call, and leaves cv 0 (every GPU preset)
    alone; bad values are refused."""
    from meshloom.plan import PlanError
    from meshloom.plan.hardware import make_cluster
    from meshloom.plan.layout import Layout
    from meshloom.plan.models import from_dims
    from meshloom.plan.search import evaluate

    shape = from_dims("llama", 384, 8, 6, 257, kv_heads=2)

    def bubble(schedule: str, v: int, cv: float) -> float:
        lay = Layout(pp=2, dp=1, micro_batch=4, schedule=schedule, v=v)
        return evaluate(shape, lay, make_cluster("h100", 2, action_cv=cv), 64, 16,
                        "fp32").timing.bubble_fraction

    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)):
        plain, low, high = (bubble(schedule, v, cv) for cv in (0.0, 0.05, 0.15))
        assert plain < low < high < plain + 0.05, (schedule, plain, low, high)
        assert bubble(schedule, v, 0.15) == high
    assert bubble("1f1b", 1, 0.0) == pytest.approx(0.2, abs=0.005)
    # The figures docs/plan.md quotes (seeded, so the same everywhere up to rounding).
    quoted = {("1f1b", 1): (0.201, 0.211), ("gpipe", 1): (0.201, 0.221),
              ("interleaved_1f1b", 2): (0.114, 0.122)}
    for (schedule, v), pair in quoted.items():
        got = tuple(round(bubble(schedule, v, cv), 3) for cv in (0.0, 0.1))
        assert got == pair, (schedule, got)
    for bad in (-0.1, 1.0):
        with pytest.raises(PlanError, match="--action-cv"):
            make_cluster("h100", 2, action_cv=bad)


def test_zero_bubble_halves_carry_the_backward_once():
    """zb_h1 splits each backward into I (input gradients, with the backward's tp and cp
    collectives) and W (weight gradients, none): together they are the 1F1B backward, so the
    ranks' busy time is the same under both schedules and only the idle time differs. (W once
    carried half the collectives again, which the simulated span counted as bubble.)"""
    from meshloom.plan.hardware import make_cluster
    from meshloom.plan.layout import Layout
    from meshloom.plan.models import PRESETS
    from meshloom.plan.search import evaluate

    def busy(schedule: str) -> float:  # the ranks' mean busy seconds in the simulated span
        t = evaluate(PRESETS["llama3-8b"], Layout(tp=2, pp=4, dp=2, sp=True, micro_batch=1,
                                                 zero=1, schedule=schedule),
                     make_cluster("h100", 16), 4096, 64).timing
        span = t.bubble + t.compute + t.tp + t.cp + t.ep
        return (1 - t.bubble_fraction) * span
    assert busy("zb_h1") == pytest.approx(busy("1f1b"), rel=1e-9)
