"""Three tensor-parallel terms read from the code that runs them (plan/compute.py `sp_copies`,
plan/reruns.py `tp_reruns`, plan/timing.py `tp_overlap_backward`), the GEMM memory roofline
(compute.Rates.gemm), and the held-out torchtitan TP rows they were checked on
(benchmarks/published/runs.json, source torchtitan-asynctp-h100)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from meshloom.plan import PlanError
from meshloom.plan.compute import (
    GEMM_BYTES,
    block_cost,
    embedding_cost,
    end_sp_copies,
    head_cost,
    rates_for,
    sp_copies,
)
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import MESHLOOM, Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.models import from_dims
from meshloom.plan.reruns import tp_reruns
from meshloom.plan.step_kernels import Gemm
from meshloom.plan.timing import _exposed, step_time
from meshloom.plan.trainers import trainer_impl

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "published" / "runs.json"
VALIDATION = ROOT / "benchmarks" / "results" / "planner" / "validation.json"
PAGES = sorted((ROOT / "docs").glob("plan*.md"))  # the planner's pages

LLAMA8B = from_dims("llama", 4096, 32, 32, 128256, kv_heads=8, ffn_hidden=14336)
TITAN = Implementation(**trainer_impl("torchtitan"))
MEGATRON = Implementation(**trainer_impl("megatron-lm"))
ASYNC = replace(TITAN, tp_overlap=True, tp_overlap_chunks=True)


def _lay(**kw) -> Layout:
    base = dict(tp=8, dp=8, sp=True, micro_batch=12, zero=3, recompute="selective")
    return Layout(**{**base, **kw})


def test_which_trainers_copy_around_sp_collectives():
    lay = _lay()
    reruns = tp_reruns(LLAMA8B, lay, TITAN)
    assert reruns == 1.0  # torchtitan's op policy regathers the projections' inputs
    whole = (4.0, 2 * (2 + reruns))
    assert sp_copies(LLAMA8B, lay, TITAN) == whole
    assert sp_copies(LLAMA8B, _lay(micro_batch=1), TITAN) == (0.0, 0.0)  # a view at b = 1
    assert sp_copies(LLAMA8B, lay, MEGATRON) == (0.0, 0.0)  # sequence-first tensors
    # meshloom cats / stacks at b > 1 and hands the collective the tensor itself at b = 1
    # (comm._leading; tests/test_tensor_layers.py checks the storage); `always` copies even then
    assert sp_copies(LLAMA8B, lay, MESHLOOM) == (
        4.0, 2 * (2 + tp_reruns(LLAMA8B, lay, MESHLOOM)))
    assert sp_copies(LLAMA8B, _lay(micro_batch=1), MESHLOOM) == (0.0, 0.0)
    one = _lay(micro_batch=1)
    assert sp_copies(LLAMA8B, one, replace(MESHLOOM, sp_copies="always")) == (
        4.0, 2 * (2 + tp_reruns(LLAMA8B, one, MESHLOOM)))
    # meshloom has no fused all-gather-matmul: overlap alone does not drop its copies
    assert sp_copies(LLAMA8B, lay, replace(MESHLOOM, tp_overlap=True)) == \
        sp_copies(LLAMA8B, lay, MESHLOOM)
    assert sp_copies(LLAMA8B, lay, ASYNC) == (0.0, whole[1])  # fused forward only
    assert sp_copies(LLAMA8B, lay, replace(ASYNC, tp_overlap_backward=True)) == (0.0, 0.0)
    assert sp_copies(LLAMA8B, _lay(sp=False), MESHLOOM) == (0.0, 0.0)
    assert sp_copies(LLAMA8B, _lay(tp=1, dp=64), MESHLOOM) == (0.0, 0.0)


def test_the_ends_copy_as_the_blocks_do():
    lay = _lay()
    assert end_sp_copies(lay, TITAN, fused_forward=True) == (1.0, 1.0)
    assert end_sp_copies(_lay(micro_batch=1), TITAN, fused_forward=True) == (0.0, 0.0)
    assert end_sp_copies(lay, MEGATRON, fused_forward=False) == (0.0, 0.0)
    assert end_sp_copies(lay, MESHLOOM, fused_forward=False) == (1.0, 1.0)
    assert end_sp_copies(_lay(micro_batch=1), MESHLOOM, fused_forward=False) == (0.0, 0.0)
    assert end_sp_copies(_lay(micro_batch=1), replace(MESHLOOM, sp_copies="always"),
                         fused_forward=False) == (1.0, 1.0)
    # async TP fuses the head's gather into its matmul, never the lookup's reduce-scatter
    assert end_sp_copies(lay, ASYNC, fused_forward=True) == (0.0, 1.0)
    assert end_sp_copies(lay, ASYNC, fused_forward=False) == (1.0, 1.0)
    rates = rates_for(make_cluster("h100-96gb", 64))
    one = 2 * lay.micro_batch * 8192 * LLAMA8B.hidden * 2 / (rates.hbm_gbps * 1e9)
    none = replace(TITAN, sp_copies="none")
    for cost in (head_cost, embedding_cost):
        (f, b), (f0, b0) = (cost(LLAMA8B, lay, rates, 8192, i) for i in (TITAN, none))
        assert (f - f0, b - b0) == pytest.approx((one, one), rel=1e-9)


def test_op_sac_reruns_the_all_gathers_only_under_sp():
    assert tp_reruns(LLAMA8B, _lay(sp=False), TITAN) == 0.0
    assert tp_reruns(LLAMA8B, _lay(recompute="full"), TITAN) == 2.0
    assert tp_reruns(LLAMA8B, _lay(), replace(TITAN, op_sac=False)) == 0.0  # Megatron's


def test_copies_cost_a_read_and_write_of_the_gathered_tensor_each():
    lay, e = _lay(), 2
    rates = rates_for(make_cluster("h100-96gb", 64))
    with_ = block_cost(LLAMA8B, lay, rates, 8192, e, True, TITAN)
    without = block_cost(LLAMA8B, lay, rates, 8192, e, True, replace(TITAN, sp_copies="none"))
    one = 2 * lay.micro_batch * 8192 * LLAMA8B.hidden * e / (rates.hbm_gbps * 1e9)
    n_f, n_b = sp_copies(LLAMA8B, lay, TITAN)
    assert with_.fwd.elementwise - without.fwd.elementwise == pytest.approx(n_f * one, rel=1e-9)
    assert with_.bwd.elementwise - without.bwd.elementwise == pytest.approx(n_b * one, rel=1e-9)
    assert with_.fwd.gemm == without.fwd.gemm and with_.bwd.gemm == without.bwd.gemm


def test_forward_only_overlap_leaves_the_backward_waiting():
    lay = _lay()
    cluster = make_cluster("h100-96gb", 64)
    impls = {"none": replace(TITAN, sp_copies="none"),
             "fwd": replace(ASYNC, sp_copies="none"),
             "all": replace(ASYNC, sp_copies="none", tp_overlap_backward=True)}
    tp = {k: step_time(LLAMA8B, lay, cluster, 8192, 96, impl=v).detail["comm_s"]["tp"]
          for k, v in impls.items()}
    blk = block_cost(LLAMA8B, lay, rates_for(cluster), 8192, 2, True, impls["fwd"])
    # blocks x (2 + 2 + reruns) all-reduce worths waited on without overlap
    per_pair = tp["none"]["ops"]["collectives"] / (32 * (4 + tp_reruns(LLAMA8B, lay, TITAN)))
    saved = 32 * (2 * per_pair - _exposed(2 * per_pair, blk.fwd.gemm))
    assert tp["none"]["exposed"] - tp["fwd"]["exposed"] == pytest.approx(saved, rel=1e-9)
    assert tp["all"]["exposed"] < tp["fwd"]["exposed"]


def test_the_new_keys_parse_and_refuse_bad_values():
    fixed = parse_fix("sp_copies=batch,tp_overlap_backward=false")
    assert fixed == {"sp_copies": "batch", "tp_overlap_backward": False}
    with pytest.raises(PlanError, match="sp_copies=sideways must be one of always, batch, none"):
        parse_fix("sp_copies=sideways")


def _runs() -> dict:
    data = json.loads(RUNS.read_text())
    return {r["id"]: r for r in data["runs"]
            if r["source"] == "torchtitan-asynctp-h100" and r["precision"] == "bf16"}


def _rows() -> dict:
    return {r["id"]: r for r in json.loads(VALIDATION.read_text())["rows"]}


def _step(run: dict) -> float:
    """torchtitan's TPS/GPU divides a rank's tokens by the step and the non-dp size (tp)."""
    tokens = run["micro_batch"] * run["seq"]
    return tokens / (run["layout"]["tp"] * run["published"]["tokens_per_s_per_gpu"])


def test_the_async_tp_rows_are_quoted_and_planned_as_they_ran():
    runs, rows = _runs(), _rows()
    assert len(runs) == 4
    for rid, run in runs.items():
        assert f"| {run['published']['tokens_per_s_per_gpu']:g} " in run["quote"]
        fix = rows[rid]["fix"]
        assert "sp_copies=batch" in fix and "tp_overlap_backward=False" in fix
        assert ("tp_overlap=True" in fix) == ("asynctp" in rid)
        assert rows[rid]["fits"]


def test_async_tp_gain_in_the_docs_is_the_files():
    runs, rows = _runs(), _rows()
    doc = " ".join(" ".join(p.read_text() for p in PAGES).split())
    for model, layers in (("70b", 80), ("8b", 32)):
        van, asy = (next(r for i, r in runs.items() if model + "-" in i and kind in i)
                    for kind in ("-tp8-", "-asynctp8-"))
        published = (_step(van) - _step(asy)) / layers * 1e3
        planned = (rows[van["id"]]["step_s"] - rows[asy["id"]]["step_s"]) / layers * 1e3
        assert f"{published:.1f}" in doc and f"{planned:.1f}" in doc
    m = re.search(r"brought them to ([+−]\S+)% and ([+−]\S+)% \(vanilla\), ([+−]\S+)% and "
                  r"([+−]\S+)% \(async\)", doc)
    ids = [next(i for i in runs if m_ in i) for m_ in ("70b-8192-256gpu-fsdp32-tp8",
                                                       "8b-8192-64gpu-fsdp8-tp8",
                                                       "70b-8192-256gpu-fsdp32-async",
                                                       "8b-8192-64gpu-fsdp8-async")]
    assert [f"{100 * rows[i]['error']:+.1f}" for i in ids] == [
        g.replace("−", "-") for g in m.groups()]


def test_no_gemm_runs_faster_than_moving_its_operands_once():
    rates = rates_for(make_cluster("h100-96gb", 8))
    thin = Gemm("wk", 98304, 128, 4096)  # a GQA key projection under tp 8
    interpolated = thin.flops / (rates.table.gemm_tflops(thin.m, thin.n, thin.k) * 1e12)
    moved = GEMM_BYTES * (98304 * 4096 + 4096 * 128 + 98304 * 128) / (rates.hbm_gbps * 1e9)
    assert moved > 1.5 * interpolated  # the table's neighbours would price it twice as fast
    assert rates.gemm(thin) == pytest.approx(moved, rel=1e-12)
    # the figures "Step time", GEMMs, quotes
    doc = " ".join(" ".join(p.read_text() for p in PAGES).split())
    assert (f"{rates.hbm_gbps:.0f} GB/s on the Grand Teton part, "
            f"{thin.flops / moved / 1e12:.0f} TFLOP/s, where the interpolation gave "
            f"{thin.flops / interpolated / 1e12:.0f}") in doc
    square = Gemm("w1", 16384, 14336, 4096)  # compute-bound: the table's rate stands
    assert rates.gemm(square) == pytest.approx(
        square.flops / (rates.table.gemm_tflops(16384, 14336, 4096) * 1e12), rel=1e-12)
    sheet = rates_for(make_cluster("h100-96gb", 8, kernels="datasheet"))
    assert sheet.gemm(thin) == pytest.approx(thin.flops / (sheet.peak_tflops * 1e12))
