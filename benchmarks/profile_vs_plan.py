"""A profiled `meshloom train` step against the planner's breakdown of the same step, kernel
class by kernel class: where the planner's time goes wrong (docs/kernel-tables.md). Reads a
run's `profile/rank0_kernels.json` (`run.profile_start`), needs no GPU:

    python benchmarks/profile_vs_plan.py \\
        --profile benchmarks/measured/h100-2026-11-26/profile_kernels.json \\
        --kernels benchmarks/measured/h100-2026-11-26/h100-kernels.json

The run is docs/gpu.md's: llama3-1b, 8 x 2048 tokens, one H100, compiled, cuDNN attention.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshloom.plan.compute import rates_for, tied_gradient_add
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.kernel_table import load
from meshloom.plan.layout import Layout
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate
from meshloom.plan.step_kernels import head_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import provenance, write_result  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "planner" / "profile_vs_plan_llama1b.json"
# Profiler ranges that are not kernels (their device time is the kernels' inside them).
ANNOTATIONS = ("ProfilerStep", "Optimizer.step", "Optimizer.zero_grad")
# The token-table lookup (`index_select`'s gather) and `embedding_dense_backward`: the zero
# fill of the table's gradient, the sort of the ids and the per-id partial sums scattered.
EMBEDDING_KERNELS = ("vectorized_gather_kernel", "fillfunctor", "radix_sort", "unique_by_key",
                     "partial_segment", "partials_per_segment", "compute_grad_weight",
                     "sum_and_scatter")


def kernel_class(name: str) -> str:
    low = name.lower()
    if "sdpa" in low or "flash" in low or "fmha" in low or "cudnn" in low:
        return "attention"
    if "fusedoptimizer" in low or "adam" in low or "lpnorm" in low:
        return "optimizer"  # the gradient norm too: the planner prices it with the step
    if "cudafunctor_add<float>" in low:
        return "gradient add"  # the tied token table's two gradients summed
    if "nvjet" in low or "gemm" in low or "cutlass" in low or "xmma" in low:
        return "gemm"
    if "log_softmax" in low or "nll_loss" in low:
        return "loss"
    if any(k in low for k in EMBEDDING_KERNELS):
        return "embedding"
    if "triton" in low:
        return "elementwise"
    return "other"


def measured_ms(profile: dict) -> dict:
    out: dict[str, float] = {}
    for row in profile["kernels"]:
        if row["name"].startswith(ANNOTATIONS):
            continue
        c = kernel_class(row["name"])
        out[c] = out.get(c, 0.0) + row["total_ms"] / profile["steps"]
    return out


def planned_ms(kernels: str) -> dict:
    shape = PRESETS["llama3-1b"]
    cluster = make_cluster("h100", 1, kernels=kernels)
    lay, impl = Layout(micro_batch=8), Implementation(compile=True, attention_kernel="cudnn")
    ev = evaluate(shape, lay, cluster, 2048, 8, impl=impl)
    c = ev.timing.detail["compute_s"]
    table = load(kernels)
    head = head_gemm(shape, 8 * 2048, 1)
    head_s = sum(table.gemm_seconds(g.m, g.n, g.k, g.count) for g in (head, *head.backward()))
    tied_s = tied_gradient_add(shape, lay, rates_for(cluster), impl, 4)
    return {"gemm": (c["gemm"] + head_s) * 1e3, "attention": c["attention"] * 1e3,
            "elementwise": c["elementwise"] * 1e3,
            "loss": (c["head_and_loss"] - head_s - tied_s) * 1e3, "gradient add": tied_s * 1e3,
            "embedding": c["embedding"] * 1e3,
            "optimizer": ev.timing.detail["optimizer_s"] * 1e3,
            "step": ev.timing.step_time_s * 1e3}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--kernels", required=True)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    got = measured_ms(json.loads(args.profile.read_text()))
    want = planned_ms(args.kernels)
    rows = [{"class": c, "profiled_ms": round(got.get(c, 0.0), 2),
             "planned_ms": round(want[c], 2) if c in want else None,
             "ratio": round(got.get(c, 0.0) / want[c], 3) if want.get(c) else None}
            for c in ("gemm", "attention", "elementwise", "loss", "gradient add", "embedding",
                      "optimizer", "other")]
    result = {"run": "llama3-1b, 8 x 2048 tokens, one H100, compile, cuDNN attention",
              "profile": str(args.profile), "kernels": str(args.kernels),
              "profiled_kernels_ms_per_step": round(sum(got.values()), 2),
              "planned_step_ms": round(want["step"], 2), "rows": rows,
              "note": "'optimizer' holds the fused AdamW kernel and the gradient norm (foreach), "
                      "as the planner prices them together; 'gradient add' the float adds, "
                      "chiefly the tied token table's two gradients summed; 'embedding' the "
                      "lookup's gather and embedding_dense_backward's fill, sort and scatter "
                      "(every fp32 fill is counted here: the table's gradient is the large "
                      "one); 'other' copies and small kernels", "config": provenance()}

    def show(r: dict) -> None:
        for row in r["rows"]:
            print(f"{row['class']:<12} profiled {row['profiled_ms']:8.2f} ms  planned "
                  f"{row['planned_ms'] if row['planned_ms'] is not None else '-':>8}  "
                  f"ratio {row['ratio']}")
    return write_result(result, args.out, show)


if __name__ == "__main__":
    main()
