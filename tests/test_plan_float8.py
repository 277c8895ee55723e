"""Float8 pricing (`--fix float8=tensorwise`): the blocks' linear GEMMs at the kernel table's
fp8/bf16 ratio (`gemm_fp8`), torchao's casts as elementwise traffic, and the weights gathered in
fp8 under `float8_all_gather` (plan/implementation.py, plan/kernel_table.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import ROOT

from meshloom.plan import PlanError
from meshloom.plan.compute import (
    GEMM_BYTES,
    block_cost,
    float8_cast_bytes,
    launched_gemms,
    rates_for,
)
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.kernel_table import TABLE_DIR, for_gpu, gemm_intensity, parse
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.models import PRESETS, from_dims
from meshloom.plan.search import evaluate, search
from meshloom.plan.step_kernels import Gemm, block_gemms
from meshloom.plan.timing import step_time
from meshloom.plan.trainers import trainer_impl

LLAMA8B = from_dims("llama", 4096, 32, 32, 128256, kv_heads=8, ffn_hidden=14336)
TITAN = Implementation(**{**trainer_impl("torchtitan"), "compile": True})
F8 = replace(TITAN, float8="tensorwise")
LAY = Layout(dp=8, micro_batch=2, zero=3, recompute="selective")


def _table_ratio(k: int) -> float:
    rows = json.loads((TABLE_DIR / "h100.json").read_text())["gemm_fp8"]
    row = next(r for r in rows if r["k"] == k)
    return row["tflops"] / row["bf16_tflops"]


def test_the_fp8_ratio_is_the_benchmarks_own_at_its_points_and_clamped_beyond():
    table = for_gpu("h100")
    for k in (256, 2048, 16384):
        assert table.fp8_speedup(8192, 8192, k) == pytest.approx(_table_ratio(k), rel=1e-12)
    # half way (in log2 of the intensity) between two points: the mean of their ratios
    lo, hi = gemm_intensity(8192, 8192, 2048), gemm_intensity(8192, 8192, 4096)
    mid = (lo * hi) ** 0.5
    m = 1.0 / (1.0 / mid - 2.0 / 8192)  # the k whose intensity at m = n = 8192 is `mid`
    assert table.fp8_speedup(8192, 8192, m) == pytest.approx(
        (_table_ratio(2048) + _table_ratio(4096)) / 2, rel=1e-9)
    assert table.fp8_speedup(64, 64, 64) == pytest.approx(_table_ratio(256))
    assert table.fp8_speedup(65536, 65536, 65536) == pytest.approx(_table_ratio(16384))
    # the same intensity in any orientation: the ratio follows how compute-bound a shape is
    assert table.fp8_speedup(16384, 1024, 4096) == table.fp8_speedup(1024, 4096, 16384)
    assert table.fp8_speedup(16384, 1024, 4096) < table.fp8_speedup(16384, 4096, 4096)


def test_tables_with_the_h100_compute_take_its_fp8_rows_and_the_a100s_have_none():
    assert for_gpu("h200").fp8_ratio == for_gpu("h100").fp8_ratio
    assert for_gpu("h100-96gb").fp8_ratio == for_gpu("h100").fp8_ratio
    with pytest.raises(PlanError, match="a100-80g: no fp8 GEMM rows"):
        for_gpu("a100-80g").fp8_speedup(8192, 8192, 8192)


def test_fp8_rows_are_checked_on_load():
    raw = json.loads((TABLE_DIR / "h100.json").read_text())
    bad = json.loads(json.dumps(raw))
    del bad["gemm_fp8"][0]["bf16_source"]
    with pytest.raises(PlanError, match=r"gemm_fp8 row 0 \(bf16_source\)"):
        parse(bad)
    bad = json.loads(json.dumps(raw))
    bad["gemm_fp8"][1]["bf16_tflops"] = 0
    with pytest.raises(PlanError, match="gemm_fp8 row 1: sizes must be positive"):
        parse(bad)
    # a shape given twice is their mean; its transposes share its intensity and the point
    two = json.loads(json.dumps(raw))
    first = two["gemm_fp8"][0]
    two["gemm_fp8"].append({**first, "tflops": first["tflops"] / 2})
    two["gemm_fp8"].append({**first, "m": first["k"], "k": first["m"], "tflops": 1.0,
                            "bf16_tflops": 1.0})
    table = parse(two)
    m, n, k = first["m"], first["n"], first["k"]
    ratio = first["tflops"] / first["bf16_tflops"]
    assert table.fp8_speedup(m, n, k) == pytest.approx(0.75 * ratio)
    assert table.fp8_speedup(k, n, m) == 1.0
    assert table.fp8_ratio[0] == (pytest.approx(gemm_intensity(m, n, k)),
                                  pytest.approx((0.75 * ratio + 1.0) / 2))
    assert len(table.fp8_ratio) == len(raw["gemm_fp8"])


def test_an_fp8_gemm_runs_at_the_bf16_rate_times_the_ratio_and_reads_bytes_operands():
    rates = rates_for(make_cluster("h100", 8))
    g = Gemm("w1", 16384, 14336, 4096)
    bf16, fp8 = rates.gemm(g), rates.gemm(g, fp8=True)
    assert bf16 / fp8 == pytest.approx(rates.table.fp8_speedup(16384, 14336, 4096), rel=1e-12)
    # a shape whose time is its bytes: fp8 operands are one byte, the output stays 16-bit
    thin = Gemm("thin", 65536, 8, 8)
    moved = 65536 * 8 + 8 * 8 + GEMM_BYTES * 65536 * 8
    assert rates.gemm(thin, fp8=True) == pytest.approx(moved / (rates.hbm_gbps * 1e9))
    with pytest.raises(PlanError, match="--kernels datasheet"):
        rates_for(make_cluster("h100", 8, kernels="datasheet")).gemm(g, fp8=True)


def test_the_blocks_linears_go_fp8_and_pay_torchaos_casts():
    rates = rates_for(make_cluster("h100-96gb", 8))
    lay = replace(LAY, recompute="none")
    base, f8 = (block_cost(LLAMA8B, lay, rates, 8192, 2, True, i) for i in (TITAN, F8))
    gemms = launched_gemms(block_gemms(LLAMA8B, 2 * 8192, 1), TITAN)
    assert f8.fwd.gemm == pytest.approx(sum(rates.gemm(g, True) for g in gemms), rel=1e-12)
    assert f8.bwd.gemm == pytest.approx(
        sum(rates.gemm(b, True) for g in gemms for b in g.backward()), rel=1e-12)
    assert f8.fwd.attention == base.fwd.attention and f8.bwd.attention == base.bwd.attention
    cast_f, cast_b, _ = float8_cast_bytes(gemms, F8, lay)
    bw = rates.hbm_gbps * 1e9
    assert f8.fwd.elementwise - base.fwd.elementwise == pytest.approx(cast_f / bw, rel=1e-9)
    assert f8.bwd.elementwise - base.bwd.elementwise == pytest.approx(cast_b / bw, rel=1e-9)
    # torchao's traffic: input 4 (abs-max fused under compile) or 6 bytes an element, weight 6,
    # output gradient 4 or 6; the weight cast on its shard when it is gathered in fp8
    tokens, weights = 2 * 8192, sum(g.n * g.k for g in gemms)
    inputs, outputs = sum(g.k for g in gemms) * tokens, sum(g.n for g in gemms) * tokens
    assert cast_f == 4 * inputs + 6 * weights and cast_b == 4 * outputs
    eager = replace(F8, compile=False)
    assert float8_cast_bytes(gemms, eager, lay)[:2] == (6 * inputs + 6 * weights, 6 * outputs)
    gathered = replace(F8, float8_all_gather=True)
    assert float8_cast_bytes(gemms, gathered, replace(lay, zero=3))[:2] == (
        4 * inputs + 6 * weights / 8, 4 * outputs + 2 * weights)
    # full recompute casts again
    full = block_cost(LLAMA8B, replace(lay, recompute="full"), rates, 8192, 2, True, F8)
    assert full.bwd.elementwise == pytest.approx(f8.bwd.elementwise + f8.fwd.elementwise)


def test_weights_gathered_in_fp8_move_half_the_linears_bytes():
    cluster = make_cluster("h100-96gb", 8)
    plain, fp8 = (step_time(LLAMA8B, LAY, cluster, 8192, 16, impl=replace(F8, **kw))
                  .detail["comm_s"]["dp"]["ops"] for kw in ({}, {"float8_all_gather": True}))
    outer = (LLAMA8B.embedding_params + LLAMA8B.final_norm_params
             + LLAMA8B.vocab * LLAMA8B.hidden)
    blocks = LLAMA8B.layers * LLAMA8B.layer_params
    # per gather: the blocks' bytes with the linears' halved, the outer parameters as before;
    # FSDP2 copies out every gather (the blocks twice a micro-batch, the outer ones once)
    shard = 1 - 1 / LAY.dp
    before = 2 * blocks * shard, 2 * outer * shard
    after = (2 * blocks - LLAMA8B.layers * LLAMA8B.layer_matmul_params) * shard, before[1]
    assert fp8["all_gather_copy_out"] / plain["all_gather_copy_out"] == pytest.approx(
        (2 * after[0] + after[1]) / (2 * before[0] + before[1]), rel=1e-9)
    assert 0.5 < after[0] / before[0] < 0.51
    assert fp8["all_gather"] < 0.6 * plain["all_gather"]
    assert plain["reduce_scatter"] == fp8["reduce_scatter"]  # gradients still in fp32
    none = step_time(LLAMA8B, LAY, cluster, 8192, 16, impl=replace(TITAN, float8_all_gather=True))
    assert none.detail["comm_s"]["dp"]["ops"] == step_time(
        LLAMA8B, LAY, cluster, 8192, 16, impl=TITAN).detail["comm_s"]["dp"]["ops"]


def test_float8_is_faster_on_hopper_and_says_so_in_the_rates_line():
    cluster = make_cluster("h100-96gb", 8)
    bf16 = evaluate(LLAMA8B, LAY, cluster, 8192, 16, impl=TITAN)
    f8 = evaluate(LLAMA8B, LAY, cluster, 8192, 16, impl=F8)
    assert 1.1 < bf16.timing.step_time_s / f8.timing.step_time_s < 2.0
    assert "float8: tensorwise" in f8.timing.detail["rates"]
    assert "float8" not in bf16.timing.detail["rates"]
    assert f8.memory.total == bf16.memory.total  # counted as in bf16


@pytest.mark.parametrize("case, match", [
    ("fp32", "trains in bf16"),
    ("moe", "has experts"),
])
def test_what_float8_is_not_priced_for_is_refused_in_one_line(case, match):
    cluster = make_cluster("h100", 8)
    shape, lay, dtype = LLAMA8B, LAY, "bf16"
    if case == "fp32":
        dtype = "fp32"
    else:
        shape = PRESETS["mixtral-8x7b"]
    with pytest.raises(PlanError, match=match):
        evaluate(shape, lay, cluster, 8192, 16, dtype=dtype, impl=F8)


def test_the_search_prices_float8_and_refuses_what_it_cannot():
    cluster = make_cluster("h100", 16)
    fixed = {**parse_fix("float8=tensorwise,compile=true"), "micro_batch": 1}
    best = search(LLAMA8B, cluster, 4096, 32, fixed, top=5)
    assert best and all("float8: tensorwise" in c.timing.detail["rates"] for c in best)
    tp = search(LLAMA8B, cluster, 4096, 32, {**fixed, "tp": 2, "sp": True}, top=1)[0]
    assert tp.layout.tp == 2
    with pytest.raises(PlanError, match="has experts"):
        search(PRESETS["mixtral-8x7b"], cluster, 4096, 32, fixed, top=1)
    with pytest.raises(PlanError, match="no fp8 GEMM rows"):
        search(LLAMA8B, make_cluster("a100-80g", 16), 4096, 32, fixed, top=1)
    with pytest.raises(PlanError, match="float8=rowwise must be one of none, tensorwise"):
        parse_fix("float8=rowwise")


# torchtitan's runs with and without Float8 on the same layout, and how far the planned gain
# (predicted Float8 over predicted bf16 throughput) may sit from the published one, as
# docs/plan-step-time.md says: (bf16 row, lowest, highest planned / published gain).
PAIRS = (
    ("torchtitan-h100-llama3.1-8b-8192-8gpu-compile", 0.98, 1.0),
    ("torchtitan-h100-llama3.1-8b-8192-128gpu-compile", 0.98, 1.0),
    ("torchtitan-h100-llama3.1-70b-8192-256gpu-fsdp32-tp8-compile", 1.0, 1.09),
    ("torchtitan-h100-llama3.1-70b-8192-256gpu-fsdp32-asynctp8-compile", 1.0, 1.03),
    ("torchtitan-h100-llama3.1-8b-8192-64gpu-fsdp8-tp8-compile", 1.11, 1.12),
    ("torchtitan-h100-llama3.1-8b-8192-64gpu-fsdp8-asynctp8-compile", 1.11, 1.12),
)


@pytest.mark.parametrize("bf16_id, low, high", PAIRS, ids=[p[0][27:] for p in PAIRS])
def test_the_planned_float8_gain_against_torchtitans_paired_runs(bf16_id, low, high):
    rows = {r["id"]: r for r in json.loads(
        (ROOT / "benchmarks/results/planner/validation.json").read_text())["rows"]}
    bf16, f8 = rows[bf16_id], rows[bf16_id + "-float8"]
    planned = f8["predicted_tokens_per_s_per_gpu"] / bf16["predicted_tokens_per_s_per_gpu"]
    published = f8["published_tokens_per_s_per_gpu"] / bf16["published_tokens_per_s_per_gpu"]
    assert low < planned / published < high, (planned, published)


def test_the_step_time_page_quotes_the_paired_gains():
    doc = " ".join((ROOT / "docs" / "plan-step-time.md").read_text().split())
    for text in ("the planned Float8 gain is within 2% of the published one, below it",
                 "it is 9% above with vanilla TP and within 3% with async TP",
                 "FSDP 8 × TP 8 it is 11–12% above"):
        assert text in doc


def test_under_tp_the_module_inputs_are_cast_once_on_the_sequence_slice():
    """torchao's float8 tp styles: `PrepareFloat8ModuleInput` casts attention's and the
    feed-forward's input once, on the rank's SP slice, before the gather; wo and w2 cast
    their own inputs, and their output gradients on the slice before the backward's gather."""
    tokens, t, h = 2 * 8192, 8, LLAMA8B.hidden
    lay = Layout(tp=t, dp=8, sp=True, micro_batch=2, zero=3, recompute="none")
    gemms = block_gemms(LLAMA8B, tokens, t)
    cast_f, cast_b, _ = float8_cast_bytes(gemms, F8, lay)
    weights = sum(g.n * g.k for g in gemms)
    by = {g.name: g for g in gemms}
    inputs = 2 * tokens * h / t + tokens * (by["wo"].k + by["w2"].k)
    grads = tokens * sum(by[n].n for n in ("wq", "wk", "wv", "w1", "w3")) + 2 * tokens * h / t
    assert cast_f == pytest.approx(4 * inputs + 6 * weights, rel=1e-12)
    assert cast_b == pytest.approx(4 * grads, rel=1e-12)
    # without SP the module inputs are whole on every rank, cast once all the same
    whole = float8_cast_bytes(gemms, F8, replace(lay, sp=False))[0]
    assert whole == pytest.approx(cast_f + 4 * 2 * tokens * h * (1 - 1 / t), rel=1e-12)


