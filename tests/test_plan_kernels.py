"""The planner's kernel-level pricing: kernel tables (lookups, checks), the block's kernel
inventory, the terms built on them (cross entropy, launch gaps, optimizer traffic), the
implementation options of --fix, the memory fixes and `meshloom plan --explain`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import load_benchmark

from meshloom.plan import PlanError
from meshloom.plan import compute as compute_mod
from meshloom.plan.compute import Rates, block_cost, head_cost, rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import MESHLOOM, Implementation, split_fix
from meshloom.plan.kernel_table import attention_flops, available, for_gpu, load, parse
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import memory_per_gpu, outer_params, rank_param_split
from meshloom.plan.models import PRESETS, from_dims
from meshloom.plan.search import evaluate, search
from meshloom.plan.step_kernels import all_gemms, block_gemms

TABLE = {
    "gpu": "test", "kind": "measured", "device": "made up", "dtype": "bf16",
    "gemm": [{"m": 1024, "n": 1024, "k": 1024, "tflops": 100.0},
             {"m": 4096, "n": 4096, "k": 4096, "tflops": 400.0},
             {"m": 16384, "n": 16384, "k": 16384, "tflops": 600.0}],
    "attention": [{"seq": 1024, "head_dim": 128, "causal": True, "direction": "fwd",
                   "tflops": 200.0},
                  {"seq": 4096, "head_dim": 128, "causal": True, "direction": "fwd",
                   "tflops": 400.0},
                  {"seq": 1024, "head_dim": 128, "causal": True, "direction": "fwd_bwd",
                   "tflops": 175.0}],
    "hbm_gbps": {"value": 2000.0}, "launch_us": {"value": 5.0},
}


def test_gemm_lookup_is_exact_on_a_point_and_between_its_neighbours_off_it():
    t = parse(TABLE)
    assert t.gemm_tflops(4096, 4096, 4096) == 400.0
    mid = t.gemm_tflops(8192, 8192, 8192)
    assert 400.0 < mid < 600.0
    # Symmetric in log space: halfway between two points weighs them equally.
    two = parse({**TABLE, "gemm": TABLE["gemm"][1:]})
    assert two.gemm_tflops(8192, 8192, 8192) == pytest.approx(500.0)
    assert t.gemm_tflops(100, 100, 100) == pytest.approx(t.gemm_tflops(100, 100, 100))
    assert t.gemm_tflops(64, 64, 64) < 200.0  # nearest the smallest point


def test_attention_lookup_interpolates_in_log_seq_and_derives_backward():
    t = parse(TABLE)
    assert t.attention_tflops(1024, 128, True, "fwd") == 200.0
    assert t.attention_tflops(2048, 128, True, "fwd") == pytest.approx(300.0)
    assert t.attention_tflops(65536, 128, True, "fwd") == 400.0  # clamped
    assert t.attention_tflops(1024, 64, False, "fwd") == 200.0  # nearest width, other mask
    # bwd from fwd and fwd_bwd: 3.5F/175 = F/200 + 2.5F/bwd  ->  bwd = 2.5 / (3.5/175 - 1/200)
    assert t.attention_tflops(1024, 128, True, "bwd") == pytest.approx(2.5 / (0.02 - 0.005))


TRITON = [{"seq": 1024, "head_dim": 128, "causal": True, "direction": "fwd_bwd",
           "tflops": 70.0, "kernel": "triton"},
          {"seq": 4096, "head_dim": 128, "causal": True, "direction": "fwd_bwd",
           "tflops": 70.0, "kernel": "triton"},
          {"seq": 4096, "head_dim": 128, "causal": True, "direction": "fwd_bwd",
           "tflops": 350.0}]


def test_another_attention_kernel_runs_at_its_published_ratio_to_flashattention2():
    """A Triton row set beside FlashAttention-2's: the asked shape at FlashAttention-2's rate
    times the two kernels' ratio at that length in the series both were published for."""
    t = parse({**TABLE, "attention": TABLE["attention"] + TRITON})
    assert t.attention_tflops(1024, 128, True, "fwd") == 200.0  # FlashAttention-2 unchanged
    # At 1024 the fwd_bwd ratio is 70/175 = 0.4, at 4096 70/350 = 0.2, at 2048 (halfway in
    # log seq) 70/262.5; it scales every direction.
    assert t.attention_tflops(1024, 128, True, "fwd", "triton") == pytest.approx(200.0 * 0.4)
    assert t.attention_tflops(4096, 128, True, "fwd", "triton") == pytest.approx(400.0 * 0.2)
    assert t.attention_tflops(2048, 128, True, "fwd", "triton") == pytest.approx(
        300.0 * 70.0 / 262.5)
    assert t.attention_tflops(1024, 128, True, "fwd_bwd", "triton") == pytest.approx(70.0)
    with pytest.raises(PlanError, match="no 'triton' attention rows"):
        parse(TABLE).attention_tflops(1024, 128, True, "fwd", "triton")


def test_a_head_width_a_kernel_was_not_compiled_for_runs_padded():
    """A kernel runs a model's heads at the next width it was compiled for and does that
    width's FLOPs: FlashAttention-2 a multiple of 32 (64 beyond 128), FlashAttention 1 its
    32/64/128 kernels, the Triton kernel the next power of two. The rate in the model's FLOPs
    is the padded width's times head_dim / padded; a width the table measured is as measured."""
    from meshloom.plan.kernel_table import padded_head_dim

    assert [padded_head_dim(d, "fa2") for d in (40, 64, 80, 96, 112, 128, 160)] == \
        [64, 64, 96, 96, 128, 128, 192]
    assert [padded_head_dim(d, "fa1") for d in (24, 40, 80, 96, 112, 128)] == \
        [32, 64, 128, 128, 128, 128]
    assert [padded_head_dim(d, "triton") for d in (8, 40, 80, 96, 112, 128)] == \
        [16, 64, 128, 128, 128, 128]
    t = parse({**TABLE, "attention": TABLE["attention"] + TRITON})
    assert t.attention_tflops(1024, 112, True, "fwd") == pytest.approx(200.0 * 112 / 128)
    assert t.attention_tflops(1024, 80, True, "fwd") == pytest.approx(200.0 * 80 / 96)
    assert t.attention_tflops(1024, 80, True, "fwd", "triton") == pytest.approx(
        200.0 * 0.4 * 80 / 128)
    assert t.attention_tflops(1024, 96, True, "fwd", "triton") == pytest.approx(
        200.0 * 0.4 * 96 / 128)
    # Measured at the model's own width (a `meshloom bench kernels` table): as measured.
    own = parse({**TABLE, "attention": TABLE["attention"] + [
        {"seq": 1024, "head_dim": 80, "causal": True, "direction": "fwd", "tflops": 150.0}]})
    assert own.attention_tflops(1024, 80, True, "fwd") == 150.0
    # Through the planner: a GPT block of 96-wide heads under FlashAttention 1 (128 kernel)
    # takes 128/96 the attention time of one whose kernel had a 96-wide build.
    rates = rates_for(make_cluster("a100-80g", 8))
    shape = from_dims("gpt", 1536, 2, 16, 50257)
    lay = Layout(dp=8, micro_batch=1)
    fa1 = block_cost(shape, lay, rates, 2048, 2, True, Implementation(attention_kernel="fa1"))
    padded = rates.table.attention_tflops(2048, 128, True, "fwd", "fa1")
    flops = attention_flops(lay.micro_batch * shape.heads, 2048, 2048, 96, True, "fwd")
    assert fa1.fwd.attention == pytest.approx(flops / (padded * 96 / 128 * 1e12))


def _attention_kernels(gpu: str, *kernels: str) -> list:
    """The 1B Llama under ZeRO-3 on 8 GPUs of `gpu`, planned with each attention kernel."""
    shape, lay = PRESETS["llama3-1b"], Layout(dp=8, zero=3, micro_batch=4)
    return [evaluate(shape, lay, make_cluster(gpu, 8), 2048, 32,
                     impl=Implementation(attention_kernel=k)) for k in kernels]


def test_the_triton_kernel_is_an_implementation_option_priced_as_flashattention1():
    """`--fix attention_kernel=triton` (or fa1) slows the attention of an A100 plan by a
    published ratio to FlashAttention-2 and nothing else. No benchmark gives the 2023 Triton
    kernel's rate in numbers, so it is priced as FlashAttention 1 (`PRICED_AS`); a table that
    neither publishes nor borrows FlashAttention 1 (the measured H100 one) says so in one line."""
    shape, lay = PRESETS["llama3-1b"], Layout(dp=8, zero=3, micro_batch=4)
    fa2, tri, fa1 = _attention_kernels("a100-80g", "sdpa", "triton", "fa1")
    a, b = fa2.timing.detail["compute_s"], tri.timing.detail["compute_s"]
    assert b["gemm"] == a["gemm"] and b["elementwise"] == a["elementwise"]
    # Fig. 4(c) of the FlashAttention-2 paper at 2k: FlashAttention 1 77, FlashAttention-2 140.
    assert fa1.timing.detail["compute_s"]["attention"] == pytest.approx(
        a["attention"] * 140 / 77)
    assert b["attention"] == fa1.timing.detail["compute_s"]["attention"]
    assert "attention: triton, priced as fa1" in tri.timing.detail["rates"]
    assert parse_fix("attention_kernel=fa1") == {"attention_kernel": "fa1"}
    with pytest.raises(PlanError, match="attention_kernel=fa3 must be one of sdpa, fa2, fa1, "
                       "triton, cudnn"):
        parse_fix("attention_kernel=fa3")
    assert fa2.memory.total == tri.memory.total
    with pytest.raises(PlanError, match="h100: no 'triton' attention rows \\(priced as fa1, "
                       "which is published for .*a100-80g\\)"):
        evaluate(shape, lay, make_cluster("h100", 8, kernels=str(MEASURED_H100)), 2048, 32,
                 impl=Implementation(attention_kernel="triton"))


