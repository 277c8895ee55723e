"""The planner against measured and published training runs, written as data and as the
validation tables of docs/plan-validation.md (one command regenerates both; no hardware needed):

    python benchmarks/planner_validation.py

Sets of runs, each row on the layout and implementation it ran with:
- `meshloom-h100`: meshloom's own 1B Llama runs on one H100 (docs/gpu.md; files in
  benchmarks/measured/h100-2026-11-22/): the stripped benchmark eager and compiled, with and
  without recompute, and the `meshloom train` loop.
- `meshloom-h200`: the same `meshloom train` loop (compiled) on one H200
  (benchmarks/measured/h200-2026-11-28/), planned from the H200 table (the H100's compute).
- `megatron-2021-a100`: Megatron-LM Table 1 (Narayanan et al. 2021, published.md), A100 80GB,
  full recompute, interleaved schedule (virtual stages searched), fused kernels, unfused
  attention (2021: no FlashAttention).
- `published-*`: end-to-end runs of other public trainers, cited row by row in
  benchmarks/published/runs.json.
The step time is predicted from kernel tables (src/meshloom/plan/kernels/) and link rates; no
constant is fitted to any of these rows. Error = predicted / published throughput - 1 (the MFU
error, since both sides count the same FLOPs). A layout that ran must be predicted to fit.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from pathlib import Path

from meshloom.plan import accuracy, kernel_table
from meshloom.plan.formulas import MIXED, model_state_bytes
from meshloom.plan.hardware import make_cluster
from meshloom.plan.models import MEGATRON_SEQ, MEGATRON_TABLE1, PRESETS, from_dims
from meshloom.plan.search import search
from meshloom.plan.trainers import OTHER_LOOP, trainer_impl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import power_model  # noqa: E402
from _launch import parser, provenance, write_result  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "planner" / "validation.json"
RUNS = HERE / "published" / "runs.json"
H100_RUNS = HERE / "measured" / "h100-2026-11-22"
# The H100 kernel table `meshloom bench kernels` measured (isolated kernels, 2026-11-26): each
# H100 row is also predicted with it (`error_measured_kernels`) beside the committed table.
H100_LOOP = HERE / "measured" / "h100-2026-11-26"
MEASURED_H100 = H100_LOOP / "h100-kernels.json"
# The same H100's GEMMs from idle and after seconds back to back at its 700 W limit
# (benchmarks/gemm_sustained.py): each H100 row is also predicted with the committed table's
# GEMM rates at that sustained rate (`error_sustained_gemm`), the floor a power-limited clock
# sets on a step that is all GEMM, and with the power limit priced by the step's duty
# (`error_power_duty`, benchmarks/power_model.py).
GEMM_SUSTAINED = H100_LOOP / "gemm_sustained.json"
H200_LOOP = HERE / "measured" / "h200-2026-11-28"
DOC = HERE.parent / "docs" / "plan-validation.md"  # where the tables are written
BEGIN, END = "<!-- validation:begin -->", "<!-- validation:end -->"
README = HERE.parent / "README.md"
README_BEGIN, README_END = "<!-- planner-accuracy:begin -->", "<!-- planner-accuracy:end -->"
GOAL_MEAN, GOAL_MAX = 0.08, 0.20

@cache
def sustained_ratio() -> float:
    """The mean of the H100's sustained TFLOP/s (seconds of one GEMM back to back at 700 W) over
    the committed table's rate at the same shape, over gemm_sustained.json's GEMMs. The table's
    rows are mostly a continuous sweep, so they sit near that floor already (about 0.98), not
    at the rate from idle (0.86 of which the GEMMs hold)."""
    table = kernel_table.for_gpu("h100")
    return 1.0 / power_model.table_fraction(power_model.sustained_rows(GEMM_SUSTAINED),
                                            table.gemm_tflops, against="sustained_tflops")


@cache
def _scratch() -> Path:
    """One temporary folder per process for the rescaled tables."""
    return Path(tempfile.mkdtemp(prefix="meshloom-gemm-scaled-"))


@cache
def scaled_h100_table(factor: float) -> str:
    """The committed H100 table with every GEMM row's rate times `factor` (attention, copies
    and launches as they are), written to a temporary file."""
    raw = json.loads((kernel_table.TABLE_DIR / "h100.json").read_text())
    raw["gemm"] = [{**g, "tflops": g["tflops"] * factor} for g in raw["gemm"]]
    path = _scratch() / f"h100-gemm-x{factor!r}.json"
    path.write_text(json.dumps(raw))
    return str(path)


@cache
def attention_full_clock_table(gpu: str) -> str | None:
    """A committed table that scales its borrowed attention rates to a power limit
    (`at_power_limit`), with the attention rates left at the lender's clock, written to a
    temporary file; None for a table without one."""
    raw = json.loads((kernel_table.TABLE_DIR / f"{gpu}.json").read_text())
    limit = raw.get("at_power_limit")
    if not limit or not limit.get("attention", True):
        return None
    raw["at_power_limit"] = {**limit, "attention": False}
    path = _scratch() / f"{gpu}-attention-full-clock.json"
    path.write_text(json.dumps(raw))
    return str(path)


def sustained_h100_table() -> str:
    """The committed H100 table with every GEMM at the sustained floor (sustained_ratio)."""
    return scaled_h100_table(sustained_ratio())


@cache
def power_h100() -> tuple[Callable[[float], float], float]:
    """(GEMM rate / rate from idle by duty on the H100, the table's rate / rate from idle)."""
    rows = power_model.sustained_rows(GEMM_SUSTAINED)
    ratio = power_model.anchored(power_model.duty_curve(), power_model.duty_one_ratio(rows))
    return ratio, power_model.table_fraction(rows, kernel_table.for_gpu("h100").gemm_tflops)


def power_inputs() -> dict:
    """What the two power columns were priced from, for the docs to cite."""
    rows = power_model.sustained_rows(GEMM_SUSTAINED)
    ratio, fraction = power_h100()
    return {"h100_duty_one_ratio": round(power_model.duty_one_ratio(rows), 4),
            "table_fraction_of_idle_rate": round(fraction, 4),
            "sustained_floor_of_table": round(sustained_ratio(), 4),
            "h100_curve": [[d, round(ratio(d), 4)] for d, _ in power_model.duty_curve()],
            "files": [str(p.relative_to(HERE.parent)) for p in (
                power_model.DUTY_CYCLE, GEMM_SUSTAINED)]}


def tensor_core_seconds(c) -> float:
    return c.timing.detail["compute_s"]["gemm"] + c.timing.detail["compute_s"]["attention"]


def _row(set_name: str, rid: str, gpu: str, gpus: int, shape, seq: int, batch: int,
         fixed: dict, published_tps: float, flash: bool = True, gpus_per_node: int = 8,
         extra: dict | None = None, memory_gb: float | None = None,
         inter_gbps: float | None = None, nvlink_mesh: int = 0) -> dict:
    def best_on(kernels: str | None = None):
        """The best layout on this row's cluster, priced from `kernels` (None: the GPU's
        committed table)."""
        cluster = make_cluster(gpu, gpus, gpus_per_node, memory_gb=memory_gb,
                               inter_gbps=inter_gbps, nvlink_mesh=nvlink_mesh, kernels=kernels)
        return search(shape, cluster, seq, batch, fixed, flash=flash, top=1)[0]

    best = best_on()
    got = best.tokens_per_s_per_gpu
    # Meshloom's own measured H100 table prices FlashAttention-2 and cuDNN only: a row on an
    # older kernel (priced through the committed table's borrowed ratio) has no such error.
    older = fixed.get("attention_kernel") in ("fa1", "triton")
    if gpu == "h100" and MEASURED_H100.exists() and not older:
        alt = best_on(str(MEASURED_H100))
        extra = {**(extra or {}), "error_measured_kernels": round(
            alt.tokens_per_s_per_gpu / published_tps - 1, 4)}
    if (full_clock := attention_full_clock_table(gpu)) is not None:
        # The other reading of the power limit: only the GEMMs slowed by it.
        alt = best_on(full_clock)
        extra = {**(extra or {}), "error_attention_full_clock": round(
            alt.tokens_per_s_per_gpu / published_tps - 1, 4)}
    if gpu == "h100" and GEMM_SUSTAINED.exists():
        def priced(factor: float):
            return best_on(scaled_h100_table(round(factor, 4)))

        hot = priced(sustained_ratio())
        extra = {**(extra or {}), "error_sustained_gemm": round(
            hot.tokens_per_s_per_gpu / published_tps - 1, 4)}
        if power_model.DUTY_CYCLE.exists():
            ratio, fraction = power_h100()
            factor, duty = power_model.fixed_point(
                lambda f: (tensor_core_seconds(c := priced(f)), c.timing.step_time_s),
                ratio, fraction)
            extra.update(power_duty=round(duty, 3), power_gemm_factor=round(factor, 3),
                         error_power_duty=round(priced(factor).tokens_per_s_per_gpu
                                                / published_tps - 1, 4))
    return {"set": set_name, "id": rid, "gpu": gpu, "gpus": gpus, "layout": best.layout.short(),
            "fix": ",".join(f"{k}={v}" for k, v in fixed.items()),
            "published_tokens_per_s_per_gpu": round(published_tps, 1),
            "predicted_tokens_per_s_per_gpu": round(got, 1),
            "error": round(got / published_tps - 1, 4), "mfu_predicted": round(best.mfu, 4),
            "step_s": round(best.timing.step_time_s, 4),
            "accumulate_s": round(best.timing.detail["accumulate_s"], 4),
            "fits": best.fits, "memory_gb": round(best.memory.total / 1e9, 2),
            "allocated_gb": round((best.memory.total - best.memory.context) / 1e9, 2),
            "rates": best.timing.detail["rates"],
            "compute_s": {k: round(v, 5) for k, v in best.timing.detail["compute_s"].items()},
            **(extra or {})}


def _memory_error(row: dict) -> dict:
    """The predicted peak of allocated bytes against the CUDA allocator's measured one."""
    row["memory_error"] = round(row["allocated_gb"] / row["measured_peak_gb"] - 1, 4)
    return row


def meshloom_h100_rows() -> list[dict]:
    """docs/gpu.md's 1B runs: 8 x 2048 tokens per step on one H100, at meshloom's defaults
    (SDPA's attention: cuDNN's, which PyTorch 2.11 ran there, as the measured table's
    provenance names the kernels)."""
    shape, rows = PRESETS["llama3-1b"], []
    variants = {}
    for name in ("mfu_llama1b.json", "mfu_llama1b_compiled_ac_sac.json"):
        data = json.loads((H100_RUNS / name).read_text())["models"]["llama1b"]["variants"]
        variants.update({k: (v, name) for k, v in data.items()})
    for key, (v, name) in sorted(variants.items()):
        # The stripped benchmark frees its gradients and does not clip.
        fixed = {"micro_batch": 8, "compile": v["compiled"],
                 "recompute": v["activation_checkpointing"], "grad_clip": False}
        rows.append(_memory_error(_row(
            "meshloom-h100", f"benchmark {key}", "h100", 1, shape, 2048, 8, fixed,
            8 * 2048 / v["median_step_s"],
            extra={"source": f"benchmarks/measured/h100-2026-11-22/{name}",
                   "measured_peak_gb": round(v["max_memory_allocated"] / 1e9, 2)})))
    # The loop as it is since 2026-11-26 (gradients freed on one GPU, the clip in the fused
    # optimizer), measured in the same session as mfu_llama1b.json beside it.
    for name, rec in (("train_llama1b_compile.jsonl", "none"),
                      ("train_llama1b_compile_selective.jsonl", "selective")):
        rows.append(_loop_row("h100", H100_LOOP / name, rec))
    return rows


def meshloom_h200_rows() -> list[dict]:
    """The compiled `meshloom train` loop of docs/gpu.md on one H200 (2026-11-28)."""
    return [_loop_row("h200", H200_LOOP / "train_llama1b_compile.jsonl", "none")]


def _loop_row(gpu: str, path: Path, recompute: str) -> dict:
    """A `meshloom train` run of the 1B Llama, 8 x 2048 tokens a step, from its metrics.jsonl:
    the median step after the first two (compile), the allocator's peak."""
    steps = [json.loads(x) for x in path.read_text().splitlines() if x.startswith('{"step"')]
    median = statistics.median(s["step_time_s"] for s in steps[2:])
    peak = max(s["peak_mem_bytes"] for s in steps)
    return _memory_error(_row(
        f"meshloom-{gpu}", f"meshloom train {path.stem.split('_', 2)[2]}", gpu, 1,
        PRESETS["llama3-1b"], 2048, 8, {"micro_batch": 8, "compile": True,
                                         "recompute": recompute},
        8 * 2048 / median, extra={"source": str(path.relative_to(HERE.parent)),
                                  "measured_peak_gb": round(peak / 1e9, 2)}))


def megatron_rows() -> list[dict]:
    rows = []
    for row in MEGATRON_TABLE1:
        fixed = {"tp": row["tp"], "pp": row["pp"], "dp": row["gpus"] // (row["tp"] * row["pp"]),
                 "cp": 1, "micro_batch": 1, "zero": 0, "recompute": "full", "sp": False,
                 "compile": True, **OTHER_LOOP, "pp_split": "even",
                 "p2p_blocking": True, "pp_scatter_gather": True, "ddp_overlap": False,
                 "dp_buckets": "whole", "cross_entropy": "megatron", "grad_reduce_dtype": "bf16",
                 **({"schedule": "interleaved_1f1b"} if row["pp"] > 1 else {})}
        shape = PRESETS[row["name"]]
        # Table 1 quotes hardware TFLOP/s (recompute included): as throughput, tokens/s/GPU.
        cl = make_cluster("a100-80g", row["gpus"])
        best = search(shape, cl, MEGATRON_SEQ, row["batch"], fixed, flash=False, top=1)[0]
        tps = row["tflops"] * 1e12 / (best.timing.hw_flops / (row["batch"] * MEGATRON_SEQ))
        rows.append(_row("megatron-2021-a100", row["name"].removeprefix("megatron-"),
                         "a100-80g", row["gpus"], shape, MEGATRON_SEQ, row["batch"],
                         {**fixed, "v": best.layout.v} if row["pp"] > 1 else fixed, tps,
                         flash=False, extra={"published_tflops": row["tflops"]}))
    return rows


def run_shape(run: dict):
    """A published run's model as runs.json records it (with its experts, if it has them)."""
    m = run["model"]
    shape = from_dims(m["arch"], m["hidden"], m["layers"], m["heads"], m["vocab"],
                      kv_heads=m.get("kv_heads"), ffn_hidden=m.get("ffn_hidden"),
                      name=m.get("name", run["id"]), tied=m.get("tied_embeddings"),
                      positions=m.get("positions", 0 if m["arch"] == "llama" else None),
                      dropout=m.get("dropout"),
                      linear_bias=m.get("linear_bias") if m["arch"] == "gpt" else None,
                      rotary=m.get("rotary"))
    if m.get("n_experts"):
        shape = replace(shape, n_experts=m["n_experts"], top_k=m["top_k"],
                        moe_hidden=m["moe_hidden"], moe_imbalance=m["moe_imbalance"],
                        capacity_factor=m.get("capacity_factor"))
    return shape


def run_fixed(run: dict) -> tuple[dict, dict]:
    """A published run's layout and implementation keys for the search, and `unpriced` when
    its attention kernel has no rate on its GPU (then priced as FlashAttention-2),
    `attention_priced_as` when the kernel is priced as another (kernel_table `PRICED_AS`), and
    `attention_ratio_from` when its GPU's table borrows the kernel's ratio to FlashAttention-2
    from another GPU's (kernel_table `attention_ratio_from`)."""
    lay = run["layout"]
    fixed = {k: lay[k] for k in ("tp", "pp", "cp", "dp", "ep", "zero", "dp_replicate",
                                 "recompute", "sp", "v") if lay.get(k) is not None}
    if lay.get("schedule"):
        fixed["schedule"] = lay["schedule"]
    fixed["micro_batch"] = run["micro_batch"]
    impl = trainer_impl(run["trainer"])
    impl.update(run.get("implementation") or {})
    if impl.get("attention_kernel") == "cudnn":  # TE's cuDNN backend reads sequence-first
        impl["qkv_transpose"] = False
    unpriced = {}
    table = kernel_table.for_gpu(run["gpu"])
    kernel = impl.get("attention_kernel", "fa2")
    lender = table.borrowed_ratio(kernel) if table else None
    if table and table.priced_as(kernel) != kernel:
        unpriced["attention_priced_as"] = table.priced_as(kernel)
    if lender:
        unpriced["attention_ratio_from"] = lender
    elif kernel != "fa2" and not (table and table.prices(kernel)):
        impl["attention_kernel"] = "fa2"
        unpriced["unpriced"] = (f"attention_kernel={kernel}: no published rate for "
                                f"{run['gpu']}, priced as FlashAttention-2")
    # A row's `compile` says whether torch.compile was on. On, it fuses what the trainer
    # left unfused; off, the trainer's own kernels stand (hand-fused ones included).
    if run.get("compile"):
        impl["compile"] = True
    fixed.update(impl)
    return fixed, unpriced


def published_rows(path: Path = RUNS) -> list[dict]:
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    rows = []
    for run in data["runs"]:
        shape = run_shape(run)
        fixed, unpriced = run_fixed(run)
        row = _published_row(run, shape, fixed, {"trainer": run["trainer"],
                                                 "source": run["source"], **unpriced})
        if fixed.get("attention_kernel", "fa2") != "fa2":  # what FlashAttention-2 would give
            row["error_fa2_attention"] = _published_row(
                run, shape, {**fixed, "attention_kernel": "fa2"}, {})["error"]
        if fixed.get("zero") == 3:  # priced the other way: its collectives overlapped or not
            other = not fixed.get("fsdp_prefetch", True)
            key = "error_fsdp_overlap" if other else "error_fsdp_no_overlap"
            row[key] = _published_row(run, shape, {**fixed, "fsdp_prefetch": other},
                                      {})["error"]
        if fixed.get("float8", "none") != "none":  # its weights gathered the other way
            other = not fixed.get("float8_all_gather", False)
            key = f"error_float8_all_gather_{'on' if other else 'off'}"
            row[key] = _published_row(run, shape, {**fixed, "float8_all_gather": other},
                                      {})["error"]
        if run.get("nvlink_mesh"):  # its node priced as switched NVLink instead
            row["error_switched_nvlink"] = _published_row(
                {k: v for k, v in run.items() if k != "nvlink_mesh"}, shape, fixed, {})["error"]
        if fixed.get("expert_tp"):  # with meshloom's whole experts on every tp rank
            whole = _published_row(run, shape, {**fixed, "expert_tp": False}, {})
            row["error_whole_experts"] = whole["error"]
            row["memory_gb_whole_experts"] = whole["memory_gb"]
            row["fits_whole_experts"] = whole["fits"]
        if fixed.get("optimizer_state", "fp32") != "fp32":  # with the default 12 bytes
            default = _published_row(run, shape, {**fixed, "optimizer_state": "fp32"}, {})
            row["memory_gb_fp32_optimizer_state"] = default["memory_gb"]
            row["fits_fp32_optimizer_state"] = default["fits"]
        rows.append(row)
    return rows


def _published_row(run: dict, shape, fixed: dict, extra: dict) -> dict:
    variant = f"-{run['variant']}" if run.get("variant") else ""
    row = _row(f"published-{run['gpu']}{variant}", run["id"], run["gpu"], run["gpus"], shape,
               run["seq"], run["global_batch"], fixed, run["published"]["tokens_per_s_per_gpu"],
               flash=run.get("attention", "flash") == "flash",
               gpus_per_node=run.get("gpus_per_node", 8), extra=extra,
               memory_gb=run.get("gpu_memory_gb"), inter_gbps=run.get("inter_gbps"),
               nvlink_mesh=run.get("nvlink_mesh", 0))
    reserved = run["published"].get("peak_memory_gib_reserved")
    if reserved:  # the caching allocator's peak reservation: allocated bytes and its free blocks
        row["published_reserved_gb"] = round(reserved * 2**30 / 1e9, 2)
        row["memory_error_reserved"] = round(row["allocated_gb"] / row["published_reserved_gb"]
                                             - 1, 4)
    return row


def summarise(rows: list[dict]) -> dict:
    """Per set, per trainer within a published set (`SET / trainer`), and over all published
    rows."""
    out = {}
    by_trainer = sorted({f"{r['set']} / {r['trainer']}" for r in rows if "trainer" in r})
    for name in sorted({r["set"] for r in rows}) + by_trainer + ["all published"]:
        sel = [r for r in rows if r["set"] == name
               or name == f"{r['set']} / {r.get('trainer')}"
               or name == "all published" and not r["set"].startswith("meshloom-")]
        if not sel:
            continue
        errs = [abs(r["error"]) for r in sel]
        out[name] = {"rows": len(sel), "mean_abs_error": round(statistics.mean(errs), 4),
                     "max_abs_error": round(max(errs), 4),
                     "mean_error": round(statistics.mean(r["error"] for r in sel), 4),
                     "within_goal": statistics.mean(errs) <= GOAL_MEAN and max(errs) <= GOAL_MAX,
                     "all_fit": all(r["fits"] for r in sel)}
        alt = [abs(r["error_measured_kernels"]) for r in sel if "error_measured_kernels" in r]
        if alt:
            out[name].update(measured_kernels_rows=len(alt),
                             measured_kernels_mean_abs_error=round(statistics.mean(alt), 4),
                             measured_kernels_max_abs_error=round(max(alt), 4))
        for prefix, key in (("sustained_gemm", "error_sustained_gemm"),
                            ("power_duty", "error_power_duty"),
                            ("fsdp_no_overlap", "error_fsdp_no_overlap"),
                            ("fsdp_overlap", "error_fsdp_overlap"),
                            ("attention_full_clock", "error_attention_full_clock")):
            errs = [r[key] for r in sel if key in r]
            if errs:
                out[name].update({f"{prefix}_rows": len(errs),
                                  f"{prefix}_mean_error": round(statistics.mean(errs), 4),
                                  f"{prefix}_mean_abs_error": round(
                                      statistics.mean(abs(e) for e in errs), 4)})
        fsdp = [abs(r["error"]) for r in sel
                if "error_fsdp_no_overlap" in r or "error_fsdp_overlap" in r]
        if fsdp:  # the same rows as planned, to set beside the variants
            out[name]["fsdp_rows_mean_abs_error"] = round(statistics.mean(fsdp), 4)
        mem = [abs(r["memory_error"]) for r in sel if "memory_error" in r]
        if mem:
            out[name].update(memory_rows=len(mem), memory_mean_abs_error=round(
                statistics.mean(mem), 4), memory_max_abs_error=round(max(mem), 4))
    return out


def zero_checks() -> dict:
    shape = from_dims("gpt", 12288, 96, 96, 51200, positions=MEGATRON_SEQ)
    # DeepSpeed's ZeRO-3 runs of 2021 trained in fp16: their gradients crossed in 16 bits.
    got = [search(shape, make_cluster("a100-80g", n), MEGATRON_SEQ, 1536,
                  {"tp": 1, "pp": 1, "cp": 1, "zero": 3, "compile": True,
                   "grad_reduce_dtype": "bf16"}, flash=False, top=1)[0]
           .hw_tflops_per_gpu for n in (384, 768, 1536)]
    return {"zero_paper_7_5b_64_gpus_gb": [
        round(sum(model_state_bytes(7.5e9, 64, s, MIXED).values()) / 1e9, 1)
        for s in (0, 1, 2, 3)],
        "zero3_175b": {"gpus": [384, 768, 1536], "published_tflops": [144, 88, 44],
                       "predicted_tflops": [round(x, 1) for x in got]}}


def render(result: dict) -> str:
    """The validation tables of docs/plan-validation.md, from the result file alone."""
    lines = [BEGIN, "", "Written by `python benchmarks/planner_validation.py` from "
             "[validation.json](../benchmarks/results/planner/validation.json) "
             f"(commit {result['config']['git'].get('commit')}).", ""]
    head = "| set | run | GPUs | layout | published tok/s/GPU | predicted | error | fits |"
    lines += [head, "|" + "---|" * 8]
    for r in result["rows"]:
        lines.append(f"| {r['set']} | {r['id']} | {r['gpus']} | {r['layout']} | "
                     f"{r['published_tokens_per_s_per_gpu']:,.0f} | "
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {r['error']:+.1%} | "
                     f"{'yes' if r['fits'] else 'NO'} |")
    lines += ["", "| set | rows | mean abs error | max abs error | mean error | all fit | with the "
              "measured H100 table: mean / max abs | GEMMs at the sustained floor: mean | "
              "power priced by duty: mean / mean abs |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        alt = (f"{s['measured_kernels_mean_abs_error']:.1%} / "
               f"{s['measured_kernels_max_abs_error']:.1%}"
               if "measured_kernels_mean_abs_error" in s else "")
        hot = f"{s['sustained_gemm_mean_error']:+.1%}" if "sustained_gemm_mean_error" in s else ""
        duty = (f"{s['power_duty_mean_error']:+.1%} / {s['power_duty_mean_abs_error']:.1%}"
                if "power_duty_mean_error" in s else "")
        lines.append(f"| {name} | {s['rows']} | {s['mean_abs_error']:.1%} | "
                     f"{s['max_abs_error']:.1%} | {s['mean_error']:+.1%} | "
                     f"{'yes' if s['all_fit'] else 'NO'} | {alt} | {hot} | {duty} |")
    mem = [r for r in result["rows"] if "memory_error" in r]
    lines += ["", "Peak memory per GPU, the planner's allocated bytes against the CUDA allocator's "
              "`max_memory_allocated` (the benchmark frees its gradients before each step, the "
              "`meshloom train` loop keeps them):", "",
              "| run | layout | measured GB | predicted GB | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['id']} | {r['layout']} | {r['measured_peak_gb']:.2f} | "
              f"{r['allocated_gb']:.2f} | {r['memory_error']:+.1%} |" for r in mem]
    reserved = [r for r in result["rows"] if "memory_error_reserved" in r]
    lines += ["", "Published peaks, the allocator's peak reservation (`max_reserved`, which "
              "holds its free blocks too) against the planner's allocated bytes:", "",
              "| run | layout | published GB | predicted GB | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['id']} | {r['layout']} | {r['published_reserved_gb']:.2f} | "
              f"{r['allocated_gb']:.2f} | {r['memory_error_reserved']:+.1%} |" for r in reserved]
    lines += ["", END]
    return "\n".join(lines)


def _mean_abs(rows: list[dict]) -> float:
    return statistics.mean(abs(r["error"]) for r in rows)


def _max_abs(rows: list[dict]) -> float:
    return max(abs(r["error"]) for r in rows)


def _signed_mean(rows: list[dict]) -> float:
    return statistics.mean(r["error"] for r in rows)


def render_readme(result: dict) -> str:
    """The README's accuracy sentence, every figure read from the result file, so the front
    page cannot drift from validation.json (DESIGN principle 7)."""
    rows, summ = result["rows"], result["summary"]
    own, meg, h200 = summ["meshloom-h100"], summ["megatron-2021-a100"], summ["meshloom-h200"]
    nemo = summ["published-h100 / nemo"]
    a100 = {k: v for k, v in summ.items()
            if k.startswith(("published-a100-80g / ", "published-a100-40g / "))}
    low = min(v["mean_abs_error"] for v in a100.values())
    high = max(v["mean_abs_error"] for v in a100.values())
    a80 = summ["published-a100-80g"]
    worst80 = max((r for r in rows if r["set"] == "published-a100-80g"),
                  key=lambda r: abs(r["error"]))
    foundry = [r for r in rows if r["set"] == "published-h100" and r["trainer"] == "llm-foundry"]
    titan = [r for r in rows if r["set"] == "published-h100-96gb-500w"]
    kempner = [r for r in rows if r["set"] == "published-h200" and r["trainer"] == "KempnerForge"]
    float8 = [r for r in rows if r["set"].endswith("-float8")]
    f8_500w = [r for r in float8 if r["gpu"] == "h100-96gb"]
    f8_h200 = [r for r in float8 if r["gpu"] == "h200"]
    fit = all(v["all_fit"] for k, v in summ.items() if not k.startswith("meshloom-"))

    def bias(sel: list[dict]) -> str:
        m = _signed_mean(sel)
        return f"{abs(m):.0%} {'optimistic' if m > 0 else 'pessimistic'}"

    fits = "every" if fit else "NOT every"
    text = (
        f"Against {len(rows)} measured or published runs "
        "([benchmarks/results/planner/validation.json](benchmarks/results/planner/validation.json)"
        f"): our own 1B runs on one H100 within {own['max_abs_error']:.1%} in step time "
        f"(mean {own['mean_abs_error']:.1%}) and {own['memory_max_abs_error']:.1%} in peak "
        f"memory, and on one H200 within {h200['max_abs_error']:.1%} (the H100's compute "
        f"tables); Megatron-LM Table 1 (A100) mean {meg['mean_abs_error']:.1%}, worst "
        f"{meg['max_abs_error']:.1%}; NeMo's H100 runs (Llama 3.1 8B/70B/405B, GPT-3 175B, "
        f"Nemotron-4 340B, the Grok-1 314B mixture of experts) mean "
        f"{nemo['mean_abs_error']:.1%}, worst "
        f"{nemo['max_abs_error']:.1%}; other trainers' A100 "
        f"runs mean {low:.1%}-{high:.1%} per trainer (the A100 80GB set "
        f"{a80['mean_abs_error']:.1%}, worst {a80['max_abs_error']:.1%}, a "
        f"{worst80['trainer']} run); {fits} published layout that trained is predicted to fit; "
        f"published H100 FSDP runs from 2023 (llm-foundry, their Triton attention priced as "
        f"FlashAttention 1 at its A100 ratio) mean {_mean_abs(foundry):.1%}, worst "
        f"{_max_abs(foundry):.1%}, "
        f"torchtitan's runs on 500 W H100s {bias(titan)} on average; KempnerForge's "
        f"single-node H200 runs (2026) mean {_mean_abs(kempner):.1%}, worst "
        f"{_max_abs(kempner):.1%}; "
        f"torchtitan's Float8 runs "
        f"(fp8 GEMMs priced at a published fp8/bf16 ratio) {bias(f8_h200)} on H200s, "
        f"{bias(f8_500w)} on the 500 W H100s, worst {_max_abs(float8):.1%} (see "
        "[docs/plan-validation.md](docs/plan-validation.md), \"Known gaps\").")
    text = textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)
    return f"{README_BEGIN}\n{text}\n{README_END}"