def test_under_sp_the_gathers_carry_fp8_and_the_reductions_bf16():
    cluster = make_cluster("h100-96gb", 64)
    lay = Layout(tp=8, dp=8, sp=True, micro_batch=1, zero=3, recompute="selective")
    tp = {k: step_time(LLAMA8B, lay, cluster, 8192, 8, impl=v).detail["comm_s"]["tp"]
          for k, v in (("bf16", TITAN), ("fp8", F8))}
    act = 8192 * LLAMA8B.hidden
    ag2, ag1, rs = (cluster.collective(op, act * e, 8, 1, "auto").seconds
                    for op, e in (("all_gather", 2), ("all_gather", 1), ("reduce_scatter", 2)))
    ratio = (ag1 + rs) / (ag2 + rs)
    assert ratio < 1
    # the blocks' collectives; the head's (bf16, not a Float8Linear) as before
    assert tp["fp8"]["ops"]["collectives"] == pytest.approx(
        tp["bf16"]["ops"]["collectives"] * ratio, rel=1e-9)
    assert tp["fp8"]["ops"]["embedding_and_head"] == tp["bf16"]["ops"]["embedding_and_head"]


def test_the_float8_rows_are_quoted_and_planned_with_their_recipe():
    runs = [r for r in json.loads((ROOT / "benchmarks/published/runs.json").read_text())["runs"]
            if r["precision"] == "bf16+float8"]
    rows = {r["id"]: r for r in json.loads(
        (ROOT / "benchmarks/results/planner/validation.json").read_text())["rows"]}
    assert len(runs) == 11
    for run in runs:
        tps = run["published"]["tokens_per_s_per_gpu"]
        assert f"{tps:,.0f}" in run["quote"] or f"{tps:g}" in run["quote"], run["id"]
        row = rows[run["id"]]
        assert "float8=tensorwise" in row["fix"] and row["fits"], run["id"]
        assert row["set"].endswith("-float8")
        gathered = run["implementation"].get("float8_all_gather", False)
        assert ("weights gathered in fp8" in row["rates"]) == gathered, run["id"]