def test_a_tables_own_triton_rows_replace_the_flashattention1_price():
    """`PRICED_AS` stands in only while a table has no rows of the kernel itself; the Triton
    kernel keeps its own head padding (the next power of two) either way."""
    from meshloom.plan.kernel_table import PRICED_AS

    assert PRICED_AS == {"triton": "fa1"}
    fa1_rows = [{**r, "kernel": "fa1"} for r in TRITON if r.get("kernel")]
    both = parse({**TABLE, "attention": TABLE["attention"] + TRITON[2:] + fa1_rows
                  + [{**fa1_rows[0], "tflops": 35.0, "kernel": "triton"}]})
    only_fa1 = parse({**TABLE, "attention": TABLE["attention"] + TRITON[2:] + fa1_rows})
    assert both.priced_as("triton") == "triton" and only_fa1.priced_as("triton") == "fa1"
    assert only_fa1.prices("triton") and not parse(TABLE).prices("triton")
    assert only_fa1.attention_tflops(1024, 128, True, "fwd", "triton") == pytest.approx(
        only_fa1.attention_tflops(1024, 128, True, "fwd", "fa1"))
    assert both.attention_tflops(1024, 128, True, "fwd", "triton") == pytest.approx(
        200.0 * 35.0 / 175.0)
    # An 8-wide head: the Triton kernel runs it 16 wide, FlashAttention 1 32 wide.
    assert only_fa1.attention_tflops(1024, 8, True, "fwd", "triton") == pytest.approx(
        only_fa1.attention_tflops(1024, 8, True, "fwd", "fa1") * 32 / 16)


def test_no_table_prices_llm_foundrys_triton_kernel_with_another_kernels_bars():
    """The FlashAttention-2 paper's "Triton" bars are OpenAI's triton.ops kernel (its benchmark
    script imports it), not the flash_attn_triton kernel llm-foundry ran: no committed table
    holds Triton rows, and the reasons for pricing it as FlashAttention 1 are quoted."""
    for name in available():
        assert not for_gpu(name).other_attention.get("triton"), name
    quoted = (Path(__file__).resolve().parents[1] / "benchmarks" / "published"
              / "triton_attention_kernel.txt").read_text()
    for text in ("Overall Triton forward + backward is slightly slower\nthan CUDA forward + "
                 "backward.", "In our experience, `triton` is slightly faster than `flash`.",
                 "from triton.ops.flash_attention import attention as attention_triton"):
        assert text in quoted


LENDER = "a100-80g"


def _borrower(**entry) -> dict:
    """TABLE (FlashAttention-2 rows only) borrowing FlashAttention 1's ratio."""
    why = {"table": LENDER, "why": "same instructions on both GPUs", **entry}
    return {**TABLE, "attention_ratio_from": {"fa1": why}}


def test_a_table_may_borrow_a_kernels_ratio_from_a_table_that_publishes_it():
    """`attention_ratio_from`: the kernel runs at this table's FlashAttention-2 rate times its
    ratio to FlashAttention-2 in the lender's nearest series (a100-80g: Fig. 4(c), hd 64,
    causal, fwd_bwd), at the asked length; FlashAttention-2 itself does not move. The Triton
    kernel, priced as FlashAttention 1, borrows with it."""
    t = parse(_borrower())
    a = for_gpu(LENDER)
    assert t.ratio_from == {"fa1": LENDER} and t.borrowed_ratio("fa1") == LENDER
    assert t.borrowed_ratio("triton") == LENDER and t.borrowed_ratio("fa2") is None
    for seq in (512, 1024, 2048, 4096, 16384):
        ratio = (a.attention_tflops(seq, 64, True, "fwd_bwd", "fa1")
                 / a.attention_tflops(seq, 64, True, "fwd_bwd"))
        for kernel in ("fa1", "triton"):
            assert t.attention_tflops(seq, 128, True, "fwd", kernel) == pytest.approx(
                t.attention_tflops(seq, 128, True, "fwd") * ratio)
    # Fig. 4(c) at 2k: FlashAttention 1 77 against FlashAttention-2's 140.
    assert t.attention_tflops(2048, 128, True, "bwd", "fa1") == pytest.approx(
        t.attention_tflops(2048, 128, True, "bwd") * 77 / 140)
    with pytest.raises(PlanError, match="no 'cudnn' attention rows"):
        t.attention_tflops(2048, 128, True, "fwd", "cudnn")  # only what it borrows


@pytest.mark.parametrize("entry,message", [
    ({"table": "h200"}, "h200 does not publish 'fa1' rows itself"),
    ({"table": "a100-40g"}, "a100-40g does not publish 'fa1' rows itself"),
    ({"table": "nowhere"}, "no readable committed table nowhere.json"),
    ({"why": ""}, "needs 'table' and 'why'"),
])
def test_a_borrowed_ratio_names_a_lender_that_publishes_it_and_says_why(entry, message):
    """A lender must publish the kernel itself (not through `compute_from` or a borrow of its
    own), and the borrower says why the ratio carries over; any defect is one line."""
    with pytest.raises(PlanError, match=message):
        parse(_borrower(**entry))
    fa1_rows = [{**r, "kernel": "fa1"} if r.get("kernel") else r for r in TRITON]
    with pytest.raises(PlanError, match="has its own 'fa1' rows"):
        parse({**_borrower(), "attention": TABLE["attention"] + fa1_rows})
    with pytest.raises(PlanError, match="kernel 'fa3' must be one of"):
        parse({**TABLE, "attention_ratio_from": {"fa3": {"table": LENDER, "why": "x"}}})
    published = {**_borrower(), "kind": "published", "sources": {},
                 "gemm": [{**g, "source": "s"} for g in TABLE["gemm"]]}
    with pytest.raises(PlanError, match="cites a source"):  # rows first, then the borrow
        parse(published)


def test_the_h100_prices_the_older_kernels_at_their_a100_ratio_and_says_so():
    """The committed H100 table borrows FlashAttention 1's ratio from a100-80g.json with cited
    reasons (the Triton kernel's code too runs an earlier architecture's instructions on an
    H100); the H200 and the Grand Teton part inherit it through `compute_from`. A plan on it
    prices the 2023 Triton kernel as FlashAttention 1 at FlashAttention-2's H100 rate times
    that ratio, and its rates line says both."""
    h100 = for_gpu("h100")
    raw = json.loads((Path(h100.path)).read_text())
    assert set(raw["attention_ratio_from"]) == {"fa1"}
    entry = raw["attention_ratio_from"]["fa1"]
    assert entry["table"] == LENDER and "Derived, not measured" in entry["why"]
    assert "LLVM 11" in entry["why"] and "PRICED_AS" in entry["why"]
    assert all(key in raw["sources"] for key in entry["sources"])
    assert for_gpu("h200").ratio_from == for_gpu("h100-96gb").ratio_from == h100.ratio_from
    fa2, tri = _attention_kernels("h100", "fa2", "triton")
    a, b = fa2.timing.detail["compute_s"], tri.timing.detail["compute_s"]
    assert b["gemm"] == a["gemm"] and b["elementwise"] == a["elementwise"]
    assert b["attention"] == pytest.approx(a["attention"] * 140 / 77)  # Fig. 4(c) at 2k
    assert ("attention: triton, priced as fa1, at its ratio to fa2 on a100-80g"
            in tri.timing.detail["rates"])
    assert "a100-80g" not in fa2.timing.detail["rates"]


MEASURED_H100 = Path(__file__).resolve().parents[1] / "benchmarks" / "measured" / \
    "h100-2026-11-26" / "h100-kernels.json"


def test_cudnn_attention_is_priced_from_a_measured_table_that_has_it():
    """The measured H100 table holds SDPA's FlashAttention-2 and cuDNN series at the same
    points: `attention_kernel=cudnn` prices attention at their ratio, nothing else moves; the
    default, SDPA's pick, is cuDNN's on an H100 and FlashAttention-2 on an A100, whose table
    has no cuDNN rows and says so in one line when they are asked for."""
    from meshloom.plan.kernel_table import padded_head_dim

    assert [padded_head_dim(d, "cudnn") for d in (64, 80, 100, 192)] == [64, 80, 104, 192]
    table = load(MEASURED_H100)
    assert table.kind == "measured" and set(table.other_attention) == {"cudnn"}
    shape, lay = PRESETS["llama3-1b"], Layout(micro_batch=8)
    cl = make_cluster("h100", 1, kernels=str(MEASURED_H100))
    fa2 = evaluate(shape, lay, cl, 2048, 8,
                   impl=Implementation(compile=True, attention_kernel="fa2"))
    cud = evaluate(shape, lay, cl, 2048, 8,
                   impl=Implementation(compile=True, attention_kernel="cudnn"))
    a, b = fa2.timing.detail["compute_s"], cud.timing.detail["compute_s"]
    assert b["gemm"] == a["gemm"] and b["elementwise"] == a["elementwise"]
    fwd = [table.attention_tflops(2048, 64, True, "fwd", k) for k in ("fa2", "cudnn")]
    assert fwd[1] > 1.5 * fwd[0]  # measured: cuDNN's kernel is far faster on an H100
    assert b["attention"] < a["attention"]
    default = evaluate(shape, lay, cl, 2048, 8, impl=Implementation(compile=True))
    assert default.timing.step_time_s == cud.timing.step_time_s
    # The rates line names the kernel each plan priced, not SDPA's pick whatever was fixed.
    # ... and the loss it priced (compiled: the one-pass fused loss).
    loss = "; loss: fused, 6 bytes per logit"
    assert default.timing.detail["rates"].endswith("; attention: cudnn, SDPA's pick" + loss)
    assert fa2.timing.detail["rates"].endswith("; attention: fa2" + loss)
    assert cud.timing.detail["rates"].endswith("; attention: cudnn" + loss)
    unfused = evaluate(shape, lay, cl, 2048, 8, flash=False)
    assert unfused.timing.detail["rates"].endswith("; attention: unfused (batched GEMMs, "
                                                   "every score written); loss: eager, 40 "
                                                   "bytes per logit")
    megatron = evaluate(shape, lay, cl, 2048, 8,
                        impl=Implementation(compile=True, cross_entropy="megatron"))
    assert megatron.timing.detail["rates"].endswith("; loss: megatron, 52 bytes per logit")
    a100 = make_cluster("a100-80g", 1)
    assert evaluate(shape, lay, a100, 2048, 8).timing.step_time_s == evaluate(
        shape, lay, a100, 2048, 8, impl=Implementation(attention_kernel="fa2")).timing.step_time_s
    with pytest.raises(PlanError, match="a100-80g: no 'cudnn' attention rows"):
        evaluate(shape, lay, make_cluster("a100-80g", 1), 2048, 8,
                 impl=Implementation(attention_kernel="cudnn"))