def docs_text() -> str:
    """The planner's pages (docs/plan.md and docs/plan-*.md), whose prose the tests hold to the
    committed results."""
    return "\n".join(p.read_text() for p in sorted((HERE.parent / "docs").glob("plan*.md")))


def _replace(path: Path, begin: str, end: str, block: str) -> None:
    text = path.read_text()
    start, stop = text.index(begin), text.index(end) + len(end)
    path.write_text(text[:start] + block + text[stop:])


def write_doc(result: dict, doc: Path = DOC, readme: Path = README) -> None:
    _replace(doc, BEGIN, END, render(result))
    _replace(readme, README_BEGIN, README_END, render_readme(result))


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    rows = meshloom_h100_rows() + meshloom_h200_rows() + megatron_rows() + published_rows()
    result = {"rows": rows, "summary": summarise(rows),
              "goal": {"mean_abs_error": GOAL_MEAN, "max_abs_error": GOAL_MAX},
              **zero_checks(), "power": power_inputs(), "config": provenance()}
    out = write_result(result, args.out, _print_table)
    write_doc(json.loads(args.out.read_text()))
    write_accuracy(rows)
    return out


def write_accuracy(rows: list[dict], path: Path = accuracy.ACCURACY_FILE) -> None:
    """The per-GPU summary `meshloom plan` quotes under its table (plan/accuracy.py)."""
    path.write_text(json.dumps(accuracy.summarise(rows), indent=1) + "\n")


def _print_table(result: dict) -> None:
    for r in result["rows"]:
        print(f"{r['set']:>20} {r['id']:>40} {r['published_tokens_per_s_per_gpu']:>10.0f} "
              f"{r['predicted_tokens_per_s_per_gpu']:>10.0f} {r['error']:>+7.1%} "
              f"{'fits' if r['fits'] else 'NO FIT'}")
    for name, s in result["summary"].items():
        print(f"{name}: {s['rows']} rows, mean |error| {s['mean_abs_error']:.1%}, "
              f"max {s['max_abs_error']:.1%}, all fit: {s['all_fit']}")


if __name__ == "__main__":
    main()