def test_bench_kernels_measures_fp8_gemms_beside_the_bf16_ones(tmp_path):
    """`meshloom bench kernels` on a GPU with fp8 tensor cores writes `gemm_fp8` rows, each
    with the bf16 rate of the same shape; here on the CPU (whose rates mean nothing) the
    pipeline runs through `torch._scaled_mm` and the table it writes prices Float8 by shape."""
    import torch

    from meshloom.plan import kernel_bench as kb
    from meshloom.plan.kernel_table import load

    cpu = torch.device("cpu")
    assert not kb.fp8_supported(cpu)
    bf16 = [{"m": 64, "n": 32, "k": 48, "tflops": 0.5}, {"m": 64, "n": 30, "k": 48, "tflops": 0.5}]
    rows, skipped = kb.bench_fp8_gemms(bf16, cpu, warmup=1, reps=2)
    assert [(r["m"], r["n"], r["k"], r["bf16_tflops"]) for r in rows] == [(64, 32, 48, 0.5)]
    assert rows[0]["tflops"] > 0 and skipped == ["fp8 gemm 64x30x48: a dimension is not a "
                                                 "multiple of 16"]
    plan = kb.BenchPlan(gemms=((64, 32, 48),), attention=(), stream_bytes=1 << 16, launches=10,
                        warmup=1, reps=2)
    results = kb.measure(plan, cpu, torch.float32, fp8=True)
    table = kb.make_table("h100", "cpu", "fp32", results, {"note": "test"})
    path = tmp_path / "t.json"
    kb.write_table(path, table)
    loaded = load(path)
    row = table["gemm_fp8"][0]
    assert loaded.fp8_speedup(64, 32, 48) == pytest.approx(row["tflops"] / row["bf16_tflops"])
    assert "fp8 GEMM: 1 shapes" in kb.format_summary(table)
    assert "gemm_fp8" not in kb.make_table("h100", "cpu", "fp32",
                                           kb.measure(plan, cpu, torch.float32), {"note": "t"})