def test_h100_table_attention_is_the_measured_kernels_where_nothing_was_published():
    """The committed H100 table holds the measured file's attention rows as
    benchmarks/h100_table_attention.py copies them, each citing it; short causal sequences are
    priced at their own measured rate (the one published causal point is at 8192 tokens), the
    8192 point at the mean of the two sources, and cuDNN at its measured rate."""
    assert load_benchmark("h100_table_attention").main(["--check"]) == 0
    published, measured = for_gpu("h100"), load(MEASURED_H100)
    for seq in (512, 2048, 32768):
        assert published.attention_tflops(seq, 128, True, "bwd") \
            == measured.attention_tflops(seq, 128, True, "bwd")
        assert published.attention_tflops(seq, 128, True, "fwd", "cudnn") \
            == pytest.approx(measured.attention_tflops(seq, 128, True, "fwd", "cudnn"))
    assert published.attention_tflops(512, 128, True, "bwd") < 0.4 * 287.1
    point = published.attention_tflops(8192, 128, True, "bwd")
    assert point == pytest.approx((287.1 + measured.attention_tflops(8192, 128, True, "bwd")) / 2)
    assert published.kind == "published" and published.gemm != measured.gemm


def test_the_measured_table_answers_the_validation_rows_gemms_exactly():
    """Every GEMM shape the planner prices for the H100 validation rows was measured
    (benchmarks/validation_shapes.py gave the bench its --shapes list)."""
    table = load(MEASURED_H100)
    measured = {(m, n, k) for m, n, k, _ in table.gemm}
    asked = json.loads((MEASURED_H100.parent / "h100-validation-shapes.json").read_text())
    assert len(asked) > 200 and {tuple(g) for g in asked} <= measured


def test_profile_against_plan_file_is_what_the_code_says(tmp_path):
    """benchmarks/results/planner/profile_vs_plan_llama1b.json (docs/kernel-tables.md) is the
    committed profile set against what the planner says now."""
    profile_vs_plan = load_benchmark("profile_vs_plan")
    committed = json.loads(profile_vs_plan.DEFAULT_OUT.read_text())
    got = profile_vs_plan.main(["--profile", str(MEASURED_H100.parent / "profile_kernels.json"),
                                "--kernels", str(MEASURED_H100), "--out",
                                str(tmp_path / "p.json")])
    assert got["rows"] == committed["rows"]
    gemm = next(r for r in got["rows"] if r["class"] == "gemm")
    assert abs(gemm["ratio"] - 1) < 0.02  # the GEMMs ran at the measured table's rates


def test_attention_flops_follow_flashattention():
    assert attention_flops(2, 1024, 1024, 128, False, "fwd") == 4 * 2 * 1024 * 1024 * 128
    assert attention_flops(2, 1024, 1024, 128, True, "fwd") == 2 * 2 * 1024 * 1024 * 128
    assert attention_flops(1, 8, 8, 4, False, "bwd") == 2.5 * 4 * 8 * 8 * 4


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.pop("gemm"), "missing key 'gemm'"),
    (lambda d: d.update(kind="fitted"), "kind="),
    (lambda d: d["gemm"][0].update(tflops=-1), "tflops > 0"),
    (lambda d: d["attention"][0].update(direction="sideways"), "direction one of"),
    (lambda d: d.update(kind="published"), "cites a source"),
    (lambda d: d["attention"].append({**TRITON[0], "kernel": "cutlass"}), "kernel='cutlass'"),
    (lambda d: d["attention"].append({**TRITON[0], "head_dim": 64}),
     "need FlashAttention-2 rows of the same head width"),
    (lambda d: d.update(hbm_gbps={"value": "fast"}), "hbm_gbps"),
    (lambda d: d.update(optimizer_gbps={"value": -1.0}), "optimizer_gbps"),
    (lambda d: d.update(compute_from="h100"), "both compute_from and its own gemm"),
    (lambda d: (d.pop("gemm"), d.pop("attention"), d.update(compute_from="h1000")),
     "no readable committed table h1000.json"),
    (lambda d: (d.pop("gemm"), d.pop("attention"), d.update(compute_from="h200")),
     "takes its compute from another table itself"),
])
def test_a_bad_table_is_one_line_naming_the_problem(tmp_path, edit, needle):
    _refused_in_one_line(tmp_path, json.loads(json.dumps(TABLE)), edit, needle)


def _refused_in_one_line(tmp_path, raw: dict, edit, needle: str) -> None:
    """The table `edit` breaks is refused by the loader in one line naming its file."""
    edit(raw)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError) as err:
        load(path)
    assert needle in str(err.value) and "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_table_is_parsed_once_and_read_afresh_when_its_file_changes(tmp_path):
    """A search prices every evaluation with its table, so the parsed table is kept; it is
    kept by the file's bytes, so a table rewritten in place (a new measurement) is read anew
    and answers with its own rates, not the old table's remembered ones."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TABLE))
    first = load(path)
    assert load(path) is first and first.gemm_tflops(4096, 4096, 4096) == 400.0
    faster = json.loads(json.dumps(TABLE))
    faster["gemm"][1]["tflops"] = 500.0
    path.write_text(json.dumps(faster))
    again = load(path)
    assert again is not first and again.gemm_tflops(4096, 4096, 4096) == 500.0
    cluster = make_cluster("h100", 8, kernels=str(path))
    assert rates_for(cluster).table is again


def test_a_memory_bandwidth_override_scales_the_tables_achieved_rates():
    """`--hbm-gbps` (a GPU variant, or a GPU with no preset of its own) scales what the
    committed table achieved, streaming and the optimizer's kernel alike, by the override
    over the preset's datasheet figure; the GEMM rates stay."""
    base = rates_for(make_cluster("h100", 8))
    faster = rates_for(make_cluster("h100", 8, hbm_gbps=2 * 3350.0))
    assert faster.hbm_gbps == pytest.approx(2 * base.hbm_gbps)
    assert faster.optimizer_gbps == pytest.approx(2 * base.optimizer_gbps)
    assert faster.table is base.table and faster.scale == base.scale
    nbytes = 8e9
    assert faster.stream(nbytes) == pytest.approx(base.stream(nbytes) / 2)


def test_committed_tables_load_and_every_preset_gpu_with_one_is_priced_from_it():
    for name in available():
        table = for_gpu(name)
        assert table is not None and table.gemm
        rates = rates_for(make_cluster(name, 8)) if name in _gpus() else None
        if rates is not None:
            assert rates.table is table and "kernel table" in rates.source


def _gpus():
    from meshloom.plan.hardware import GPUS
    return GPUS


