"""Where llm-foundry's H100 rows part from the planner: the same MPT models across sequence
length, on the H100 and on the A100 (one benchmark table, one software stack), predicted as
the validation predicts them (docs/plan-validation.md, "Known gaps"): the 1B and 3B models from
512 to 32768 tokens, and the 30B model at 4096 and 8192 tokens on both GPUs (the validation's
one llm-foundry row over 20% and its A100 twin). No hardware needed:

    python benchmarks/llmfoundry_seq_sweep.py

For each published row: the planner's error and, if attention alone were to explain it (the
rest of the step priced as it is), how much slower attention would have to run, as a
FlashAttention-convention rate. A gap that attention explains shrinks with the sequence
length as attention's share does; one that stays at short sequences lies elsewhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshloom.plan.hardware import Cluster, make_cluster
from meshloom.plan.models import ModelShape
from meshloom.plan.search import search

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import parser, provenance, write_result  # noqa: E402
from planner_validation import RUNS, run_fixed, run_shape  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "planner" / "llmfoundry_seq_sweep.json"
SOURCE = "llmfoundry-bench"  # benchmarks/published/runs.json: README.md@061f2c7, both tables
# Rows of llm-foundry's H100 and A100 80 GB tables, quoted as published (columns named there).
TABLE = HERE / "published" / "llmfoundry_seq_sweep.txt"
GPUS = {"h100_80gb": "h100", "a100_80gb": "a100-80g"}


def quoted_rows(path: Path = TABLE) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("|")]


def parse(line: str) -> dict:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return {"model": f"mpt-{cells[0]}", "seq": int(cells[1]), "gpus": int(cells[2]),
            "gpu": GPUS[cells[3]], "micro_batch": int(cells[7]), "grad_accum": int(cells[8]),
            "tokens_per_s_per_gpu": float(cells[12]), "recompute": cells[17] == "True",
            "params": int(cells[19]), "quote": line.strip()}


def as_run(row: dict) -> dict:
    """The row as a runs.json run: the validation's run of the same model on the same GPU
    (its dimensions, trainer and implementation) at this row's length and batch; on another
    GPU's run of the model where the validation has none on this one (the dimensions are the
    model's, the GPU the row's)."""
    runs = [r for r in json.loads(RUNS.read_text())["runs"]
            if r["model"]["name"] == row["model"] and r["trainer"] == "llm-foundry"]
    base = next((r for r in runs if r["gpu"] == row["gpu"]), None) or runs[0]
    return {**base, "gpu": row["gpu"], "seq": row["seq"],
            "gpus": row["gpus"],
            "micro_batch": row["micro_batch"],
            "global_batch": row["micro_batch"] * row["grad_accum"] * row["gpus"],
            "model": {**base["model"], "positions": row["seq"]},  # learned, max_seq_len rows
            "layout": {**base["layout"], "dp": row["gpus"],
                       "recompute": "full" if row["recompute"] else "none"}}


def planned_run(row: dict) -> tuple[dict, ModelShape, dict, Cluster]:
    """The row's run, model, implementation keys and cluster, as the validation plans it; the
    table's own parameter count checks the model's dimensions."""
    run = as_run(row)
    shape = run_shape(run)
    if shape.params != row["params"]:
        raise SystemExit(f"{row['model']} at {row['seq']}: {shape.params} parameters, the "
                         f"table says {row['params']}")
    fixed, _ = run_fixed(run)
    return run, shape, fixed, make_cluster(run["gpu"], run["gpus"], run.get("gpus_per_node", 8))


def predict(row: dict) -> dict:
    run, shape, fixed, cluster = planned_run(row)
    # Attention FLOPs as FlashAttention counts them (causal: half of 4·s²·d per head),
    # forward, the recompute's forward, and a backward of 2.5 forwards.
    passes = 1 + (1 if row["recompute"] else 0) + 2.5
    seq = run["seq"]
    flops = (run["global_batch"] / run["gpus"]) * shape.layers * 2 * seq * seq * shape.hidden \
        * passes

    def read(keys: dict) -> tuple[float, float, float, float | None]:
        """Error, attention share and rate planned, and the rate that would close the row."""
        best = search(shape, cluster, run["seq"], run["global_batch"], keys, top=1)[0]
        step = best.timing.step_time_s
        attention = best.timing.detail["compute_s"]["attention"]
        needed = step * best.tokens_per_s_per_gpu / row["tokens_per_s_per_gpu"] \
            - (step - attention)
        return (best.tokens_per_s_per_gpu / row["tokens_per_s_per_gpu"] - 1, attention / step,
                flops / attention / 1e12, flops / needed / 1e12 if needed > 0 else None)

    error, share, planned, close = read(fixed)
    # As planned before llm-foundry's FSDP collectives were priced as waited on (trainers.py).
    error_o, _, _, close_o = read({**fixed, "fsdp_prefetch": True})
    return {**{k: row[k] for k in ("model", "gpu", "seq", "micro_batch", "grad_accum",
                                   "recompute", "tokens_per_s_per_gpu")},
            "predicted_tokens_per_s_per_gpu": round(
                row["tokens_per_s_per_gpu"] * (1 + error), 1),
            "error": round(error, 4), "attention_share": round(share, 4),
            "attention_tflops_planned": round(planned, 1),
            "attention_tflops_to_close": round(close, 1) if close else None,
            "error_fsdp_overlap": round(error_o, 4),
            "attention_tflops_to_close_fsdp_overlap": round(close_o, 1) if close_o else None,
            "attention_kernel": fixed.get("attention_kernel", "fa2"), "quote": row["quote"]}


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    rows = [predict(parse(line)) for line in quoted_rows()]
    rows.sort(key=lambda r: (r["gpu"], r["model"], r["seq"]))
    result = {"source": SOURCE, "rows": rows,
              "note": "Planned as validation.json plans llm-foundry (FSDP collectives waited "
                      "on; error_fsdp_overlap and attention_tflops_to_close_fsdp_overlap: with "
                      "them overlapped). Attention priced as in validation.json: the Triton kernel "
                      "as FlashAttention 1 (kernel_table.PRICED_AS; no benchmark gives its own "
                      "rate), A100 rows at FlashAttention 1's published A100 rate, H100 rows at "
                      "FlashAttention-2's H100 rate times FlashAttention 1's A100 ratio to it "
                      "(h100.json attention_ratio_from); attention_tflops_to_close does not "
                      "depend on that price",
              "config": provenance()}

    def show(r: dict) -> None:
        for row in r["rows"]:
            print(f"{row['gpu']:<9} {row['model']:<7} seq {row['seq']:>6}  error "
                  f"{row['error']:+7.1%}  attention {row['attention_share']:5.1%} of the step, "
                  f"{row['attention_tflops_planned']:6.1f} TF/s planned, "
                  f"{row['attention_tflops_to_close']} to close the gap")
    return write_result(result, args.out, show)


if __name__ == "__main__":
    main()