def test_the_step_time_page_quotes_the_float8_example_files():
    files = {k: json.loads((ROOT / f"benchmarks/results/planner/torchtitan_llama3_8b_8xh100{k}"
                                   ".json").read_text())["candidates"][0]
             for k in ("", "_float8")}
    bf16, f8 = files[""], files["_float8"]
    gemm = [c["time_detail_s"]["compute_s"]["gemm"] * 1e3 for c in (bf16, f8)]
    ew = [c["time_detail_s"]["compute_s"]["elementwise"] * 1e3 for c in (bf16, f8)]
    gain = f8["tokens_per_s_per_gpu"] / bf16["tokens_per_s_per_gpu"]
    doc = " ".join((ROOT / "docs" / "plan-step-time.md").read_text().split())
    assert (f"plans {bf16['step_time_s']:.2f} s a step in bf16 and {f8['step_time_s']:.2f} s "
            f"with Float8 and its weights gathered in fp8, {gain:.2f}× the throughput: the GEMMs "
            f"take {gemm[0]:.0f} ms in bf16 and {gemm[1]:.0f} ms in fp8, the elementwise kernels "
            f"{ew[0]:.0f} ms and {ew[1]:.0f} ms with the casts") in doc
    assert "float8: tensorwise" in f8["time_detail_s"]["rates"]