def test_block_gemms_are_the_models_linear_layers():
    shape = PRESETS["llama3-8b"]
    fwd = block_gemms(shape, 4096, 2)
    assert sum(g.m * g.n * g.k for g in fwd) == 4096 * shape.layer_matmul_params // 2
    names = [g.name for g in fwd]
    assert names == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    wq = fwd[0]
    dgrad, wgrad = wq.backward()
    assert (dgrad.m, dgrad.n, dgrad.k) == (4096, shape.hidden, shape.q_dim // 2)
    assert (wgrad.m, wgrad.n, wgrad.k) == (shape.hidden, shape.q_dim // 2, 4096)
    assert len(all_gemms(shape, 4096, 2)) == 3 * (len(fwd) + 1)  # + the head


def _rates(launch_us=0.0, hbm=2000.0, optimizer_gbps=0.0) -> Rates:
    raw = json.loads(json.dumps(TABLE))
    raw["launch_us"] = {"value": launch_us} if launch_us else None
    return Rates(parse(raw), 989.0, hbm, launch_us * 1e-6, 1.0, "test", optimizer_gbps)


def test_backward_costs_its_two_gemms_and_recompute_adds_the_forward():
    shape, rates = PRESETS["llama3-1b"], _rates()
    lay = Layout(micro_batch=2)
    none = block_cost(shape, lay, rates, 2048, 2, True, Implementation())
    full = block_cost(shape, replace(lay, recompute="full"), rates, 2048, 2, True,
                      Implementation())
    sel = block_cost(shape, replace(lay, recompute="selective"), rates, 2048, 2, True,
                     Implementation())
    gemms = block_gemms(shape, 4096, 1)
    want = sum(rates.gemm(b) for g in gemms for b in g.backward())
    assert none.bwd.gemm == pytest.approx(want)
    assert full.bwd.total == pytest.approx(none.bwd.total + none.fwd.total)
    # meshloom's policy reruns everything but the GEMMs; Korthikanti's the attention core only
    assert sel.bwd.total == pytest.approx(none.bwd.total + none.fwd.attention
                                          + none.fwd.elementwise)
    core = block_cost(shape, replace(lay, recompute="selective"), rates, 2048, 2, True,
                      Implementation(selective_elementwise=False))
    assert core.bwd.total == pytest.approx(none.bwd.total + none.fwd.attention)


def test_torchtitan_op_sac_reruns_every_second_matmul_and_keeps_attention():
    """torchtitan's per-op policy (`op_sac`): a Llama block keeps wq, wv, w1, w2 (the 1st, 3rd,
    5th and 7th matmuls it runs) and attention's outputs, reruns wk, wo, w3 and the elementwise
    ops; memory is its input, those outputs and attention's output and log-sum-exp."""
    from meshloom.plan.memory import layer_activation_bytes
    shape, rates = PRESETS["llama3-8b"], _rates()
    lay = Layout(micro_batch=1, recompute="selective")
    impl = Implementation(op_sac=True, meshloom_block=False)
    none = block_cost(shape, replace(lay, recompute="none"), rates, 4096, 2, True, impl)
    op = block_cost(shape, lay, rates, 4096, 2, True, impl)
    g = {x.name: x for x in block_gemms(shape, 4096, 1)}
    rerun = sum(rates.gemm(g[k]) for k in ("wk", "wo", "w3"))
    assert op.bwd.gemm == pytest.approx(none.bwd.gemm + rerun)
    assert op.bwd.attention == none.bwd.attention  # the kernel's outputs were kept
    assert op.bwd.elementwise == pytest.approx(none.bwd.elementwise + none.fwd.elementwise)
    h, q, kv, f, a = 4096, 4096, 1024, 14336, 32
    want = 4096 * ((h + q + kv + f + h + q) * 2 + 4 * a)
    assert layer_activation_bytes(shape, 4096, 1, lay, "bf16", impl=impl) == want
    korthikanti = layer_activation_bytes(shape, 4096, 1, lay, "bf16",
                                         impl=Implementation(meshloom_block=False))
    assert want < 0.6 * korthikanti


def test_fused_elementwise_and_loss_move_fewer_bytes_than_eager():
    shape, rates = PRESETS["llama3-1b"], _rates()
    lay = Layout(micro_batch=8)
    eager = block_cost(shape, lay, rates, 2048, 2, True, Implementation(compile=False))
    fused = block_cost(shape, lay, rates, 2048, 2, True, Implementation(compile=True))
    assert fused.fwd.gemm == eager.fwd.gemm and fused.fwd.attention == eager.fwd.attention
    assert eager.fwd.elementwise > 3 * fused.fwd.elementwise
    ce_e = head_cost(shape, lay, rates, 2048, Implementation(compile=False))
    ce_f = head_cost(shape, lay, rates, 2048, Implementation(compile=True))
    logits = 8 * 2048 * shape.vocab
    extra = (sum(ce_e) - sum(ce_f))
    fused_b, eager_b = (sum(compute_mod.CE_BYTES_PER_LOGIT[k]) for k in ("fused", "eager"))
    assert extra == pytest.approx((eager_b - fused_b) * logits / 2000e9)


def test_megatrons_unfused_vocab_parallel_loss_is_priced_pass_by_pass():
    """Megatron's `vocab_parallel_cross_entropy` on a tp = 4 rank: an fp32 copy of its 1/4 of
    the logits (read 2, write 4), max (4), subtract (8), exp (8), sum (4), divide (8) forward;
    backward a multiply in place (8) and the down-cast (6), against the fused loss's 2 and 4;
    Megatron-Core's jit-fused version of the same steps in three passes and one.
    `cross_entropy` picks it whatever `compile` says; `auto` is meshloom's own loss, which
    under tp > 1 is its vocabulary-parallel one whatever `compile` says: Megatron's forward, a
    backward writing the bf16 gradient from the softmax (read 4, write 2)."""
    shape, rates = PRESETS["llama3-8b"], _rates()  # launch gaps off: bytes alone
    lay = Layout(tp=4, sp=True, micro_batch=2)
    logits = 2 * 4096 * shape.vocab / 4

    def cost(**impl):
        return head_cost(shape, lay, rates, 4096, Implementation(**impl))
    fused = cost(compile=True, cross_entropy="fused")
    megatron = cost(compile=True, cross_entropy="megatron")
    forward = 2 + 4 + 4 + 8 + 8 + 4 + 8
    assert megatron[0] - fused[0] == pytest.approx((forward - 2) * logits / 2000e9)
    assert megatron[1] - fused[1] == pytest.approx((8 + 6 - 4) * logits / 2000e9)
    # with cross_entropy_loss_fusion: up-cast with max (6), sub-exp-sum (8), divide (8); the
    # scaling with its down-cast (6)
    mfused = cost(compile=True, cross_entropy="megatron_fused")
    assert mfused[0] - fused[0] == pytest.approx((6 + 8 + 8 - 2) * logits / 2000e9)
    assert mfused[1] - fused[1] == pytest.approx((6 - 4) * logits / 2000e9)
    # apex's / flash-attn 1's xentropy kernel: two reads forward, a read and a write backward
    xent = cost(compile=False, cross_entropy="xentropy")
    assert xent[0] - fused[0] == pytest.approx((4 - 2) * logits / 2000e9)
    assert xent[1] == pytest.approx(fused[1])
    assert cost(compile=False, cross_entropy="megatron") == megatron
    assert cost(compile=False, cross_entropy="fused") == fused
    assert cost(compile=True, cross_entropy="eager") == cost(compile=False, cross_entropy="eager")
    # F.cross_entropy over vocabulary-split logits runs PyTorch's loss_parallel handlers: 38
    # bytes a logit forward as Megatron's, 38 backward (zeros, exp, add, multiply, down-cast)
    titan = cost(compile=False, cross_entropy="eager")
    assert titan[0] == pytest.approx(megatron[0])
    assert titan[1] - fused[1] == pytest.approx((38 - 4) * logits / 2000e9)
    own = cost(compile=True)
    assert own == cost(compile=False) == cost(compile=True, cross_entropy="auto")
    assert own[0] == pytest.approx(megatron[0])
    assert own[1] - fused[1] == pytest.approx((6 - 4) * logits / 2000e9)
    # six kernels forward, two backward: with a launch gap longer than a pass, that is the cost
    tiny = from_dims("llama", 64, 2, 4, 128)
    slow = head_cost(tiny, Layout(micro_batch=1), _rates(launch_us=50.0), 16,
                     Implementation(compile=True, cross_entropy="megatron"))
    gemm_only = head_cost(tiny, Layout(micro_batch=1), _rates(launch_us=50.0), 16,
                          Implementation(compile=True))
    assert slow[0] - gemm_only[0] == pytest.approx((6 - 1) * 50e-6)
    assert slow[1] - gemm_only[1] == pytest.approx((2 - 1) * 50e-6)
    # memory: Megatron's losses keep an fp32 copy beside the bf16 logits (6 bytes per logit);
    # a one-kernel loss holds the logits and their bf16 gradient (4); F.cross_entropy over
    # vocabulary-split logits is PyTorch's loss_parallel, five fp32 tensors at its backward's
    # peak (20; tests/test_plan_loss_memory.py)
    from meshloom.plan.memory import logits_bytes
    other = {"meshloom_block": False}
    for kind, per_logit in (("megatron", 6), ("megatron_fused", 6), ("eager", 20),
                            ("xentropy", 4), ("fused", 4)):
        impl = Implementation(cross_entropy=kind, **other)
        assert logits_bytes(shape, 4096, 2, lay, "bf16", impl) == logits * per_logit, kind
    assert parse_fix("cross_entropy=megatron") == {"cross_entropy": "megatron"}
    assert split_fix({"cross_entropy": "megatron"})[1].short() == "cross_entropy=megatron"
    with pytest.raises(PlanError, match="cross_entropy=apex must be one of auto, fused, "
                                        "eager, eager_bf16, xentropy, megatron, megatron_fused"):
        parse_fix("cross_entropy=apex")


def test_te_flash_backends_layout_copies_are_priced_with_the_attention_core():
    """`qkv_transpose` (TransformerEngine's FlashAttention backend under Megatron's
    sequence-first tensors): q, k, v and the output each copied once a pass, read and written,
    their gradients once backward; one kernel for interleaved multi-head q, k, v of width 128,
    one per tensor else. They belong to the attention core, which selective recompute reruns."""
    rates = rates_for(make_cluster("h100", 8))
    for name, kernels in (("llama3-8b", 4), ("megatron-145.6b", 2)):
        shape = PRESETS[name]
        lay = Layout(tp=2, micro_batch=1, recompute="none")
        tokens, e = 4096, 2
        nbytes = tokens * 2 * (2 * shape.q_dim + 2 * shape.kv_dim) / 2 * e
        want = rates.stream(nbytes, kernels)
        base = block_cost(shape, lay, rates, tokens, e, True, Implementation(compile=True))
        got = block_cost(shape, lay, rates, tokens, e, True,
                         Implementation(compile=True, qkv_transpose=True))
        assert got.fwd.elementwise - base.fwd.elementwise == pytest.approx(want, rel=1e-12)
        assert got.bwd.elementwise - base.bwd.elementwise == pytest.approx(want, rel=1e-12)
        assert got.attention_fwd.elementwise == pytest.approx(want, rel=1e-12)
        sel = replace(lay, recompute="selective")
        base_s = block_cost(shape, sel, rates, tokens, e, True,
                            Implementation(compile=True, selective_elementwise=False))
        got_s = block_cost(shape, sel, rates, tokens, e, True,
                           Implementation(compile=True, selective_elementwise=False,
                                          qkv_transpose=True))
        assert got_s.bwd.elementwise - base_s.bwd.elementwise == pytest.approx(2 * want,
                                                                                rel=1e-12)
    assert parse_fix("qkv_transpose=true") == {"qkv_transpose": True}


def test_a_kernel_never_takes_less_than_its_launch_gap():
    shape = from_dims("llama", 64, 2, 4, 128)  # tiny: every kernel shorter than 5 us
    lay = Layout(micro_batch=1)
    slow = block_cost(shape, lay, _rates(launch_us=5.0), 16, 2, True, Implementation())
    fast = block_cost(shape, lay, _rates(), 16, 2, True, Implementation())
    assert slow.fwd.gemm == pytest.approx(7 * 5e-6)
    assert slow.fwd.total > 10 * fast.fwd.total


def test_autocast_weight_casts_are_priced_where_meshloom_keeps_fp32_weights():
    """An unsharded meshloom layout computing in bf16 casts every weight (fp32 -> bf16, 6
    bytes) for the forward and again for the backward; ZeRO's bf16 working copies, another
    trainer's bf16 weights and an fp32 run cast nothing."""
    shape, cl = PRESETS["llama3-1b"], make_cluster("h100", 2)
    rates = rates_for(cl)
    weights = sum(g.n * g.k for g in block_gemms(shape, 2048, 1))
    lay = Layout(dp=2, micro_batch=1)

    def elementwise(lay, e=2, **impl):
        c = block_cost(shape, lay, rates, 2048, e, True, Implementation(**impl))
        return c.fwd.elementwise, c.bwd.elementwise
    f, b = elementwise(lay)
    f0, b0 = elementwise(lay, meshloom_block=False)
    cast = rates.stream(weights * 6, 7)
    assert f - f0 == pytest.approx(cast) and b - b0 == pytest.approx(cast)
    assert elementwise(Layout(dp=2, zero=1)) == (f0, b0)
    f32, f32_other = elementwise(lay, e=4), elementwise(lay, e=4, meshloom_block=False)
    assert f32 == f32_other
    g = all_gemms(shape, 2048, 1)[-3]  # the head's forward
    head = head_cost(shape, lay, rates, 2048, Implementation(), 2)
    other = head_cost(shape, lay, rates, 2048, Implementation(meshloom_block=False), 2)
    assert head[0] - other[0] == pytest.approx(rates.stream(g.n * g.k * 6))


def test_optimizer_and_clipping_traffic():
    rates = _rates()
    assert compute_mod.optimizer_seconds(1e9, 1e9, rates) == pytest.approx(44e9 / 2000e9)
    assert compute_mod.optimizer_seconds(1e9, 0, rates) == pytest.approx(28e9 / 2000e9)
    # the clip in the fused kernel writes the gradient back (4) instead of a pass (8)
    assert compute_mod.optimizer_seconds(1e9, 1e9, rates, clip_in_optimizer=True) == \
        pytest.approx(40e9 / 2000e9)
    assert compute_mod.optimizer_seconds(1e9, 1e9, rates, clip_in_optimizer=True,
                                         zeroed=False) == pytest.approx(36e9 / 2000e9)
    assert compute_mod.accumulate_seconds(1e9, 3, rates) == pytest.approx(36e9 / 2000e9)
    assert compute_mod.accumulate_seconds(1e9, 0, rates) == 0.0


def test_an_unfused_adamw_makes_eight_passes_over_its_state():
    """`optimizer_impl=foreach|for_loop` (torchtitan's multi-tensor AdamW, TinyLlama's and
    Composer's loops): 80 bytes a parameter at the copy rate, not the fused kernel's 28 at the
    optimizer rate, and the clip is a pass of its own even where the loop asks for it in the
    kernel. Through a plan the step grows by exactly that, nothing else moves; a wrong value is
    a one-line error."""
    rates = _rates(hbm=2000.0, optimizer_gbps=1000.0)
    for kind in ("foreach", "for_loop"):
        assert compute_mod.optimizer_seconds(1e9, 1e9, rates, optimizer_impl=kind) == \
            pytest.approx((80e9 + 16e9) / 2000e9)
        assert compute_mod.optimizer_seconds(1e9, 1e9, rates, clip_in_optimizer=True,
                                             optimizer_impl=kind) == \
            pytest.approx((80e9 + 16e9) / 2000e9)
    assert parse_fix("optimizer_impl=for_loop") == {"optimizer_impl": "for_loop"}
    with pytest.raises(PlanError, match="optimizer_impl=adam must be one of fused, foreach, "
                       "for_loop"):
        parse_fix("optimizer_impl=adam")
    shape, lay = PRESETS["llama3-1b"], Layout(dp=8, zero=3, micro_batch=4)
    cl = make_cluster("h100", 8)
    fused = evaluate(shape, lay, cl, 2048, 32)
    loop = evaluate(shape, lay, cl, 2048, 32, impl=Implementation(optimizer_impl="for_loop"))
    r = rates_for(cl)
    dense, experts = rank_param_split(shape, lay, 0, shape.layers)
    shard = (dense + experts) / 8
    # fused: 28 + 4 (the clip written back) at the optimizer rate, norm 4 + zeroing 4 at the
    # copy rate; the loop: 80 + norm 4 + clip pass 8 + zeroing 4, all at the copy rate.
    extra = shard * 88 / (r.hbm_gbps * 1e9) - shard * 32 / (r.optimizer_gbps * 1e9)
    assert loop.timing.optimizer - fused.timing.optimizer == pytest.approx(extra, rel=1e-6)
    assert loop.timing.compute == fused.timing.compute
    assert loop.memory.total == fused.memory.total


def test_gradients_cross_the_data_parallel_group_in_the_reduce_dtype():
    """meshloom reduces gradients in fp32 by default (`parallel.reduce_dtype`), so a bf16
    ZeRO-3 plan's reduce-scatters carry 4 bytes a parameter, one per unit a micro-batch, and
    `grad_reduce_dtype=bf16` halves them; the parameter gathers stay bf16 either way."""
    shape, lay = PRESETS["llama3-1b"], Layout(dp=8, zero=3, micro_batch=2)
    cl = make_cluster("h100", 8)
    m, units = 32 // (8 * lay.micro_batch), shape.layers
    dense, experts = rank_param_split(shape, lay, 0, shape.layers)
    ops = {}
    for dtype, wire in (("fp32", 4), ("bf16", 2)):
        plan = evaluate(shape, lay, cl, 2048, 32, impl=Implementation(grad_reduce_dtype=dtype))
        ops[dtype] = plan.timing.detail["comm_s"]["dp"]["ops"]
        one = cl.collective("reduce_scatter", (dense + experts) * wire / units, 8, 1, "auto")
        assert ops[dtype]["reduce_scatter"] == pytest.approx(m * units * one.seconds)
    assert ops["fp32"]["all_gather"] == ops["bf16"]["all_gather"]
    assert ops["fp32"]["reduce_scatter"] > ops["bf16"]["reduce_scatter"]
    assert Implementation().grad_reduce_dtype == "fp32"
    with pytest.raises(PlanError, match="grad_reduce_dtype=fp16 must be one of fp32, bf16"):
        parse_fix("grad_reduce_dtype=fp16")


def test_fsdp2_copies_every_gather_out_into_the_parameters():
    """`fsdp_copy_out` (FSDP2): each ZeRO-3 gather, two a micro-batch of every block and one
    of what lies outside them (`fsdp_root`), is read and written once more at the copy rate on
    the compute stream, exposed in full; nothing else moves, and a layout without ZeRO-3
    gathers is unaffected."""
    shape = PRESETS["llama3-1b"]
    cl = make_cluster("h100", 8)
    r = rates_for(cl)
    for lay, copies in ((Layout(dp=8, zero=3, micro_batch=2), True),
                        (Layout(dp=8, zero=1, micro_batch=2), False)):
        # FSDP2 regathers every unit each micro-batch (no `fsdp_carry`; carrying copies out
        # less, tests/test_plan_fsdp_carry.py)
        views = evaluate(shape, lay, cl, 2048, 32, impl=Implementation(fsdp_carry=False))
        fsdp2 = evaluate(shape, lay, cl, 2048, 32,
                         impl=Implementation(fsdp_copy_out=True, fsdp_carry=False))
        ops = fsdp2.timing.detail["comm_s"]["dp"]["ops"]
        if not copies:
            assert "all_gather_copy_out" not in ops
            assert fsdp2.timing.step_time_s == views.timing.step_time_s
            continue
        dense, experts = rank_param_split(shape, lay, 0, shape.layers)
        m = 32 // (8 * lay.micro_batch)
        gathered = 2 * (dense + experts) - outer_params(shape, lay, 0)
        expected = m * 2 * gathered * 2 / (r.hbm_gbps * 1e9)
        assert ops["all_gather_copy_out"] == pytest.approx(expected, rel=1e-9)
        assert fsdp2.timing.step_time_s - views.timing.step_time_s == pytest.approx(expected)
        assert fsdp2.timing.compute == views.timing.compute
    assert parse_fix("fsdp_copy_out=true") == {"fsdp_copy_out": True}


def test_the_adamw_kernel_runs_at_the_tables_optimizer_rate():
    """A table's measured AdamW rate prices the optimizer kernel's 28 bytes per parameter and
    the clip it carries (4); the norm, a separate clip pass and the zeroing stream at the copy
    rate. Without one the kernel streams at the copy rate too."""
    rates = _rates(hbm=2000.0, optimizer_gbps=1000.0)
    assert compute_mod.optimizer_seconds(1e9, 1e9, rates, clip_in_optimizer=True) == \
        pytest.approx(32e9 / 1000e9 + 8e9 / 2000e9)
    assert compute_mod.optimizer_seconds(1e9, 1e9, rates) == \
        pytest.approx(28e9 / 1000e9 + 16e9 / 2000e9)
    assert _rates(hbm=2000.0).optimizer_gbps == 2000.0
    raw = json.loads(json.dumps(TABLE))
    raw["optimizer_gbps"] = {"value": 1234.0, "what": "test"}
    assert parse(raw).optimizer_gbps == 1234.0 and parse(TABLE).optimizer_gbps is None
    measured = load(MEASURED_H100)  # the H100 table's rate: step_overheads.json's AdamW step
    overheads = json.loads((MEASURED_H100.parent / "step_overheads.json").read_text())
    assert measured.optimizer_gbps == pytest.approx(
        28 * overheads["parameters"] / overheads["rows"]["adamw_fused_step_ms"] / 1e6, rel=1e-4)
    cl = make_cluster("h100", 1, kernels=str(MEASURED_H100))
    assert rates_for(cl).optimizer_gbps == measured.optimizer_gbps < rates_for(cl).hbm_gbps


def test_rope_and_the_kv_copies_are_counted_as_they_run():
    """A fused block reads and writes q and k once for RoPE; under GQA a block that copies K
    and V out to every head (meshloom's, torchtitan's) reads 2kv and writes 2q more, forward,
    and launches two more kernels; a GPT block with a position table, or with ALiBi, has no
    rotary pass."""
    from meshloom.plan.step_kernels import block_kernels, elementwise_bytes_per_token
    shape = PRESETS["llama3-1b"]
    h, q, kv, f = shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn_hidden
    assert kv < q  # grouped-query attention
    native = elementwise_bytes_per_token(shape, 1, False, 2, "fused", expand_kv=False)
    assert native == (4 * h + 6 * h + 3 * f + 2 * (q + kv)) * 2
    for impl in ("fused", "eager"):
        copied = elementwise_bytes_per_token(shape, 1, False, 2, impl, expand_kv=True)
        kept = elementwise_bytes_per_token(shape, 1, False, 2, impl, expand_kv=False)
        assert copied - kept == 2 * (q + kv) * 2
        assert block_kernels(shape, impl, True, True) - block_kernels(shape, impl, True, False) \
            == 2
    mha = replace(shape, kv_heads=shape.heads)
    assert elementwise_bytes_per_token(mha, 1, False, 2, "fused", expand_kv=True) == \
        elementwise_bytes_per_token(mha, 1, False, 2, "fused", expand_kv=False)
    learned = from_dims("gpt", 2048, 2, 16, 50304)
    rotary = from_dims("gpt", 2048, 2, 16, 50304, positions=0)
    alibi = from_dims("gpt", 2048, 2, 16, 50304, positions=0, rotary=False)
    assert learned.has_rope is alibi.has_rope is False and rotary.has_rope
    for impl in ("fused", "eager"):
        base = elementwise_bytes_per_token(learned, 1, False, 2, impl)
        assert elementwise_bytes_per_token(alibi, 1, False, 2, impl) == base
        assert elementwise_bytes_per_token(rotary, 1, False, 2, impl) == base + 2 * 4096 * 2
    with pytest.raises(PlanError, match="rotary=False does not fit positions=0"):
        from_dims("llama", 2048, 2, 16, 32000, rotary=False)


def test_a_complex_rope_costs_the_same_compiled_or_not():
    """`rope_complex` (torchtitan's Llama): cast, complex multiply and cast back, 20 bytes and
    3 kernels per element of q and k, eager or compiled (Inductor leaves complex operators to
    their eager kernels), in place of the fused pass's 4 bytes and 1 kernel or the real eager
    rotation's 48 bytes and 20 kernels; a model without RoPE is unaffected. Through a plan
    only the elementwise time moves."""
    from meshloom.plan.step_kernels import block_kernels, elementwise_bytes_per_token
    shape = PRESETS["llama3-1b"]
    q, kv = shape.q_dim, shape.kv_dim
    for impl, real, kernels in (("fused", 2 * 2, 1), ("eager", 48, 20)):
        plain = elementwise_bytes_per_token(shape, 1, False, 2, impl)
        cplx = elementwise_bytes_per_token(shape, 1, False, 2, impl, rope_complex=True)
        assert cplx - plain == (20 - real) * (q + kv)
        assert block_kernels(shape, impl, True, rope_complex=True) \
            - block_kernels(shape, impl, True) == 6 - kernels
    learned = from_dims("gpt", 2048, 2, 16, 50304)
    assert elementwise_bytes_per_token(learned, 1, False, 2, "eager", rope_complex=True) == \
        elementwise_bytes_per_token(learned, 1, False, 2, "eager")
    lay, cl = Layout(dp=8, zero=3, micro_batch=2), make_cluster("h100", 8)
    real = evaluate(shape, lay, cl, 2048, 32, impl=Implementation(compile=True))
    cplx = evaluate(shape, lay, cl, 2048, 32,
                    impl=Implementation(compile=True, rope_complex=True))
    a, b = real.timing.detail["compute_s"], cplx.timing.detail["compute_s"]
    assert b["elementwise"] > a["elementwise"]
    assert (b["gemm"], b["attention"]) == (a["gemm"], a["attention"])
    assert parse_fix("rope_complex=true") == {"rope_complex": True}
    with pytest.raises(PlanError, match="rotary=True does not fit positions=2048"):
        from_dims("gpt", 2048, 2, 16, 50304, rotary=True)


def test_a_tied_token_tables_two_gradients_are_summed_each_micro_batch():
    """The head's and the embedding's gradients of one tied table are summed before they are
    accumulated: read both, write one, at the parameter's dtype (fp32 for meshloom's unsharded
    layouts, bf16 working parameters under ZeRO); not when pipeline stages hold the two, nor
    when the weight-gradient GEMM adds into the kept gradient itself."""
    shape, rates = PRESETS["llama3-1b"], _rates()
    assert shape.tied
    untied = replace(shape, tied=False)

    def extra(lay, impl=MESHLOOM, e=2):
        return head_cost(shape, lay, rates, 2048, impl, e)[1] - \
            head_cost(untied, lay, rates, 2048, impl, e)[1]
    table = shape.vocab * shape.hidden
    assert extra(Layout(micro_batch=1)) == pytest.approx(rates.stream(12 * table, 1))
    assert extra(Layout(dp=2, zero=1)) == pytest.approx(rates.stream(6 * table, 1))
    assert extra(Layout(tp=2)) == pytest.approx(rates.stream(6 * table, 1))
    assert extra(Layout(micro_batch=1), Implementation(meshloom_block=False)) == \
        pytest.approx(rates.stream(6 * table, 1))
    assert extra(Layout(pp=2)) == 0.0
    assert extra(Layout(), Implementation(fused_grad_accumulation=True)) == 0.0
    assert head_cost(shape, Layout(), rates, 2048, Implementation(), 2)[0] == \
        head_cost(untied, Layout(), rates, 2048, Implementation(), 2)[0]  # backward only


def test_the_token_table_lookup_is_priced_pass_by_pass():
    """The lookup on the first stage: forward the gather reads and writes the micro-batch's rows,
    zeroing the out-of-slice ones over tp (read, write) and adding a position table's (read,
    write); backward the table's gradient is zero-filled whole, then 4 passes over the rows
    (sorted rows read, partial sums written and read, scattered), the batch's sum into a
    position table's gradient (1), and Megatron's hook adding the table's gradient into the fp32
    main gradient (read e, read and write 4) where the GEMMs fuse their own adds."""
    rates = _rates()  # launch gaps off: bytes alone
    shape = PRESETS["llama3-8b"]
    h, vocab, tokens = shape.hidden, shape.vocab, 2 * 4096

    def cost(lay, impl=MESHLOOM, model=shape):
        return compute_mod.embedding_cost(model, lay, rates, 4096, impl, 2)
    gb = 2000e9
    # meshloom on one GPU: the fp32 masters are the table (4 bytes), no tp, no position table
    f, b = cost(Layout(micro_batch=2))
    assert f == pytest.approx(2 * tokens * h * 4 / gb)
    assert b == pytest.approx((vocab * h * 4 + 4 * tokens * h * 4) / gb)
    # bf16 working copies (ZeRO), tp = 4: the out-of-slice rows zeroed; 1/4 of the table
    f, b = cost(Layout(tp=4, dp=2, zero=1, micro_batch=2))
    assert f == pytest.approx((2 + 2) * tokens * h * 2 / gb)
    assert b == pytest.approx((vocab / 4 * h * 2 + 4 * tokens * h * 2) / gb)
    # Megatron: the hook's add into the fp32 main gradient, every micro-batch
    megatron = Implementation(meshloom_block=False, fused_grad_accumulation=True)
    f2, b2 = cost(Layout(tp=4, dp=2, zero=1, micro_batch=2), megatron)
    assert f2 == pytest.approx(f)
    assert b2 - b == pytest.approx(vocab / 4 * h * (2 + 4 + 4) / gb)
    # a learned position table: its rows added forward, summed over the batch backward
    gpt = PRESETS["gpt2-xl"]
    assert gpt.positions
    f3, b3 = cost(Layout(dp=2, zero=1, micro_batch=2), MESHLOOM, gpt)
    rows = tokens * gpt.hidden * 2
    assert f3 == pytest.approx((2 + 2) * rows / gb)
    assert b3 == pytest.approx((gpt.vocab * gpt.hidden * 2 + (4 + 1) * rows) / gb)
    # its kernels: one gather forward (two more over tp), fill, partial sums and scatter back
    tiny = from_dims("llama", 64, 2, 4, 128)
    slow = compute_mod.embedding_cost(tiny, Layout(tp=2, micro_batch=1), _rates(launch_us=50.0),
                                      16, megatron, 2)
    assert slow == pytest.approx((2 * 50e-6, 4 * 50e-6))


def test_the_lookup_lands_on_the_first_stage_and_the_ends_collectives_on_theirs():
    """The step carries the lookup on pipeline rank 0 (`compute_s["embedding"]` when that rank
    is the busiest) and one all-reduce's worth of tp collectives at each end per micro-batch:
    with SP four calls (the lookup's reduce-scatter and its all-gather back, the head's
    all-gather and its gradient's reduce-scatter), without it two all-reduces. Megatron-style
    overlap hides the head's backward one behind its weight-gradient GEMM."""
    shape, cluster = PRESETS["llama3-8b"], make_cluster("h100", 8)
    m, layers = 4, shape.layers

    def run(lay, impl=MESHLOOM):
        return evaluate(shape, lay, cluster, 4096, m * lay.micro_batch * lay.dp,
                        impl=impl).timing
    t = run(Layout(tp=4, dp=2, zero=1, sp=True, micro_batch=1))
    tp = t.detail["comm_s"]["tp"]
    one = tp["ops"]["collectives"] / (m * layers * 4)  # 4 all-reduces' worth per block pass
    assert tp["ops"]["embedding_and_head"] == pytest.approx(m * 2 * one)
    assert tp["calls"]["embedding_and_head"]["calls"] == m * 4
    # meshloom hides no tp collective: the ends wait in full
    assert tp["exposed"] == pytest.approx(tp["ops"]["collectives"]
                                          + tp["ops"]["embedding_and_head"])
    emb = compute_mod.embedding_cost(shape, Layout(tp=4, dp=2, zero=1, sp=True, micro_batch=1),
                                     rates_for(cluster), 4096, MESHLOOM, 2)
    assert t.detail["compute_s"]["embedding"] == pytest.approx(m * sum(emb))
    assert sum(t.detail["compute_s"].values()) == pytest.approx(t.compute, rel=1e-9)
    t2 = run(Layout(tp=4, dp=2, zero=1, sp=False, micro_batch=1))
    assert t2.detail["comm_s"]["tp"]["calls"]["embedding_and_head"]["calls"] == m * 2
    # under tp_overlap the head's backward collective runs beside its weight-gradient GEMM
    over = run(Layout(tp=4, dp=2, zero=1, sp=True, micro_batch=1),
               Implementation(tp_overlap=True, meshloom_block=False))
    otp = over.detail["comm_s"]["tp"]
    assert otp["ops"]["embedding_and_head"] == pytest.approx(tp["ops"]["embedding_and_head"])
    assert otp["hidden"] > 0
    # without tp, no ends' collectives; with two stages the lookup sits on rank 0 and the head
    # on rank 1: the busiest rank's breakdown has one of them and still sums to its compute
    assert "embedding_and_head" not in run(Layout(dp=8, zero=1)).detail["comm_s"]["tp"].get(
        "ops", {})
    piped = run(Layout(pp=2, dp=4, zero=1, micro_batch=1))
    ends = (piped.detail["compute_s"]["embedding"], piped.detail["compute_s"]["head_and_loss"])
    assert min(ends) == 0.0 < max(ends)  # the busiest rank holds one end, not both
    assert sum(piped.detail["compute_s"].values()) == pytest.approx(piped.compute, rel=1e-9)


def test_every_micro_batch_that_finds_a_gradient_adds_into_it():
    """A loop that keeps its gradients accumulates on each of the m micro-batches, one that
    frees them on m - 1 (the first takes the fresh gradient over); a fused weight-gradient
    GEMM on none. meshloom frees them where no data-parallel bucket holds them (one GPU),
    and keeps its DDP buckets."""
    shape, one_gpu, two = PRESETS["llama3-1b"], make_cluster("h100", 1), Layout(micro_batch=2)

    def acc(batch, lay=two, cl=one_gpu, **impl):
        t = evaluate(shape, lay, cl, 2048, batch, impl=Implementation(**impl)).timing
        return t.detail["accumulate_s"]
    one = compute_mod.accumulate_seconds(shape.params, 1, rates_for(one_gpu))
    assert acc(8, free_unbucketed_grads=False) == pytest.approx(4 * one)
    assert acc(8) == pytest.approx(3 * one)
    assert acc(8, grad_clip=False) == pytest.approx(3 * one)
    assert acc(2, grad_clip=False) == 0.0
    assert acc(8, fused_grad_accumulation=True) == 0.0
    ddp = Layout(dp=2, micro_batch=2)
    assert acc(16, ddp, make_cluster("h100", 2)) == pytest.approx(4 * one)


def test_meshloom_zero1_adds_into_bf16_gradients():
    """meshloom's ZeRO-1 keeps whole bf16 gradients in its flat buffers (parallel/zero.py):
    half the accumulation traffic of fp32 ones; another trainer's ZeRO-1 keeps fp32."""
    shape, cl = PRESETS["llama3-1b"], make_cluster("h100", 2)
    lay = Layout(dp=2, zero=1, micro_batch=2)

    def acc(**impl):
        return evaluate(shape, lay, cl, 2048, 16, impl=Implementation(**impl)) \
            .timing.detail["accumulate_s"]
    one = compute_mod.accumulate_seconds(shape.params, 1, rates_for(cl))
    assert acc() == pytest.approx(4 * one / 2)  # 4 micro-batches, 6 bytes each
    assert acc(meshloom_block=False) == pytest.approx(4 * one)


def test_fix_keys_select_the_implementation():
    fixed = parse_fix("tp=2,compile=true,tp_overlap=on,fsdp_prefetch=false")
    layout_keys, impl = split_fix(fixed)
    assert layout_keys == {"tp": 2}
    assert impl == Implementation(compile=True, tp_overlap=True, fsdp_prefetch=False)
    with pytest.raises(PlanError, match="dp_overlap=maybe must be true or false"):
        parse_fix("dp_overlap=maybe")


def _one(shape, fixed, gpus=16, seq=4096, batch=64):
    return search(shape, make_cluster("h100", gpus), seq, batch, fixed, top=1)[0]


def test_overlap_options_hide_communication():
    shape = PRESETS["llama3-8b"]
    base = {"tp": 8, "pp": 1, "cp": 1, "zero": 1, "micro_batch": 1, "recompute": "full",
            "sp": True}
    plain = _one(shape, base)
    tp_ov = _one(shape, {**base, "tp_overlap": True})
    assert tp_ov.timing.tp < plain.timing.tp
    assert tp_ov.timing.step_time_s < plain.timing.step_time_s
    dp_ov = _one(shape, {**base, "dp_overlap": True})
    assert dp_ov.timing.dp < plain.timing.dp
    z3 = {"tp": 1, "pp": 1, "cp": 1, "zero": 3, "micro_batch": 1, "recompute": "full"}
    pre = _one(shape, z3)
    nopre = _one(shape, {**z3, "fsdp_prefetch": False})
    ops = pre.timing.detail["comm_s"]["dp"]["ops"]
    assert nopre.timing.dp == pytest.approx(sum(ops.values()))
    assert pre.timing.dp < nopre.timing.dp
    # DDP: meshloom's all-reduce runs under the last backward; Megatron-LM 2021's after it
    ddp = {"tp": 1, "pp": 1, "cp": 1, "zero": 0, "micro_batch": 1, "recompute": "full"}
    under, after = _one(shape, ddp), _one(shape, {**ddp, "ddp_overlap": False})
    reduce = after.timing.detail["comm_s"]["dp"]["ops"]["all_reduce"]
    assert after.timing.dp == reduce > under.timing.dp
    assert after.timing.step_time_s == pytest.approx(
        under.timing.step_time_s - under.timing.dp + reduce, rel=1e-12)


def test_userbuffers_overlap_runs_the_overlapped_gemms_in_pieces():
    """TransformerEngine's comm-GEMM overlap (`tp_overlap_chunks`): forward, the GEMMs reading
    the gathered sequence in tp chunks and the row-parallel ones in 4 splits; backward, only the
    row-parallel input gradients in tp chunks. tp 2, so the two piece counts differ."""
    from meshloom.plan.compute import Gemm

    rates = rates_for(make_cluster("h100", 8))
    tokens, t = 2048, 2
    for shape in (from_dims("gpt", 12288, 96, 96, 50688), PRESETS["llama3-8b"]):
        lay = Layout(tp=t, sp=True, micro_batch=1)
        on = Implementation(compile=True, tp_overlap=True, tp_overlap_chunks=True)
        got = block_cost(shape, lay, rates, tokens, 2, True, on)
        gemms = block_gemms(shape, tokens, t)
        rows = {"qkv": t, "fc1": t, "wq": t, "wk": t, "wv": t, "w1": t, "w3": t,
                "proj": 4, "fc2": 4, "wo": 4, "w2": 4}

        def pieces(g: Gemm, n: int) -> float:  # n launches of 1/n of the rows
            return n * rates.gemm(Gemm(g.name, g.m // n, g.n, g.k))

        assert got.fwd.gemm == pytest.approx(sum(pieces(g, rows[g.name]) for g in gemms),
                                             rel=1e-12)
        bwd = 0.0
        for g in gemms:
            dgrad, wgrad = g.backward()
            split = g.name in ("proj", "fc2", "wo", "w2")
            bwd += (pieces(dgrad, t) if split else rates.gemm(dgrad)) + rates.gemm(wgrad)
        assert got.bwd.gemm == pytest.approx(bwd, rel=1e-12)
        whole = block_cost(shape, lay, rates, tokens, 2, True,
                           Implementation(compile=True, tp_overlap=True))
        assert got.fwd.gemm > whole.fwd.gemm and got.bwd.gemm > whole.bwd.gemm
        # A no-op without SP, without the overlap, or on one GPU.
        for lay_off, impl_off in ((Layout(tp=t, micro_batch=1), on),
                                  (lay, Implementation(compile=True, tp_overlap_chunks=True)),
                                  (Layout(micro_batch=1), on)):
            a = block_cost(shape, lay_off, rates, tokens, 2, True, impl_off)
            b = block_cost(shape, lay_off, rates, tokens, 2, True,
                           replace(impl_off, tp_overlap_chunks=False))
            assert (a.fwd.gemm, a.bwd.gemm) == (b.fwd.gemm, b.bwd.gemm)
    fixed, impl = split_fix(parse_fix("tp_overlap=true,tp_overlap_chunks=true"))
    assert impl.tp_overlap and impl.tp_overlap_chunks and not fixed


def test_sequence_parallel_does_not_charge_the_embedding_output_again():
    """The embedding's output is the first block's input (counted there, a 1/t slice under SP);
    only GPT's embedding dropout keeps a mask of its own."""
    from meshloom.plan.implementation import Implementation
    from meshloom.plan.memory import layer_activation_bytes, logits_bytes
    llama = PRESETS["llama3-8b"]
    lay = Layout(tp=8, dp=1, sp=True, micro_batch=1, recompute="full")
    ideal = Implementation(meshloom_block=False)  # Korthikanti's accounting, bf16 tensors
    mem = memory_per_gpu(llama, lay, 4096, 1, impl=ideal)
    per_layer_input = 4096 * llama.hidden * 2 / 8
    # The loss (logits, fp32 copy, the final norm's input slice) and one layer's recompute
    # happen one after the other: the peak holds the larger.
    loss = logits_bytes(llama, 4096, 1, lay, "bf16", ideal) + 4096 * llama.hidden * 2 / 8
    working = layer_activation_bytes(llama, 4096, 1, lay, "bf16", recompute="none")
    assert mem.activations == pytest.approx(llama.layers * per_layer_input + max(loss, working))


def test_dropout_masks_only_for_models_with_dropout():
    with_drop = from_dims("gpt", 1024, 4, 16, 50304)
    without = from_dims("gpt", 1024, 4, 16, 50304, dropout=False)
    lay = Layout(micro_batch=1)
    a = memory_per_gpu(with_drop, lay, 2048, 1, flash=False).activations
    b = memory_per_gpu(without, lay, 2048, 1, flash=False).activations
    s, h, heads = 2048, 1024, 16
    # per layer: 2 residual-branch masks, and per score dropout's mask (1 B) and output (2 B);
    # the embedding dropout's mask
    masks = 4 * (2 * s * h + heads * s * s * (1 + 2)) + s * h
    assert a - b == pytest.approx(masks)


def test_explain_prints_every_term_and_json_has_the_detail():
    cmd = [sys.executable, "-m", "meshloom", "plan", "--model", "llama3-8b", "--gpus", "16",
           "--seq", "4096", "--global-batch", "64", "--fix",
           "tp=2,pp=1,cp=1,zero=3,micro_batch=2,recompute=selective,sp=true", "--explain"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for needle in ("rates:", "implementation: compile=false", "gemm", "attention",
                   "elementwise", "head_and_loss", "tp exposed", "dp exposed", "hidden",
                   "all_gather", "optimizer, clip, accumulate", "= step", "activations", "= total",
                   "counted as: meshloom's Llama block census: bf16 working parameters (ZeRO), "
                   "eager, selective recompute"):
        assert needle in out, needle
    js = subprocess.run(cmd[:-1] + ["--json"], capture_output=True, text=True, check=True)
    cand = json.loads(js.stdout)["candidates"][0]
    detail = cand["time_detail_s"]
    parts = sum(detail["compute_s"].values())
    assert parts == pytest.approx(cand["time_breakdown_s"]["compute"], rel=1e-9)
    assert math.isfinite(cand["step_time_s"])


def test_a_gpu_without_a_table_says_so():
    c = evaluate(PRESETS["gpt2-xl"], Layout(dp=2, zero=3), make_cluster("titan-rtx-24g", 2),
                 1024, 2)
    assert "no kernel table" in c.timing.detail["rates"]


def test_h200_table_is_the_h100_compute_with_its_own_bandwidth():
    """No bf16 GEMM or FlashAttention table has been published for the H200: its table takes the
    H100's compute rows (same die, SMs and clocks) and only its bandwidth from an H200 source.
    So an H200 step is priced as the H100's with faster memory-bound kernels, never at its
    datasheet peak (which it was before it had a table: 78% MFU on llama3-8b)."""
    h100, h200 = for_gpu("h100"), for_gpu("h200")
    assert h200.gemm == h100.gemm and h200.attention == h100.attention
    assert h200.hbm_gbps == 4010.0 and h200.hbm_gbps > h100.hbm_gbps
    raw = json.loads(Path(h200.path).read_text())
    assert raw["hbm_gbps"]["source"] == "azure_nd_h200_v5"
    shape, lay = PRESETS["llama3-8b"], Layout(dp=8, zero=2)
    on = {g: evaluate(shape, lay, make_cluster(g, 8), 8192, 64) for g in ("h100", "h200")}
    assert "h200.json" in on["h200"].timing.detail["rates"]
    gemm = {g: c.timing.detail["compute_s"]["gemm"] for g, c in on.items()}
    elementwise = {g: c.timing.detail["compute_s"]["elementwise"] for g, c in on.items()}
    assert gemm["h200"] == pytest.approx(gemm["h100"], rel=1e-12)
    assert elementwise["h200"] < elementwise["h100"]
    datasheet = evaluate(shape, lay, make_cluster("h200", 8, kernels="datasheet"), 8192, 64)
    assert on["h200"].mfu < 0.6 < datasheet.mfu


def test_grand_teton_h100_is_the_sxm_compute_at_500_w_on_slower_memory():
    """torchtitan's H100s (Meta's Grand Teton: 96GB HBM2e at 2.4 TB/s peak, 500 W): the SXM
    table's compute rows at the clock a 500 W cap leaves them (`at_power_limit`: FBGEMM's
    bf16 GEMMs on an H100 at 500 W over the SXM table's rates at the same shapes, 0.822), and
    a copy bandwidth derived from the published peak at the SXM part's BabelStream efficiency
    (2.90 of 3.35 TB/s). A step's GEMMs and attention take 1 / 0.822 as long, its
    memory-bound kernels 3350 / 2400 as long; its fp8 ratio and links are the SXM part's."""
    h100, teton = for_gpu("h100"), for_gpu("h100-96gb")
    raw = json.loads(Path(teton.path).read_text())
    limit = raw["at_power_limit"]
    cited = [(r["m"], r["n"], r["k"], r["tflops"]) for r in limit["gemm"]]
    assert cited == [(8192, 8192, 8192, 585.23), (65536, 8192, 7168, 575.12),
                     (65536, 3584, 8192, 546.31)]
    assert {r["source"] for r in limit["gemm"]} == {"fbgemm_h100_500w"}
    assert "tflops 585.23" in raw["sources"]["fbgemm_h100_500w"]["quote"]
    factor = math.prod(t / h100.gemm_tflops(m, n, k) for m, n, k, t in cited) ** (1 / 3)
    assert round(factor, 3) == 0.822 and "0.822" in raw["provenance"]["note"]
    assert teton.power_limit == (500.0, pytest.approx(factor, rel=1e-12), True, "h100")
    assert [g[:3] for g in teton.gemm] == [g[:3] for g in h100.gemm]
    assert [g[3] for g in teton.gemm] == pytest.approx([g[3] * factor for g in h100.gemm])
    assert [a[4] for a in teton.attention] == pytest.approx(
        [a[4] * factor for a in h100.attention])
    cudnn = teton.other_attention["cudnn"], h100.other_attention["cudnn"]
    assert [a[:4] for a in cudnn[0]] == [a[:4] for a in cudnn[1]]
    assert [a[4] for a in cudnn[0]] == pytest.approx([a[4] * factor for a in cudnn[1]])
    assert teton.fp8_speedup(8192, 1024, 4096) == h100.fp8_speedup(8192, 1024, 4096)
    assert teton.hbm_gbps == round(2400 * h100.hbm_gbps / 3350)
    assert "2.4 TB/sec" in raw["sources"]["torchtitan_grand_teton"]["quote"]
    shape, lay = PRESETS["llama3-8b"], Layout(dp=8, zero=3, micro_batch=2,
                                              recompute="selective")
    on = {g: evaluate(shape, lay, make_cluster(g, 8, memory_gb=96.0), 8192, 16)
          for g in ("h100", "h100-96gb")}
    rates = on["h100-96gb"].timing.detail["rates"]
    assert "h100-96gb.json" in rates and "at its 500 W limit" in rates and "0.822" in rates
    part = {g: c.timing.detail["compute_s"] for g, c in on.items()}
    for term in ("gemm", "attention"):
        assert part["h100-96gb"][term] == pytest.approx(part["h100"][term] / factor, rel=1e-9)
    assert part["h100-96gb"]["elementwise"] == pytest.approx(
        part["h100"]["elementwise"] * h100.hbm_gbps / teton.hbm_gbps, rel=1e-9)
    assert make_cluster("h100-96gb", 8).gpu.hbm_gbps == 2400.0


def _borrowing_table(**limit) -> dict:
    rows = [{"m": 8192, "n": 8192, "k": 8192, "tflops": 600.0}]
    return {"gpu": "h100-96gb", "kind": "measured", "compute_from": "h100", "hbm_gbps": 2000.0,
            "at_power_limit": {"watts": 500, "gemm": rows, **limit}}


def test_a_power_limit_scales_the_borrowed_gemms_and_optionally_attention():
    """The factor is the cited rates over the lender's at the same shapes; `attention: false`
    leaves the attention rows at the lender's clock (validation.json's
    error_attention_full_clock prices the Grand Teton rows so)."""
    h100 = for_gpu("h100")
    factor = 600.0 / h100.gemm_tflops(8192, 8192, 8192)
    both = parse(_borrowing_table())
    gemm_only = parse(_borrowing_table(attention=False))
    assert both.gemm_tflops(8192, 8192, 8192) == pytest.approx(600.0)
    assert gemm_only.gemm_tflops(4096, 14336, 8192) == pytest.approx(
        h100.gemm_tflops(4096, 14336, 8192) * factor)
    assert both.attention_tflops(4096, 128, True, "bwd") == pytest.approx(
        h100.attention_tflops(4096, 128, True, "bwd") * factor)
    assert gemm_only.attention_tflops(4096, 128, True, "bwd") == pytest.approx(
        h100.attention_tflops(4096, 128, True, "bwd"))
    assert both.power_limit == (500.0, pytest.approx(factor), True, "h100")
    assert gemm_only.power_limit[2] is False


@pytest.mark.parametrize("edit, needle", [
    (lambda d: (d.pop("compute_from"), d.update(gemm=TABLE["gemm"])),
     "at_power_limit scales rates taken with compute_from"),
    (lambda d: d.update(at_power_limit=[500]), "at_power_limit must be an object"),
    (lambda d: d["at_power_limit"].update(watts=0), "watts must be a positive number"),
    (lambda d: d["at_power_limit"].update(watts=True), "watts must be a positive number"),
    (lambda d: d["at_power_limit"].update(attention="yes"), "attention must be true or false"),
    (lambda d: d["at_power_limit"].update(gemm=[]), "needs gemm rows measured at the limit"),
    (lambda d: d["at_power_limit"]["gemm"][0].pop("k"), "gemm row 0 needs integer m, n, k"),
    (lambda d: d["at_power_limit"]["gemm"][0].update(tflops=-5.0), "tflops > 0"),
    (lambda d: d.update(kind="published", sources={}), "at_power_limit gemm row 0: a published"),
])
def test_a_bad_power_limit_is_one_line_naming_the_problem(tmp_path, edit, needle):
    _refused_in_one_line(tmp_path, _borrowing_table(), edit, needle)


def test_a_shape_measured_twice_is_their_mean():
    raw = json.loads(json.dumps(TABLE))
    raw["gemm"].append({"m": 4096, "n": 4096, "k": 4096, "tflops": 500.0})
    t = parse(raw)
    assert t.gemm_tflops(4096, 4096, 4096) == 450.0 and len(t.gemm) == 3


def test_ring_collectives_across_nodes_use_every_members_port():
    """k members of a group in each node drive k network ports at once (NCCL's rings leave the
    node through different GPUs); one member per node, or a point-to-point send, gets one."""
    from meshloom.plan.hardware import GB, LINK_EFFICIENCY
    cl = make_cluster("a100-80g", 32)
    assert cl.bus_bandwidth(16, 1) == pytest.approx(8 * 25 * GB * LINK_EFFICIENCY)
    assert cl.bus_bandwidth(16, 2) == pytest.approx(4 * 25 * GB * LINK_EFFICIENCY)
    assert cl.bus_bandwidth(4, 8) == pytest.approx(25 * GB * LINK_EFFICIENCY)
    assert cl.link_bandwidth(16, 1) == pytest.approx(25 * GB * LINK_EFFICIENCY)
    h = make_cluster("h100", 32)
    assert h.bus_bandwidth(32, 1) == pytest.approx(8 * 50 * GB * LINK_EFFICIENCY)
    fast = make_cluster("h100", 32, inter_gbps=100)  # 8 x 100 would exceed NVLink's 450
    assert fast.bus_bandwidth(32, 1) == pytest.approx(450 * GB * LINK_EFFICIENCY)


def test_a_hidden_collective_still_slows_the_compute_it_runs_beside():
    from meshloom.plan.hardware import OVERLAP_SLOWDOWN
    from meshloom.plan.timing import _exposed
    assert _exposed(1.0, 3.0) == pytest.approx(OVERLAP_SLOWDOWN)
    assert _exposed(3.0, 1.0) == pytest.approx(2.0 + OVERLAP_SLOWDOWN)
    assert OVERLAP_SLOWDOWN == 0.189  # Lee et al. (arXiv 2507.03114), the published average


def test_kv_copied_to_every_head_is_what_the_attention_saves():
    """Counted Korthikanti's way (another trainer's block), a trainer that copies K and V out
    to every query head before the attention (torchtitan's repeat_kv, `expand_kv`) has the
    attention save the copies: 2 q_dim per token where native grouped-query attention saves
    2 kv_dim. A full-width model (kv = q) is the same either way."""
    from meshloom.plan.memory import layer_activation_bytes
    shape = PRESETS["llama3-8b"]
    q, kv = shape.q_dim, shape.kv_dim
    assert kv < q
    lay = Layout(tp=2, micro_batch=2, recompute="none")
    other = replace(MESHLOOM, meshloom_block=False)
    s, b = 4096, 2

    def saved(model, expand):
        return layer_activation_bytes(model, s, b, lay, "bf16", impl=replace(other,
                                                                             expand_kv=expand))

    assert saved(shape, True) - saved(shape, False) == s * b * 2 * (q - kv) * 2 / lay.tp
    mha = replace(shape, kv_heads=shape.heads)
    assert saved(mha, True) == saved(mha, False)


def test_bf16_only_optimizer_state_halves_the_step_traffic():
    """`optimizer_state=bf16` (bf16 weights updated in place, bf16 moments, no fp32 master:
    KempnerForge) steps on 2-byte weights, gradients and moments: the fused AdamW's 28 bytes
    a parameter become 14 and every gradient pass halves; fp32 and fp32_remainders state keep
    the fp32 kernel's traffic. Through a plan only the optimizer term moves, and not at all for
    meshloom's unsharded block, whose fp32 parameters are the masters."""
    rates = _rates()
    full = compute_mod.optimizer_seconds(1e9, 1e9, rates)
    assert compute_mod.optimizer_seconds(1e9, 1e9, rates, state="bf16") == \
        pytest.approx(full / 2) == pytest.approx(22e9 / 2000e9)
    assert compute_mod.optimizer_seconds(1e9, 1e9, rates, state="fp32_remainders") == full
    assert compute_mod.optimizer_seconds(1e9, 1e9, rates, optimizer_impl="foreach",
                                         state="bf16") == pytest.approx(48e9 / 2000e9)
    shape = PRESETS["llama3-8b"]

    def step(lay, **impl):
        return evaluate(shape, lay, make_cluster("h200", lay.dp), 4096, 8 * lay.dp,
                        impl=Implementation(**impl)).timing

    zero3 = Layout(dp=8, zero=3, micro_batch=2)
    fp32, bf16 = step(zero3), step(zero3, optimizer_state="bf16")
    assert bf16.optimizer < fp32.optimizer
    assert bf16.step_time_s - fp32.step_time_s == pytest.approx(bf16.optimizer - fp32.optimizer)
    alone = Layout(dp=1, micro_batch=2)
    assert step(alone, optimizer_state="bf16").optimizer == step(alone).optimizer
