"""A second H100 session of llm-foundry's MPT benchmarks, held out: rows that decided nothing,
planned as the validation plans llm-foundry (published/llmfoundry_h100old.txt, h100old.md at
beb8dee: torch 2.0.1 / CUDA 11.8, Composer's PURE mixed precision, each setting run three
times). No hardware needed:

    python benchmarks/llmfoundry_h100old.py

It checks the validation's llm-foundry pricing on another session and stack, across 512 to
32768 tokens and 350M to 30B parameters: the Triton attention priced as FlashAttention 1
(kernel_table.PRICED_AS), the FSDP1 collectives waited on (plan/trainers.py). The 30B model at
8192 tokens, the validation's one llm-foundry row over 20%, is reported apart: whether this
session reproduces it says whether it is that run's own gap.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from meshloom.plan.search import search

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import parser, provenance, write_result  # noqa: E402
from llmfoundry_mb_sweep import parse as parse_columns  # noqa: E402
from llmfoundry_seq_sweep import planned_run, quoted_rows  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "planner" / "llmfoundry_h100old.json"
SOURCE = ("mosaicml/llm-foundry scripts/train/benchmarking/h100old.md at "
          "beb8dee6922c5e31d27a24a713a1315b4013185d")
TABLE = HERE / "published" / "llmfoundry_h100old.txt"
APART = ("mpt-30b", 8192)  # the validation's row over 20%, reported on its own


def parse(line: str) -> dict:
    """One row of h100old.md (larger_mb_1.md's columns and an image column last)."""
    row = parse_columns(line)
    if row["gpu"] != "h100" or "| amp_bf16 |" not in line:
        raise SystemExit(f"not an H100 bf16 row: {line.strip()}")
    return row


def predict(row: dict) -> dict:
    run, shape, fixed, cluster = planned_run(row)
    best = search(shape, cluster, run["seq"], run["global_batch"], fixed, top=1)[0]
    step = best.timing.step_time_s
    return {**{k: row[k] for k in ("model", "seq", "micro_batch", "grad_accum", "recompute",
                                   "tokens_per_s_per_gpu")},
            "predicted_tokens_per_s_per_gpu": round(best.tokens_per_s_per_gpu, 1),
            "error": round(best.tokens_per_s_per_gpu / row["tokens_per_s_per_gpu"] - 1, 4),
            "attention_share": round(best.timing.detail["compute_s"]["attention"] / step, 4),
            "memory_gb": round(best.memory.total / 1e9, 1), "quote": row["quote"]}


def summarise(rows: list[dict]) -> dict:
    def stats(sel: list[dict]) -> dict:
        errors = [r["error"] for r in sel]
        return {"rows": len(sel), "mean_abs_error": round(statistics.mean(map(abs, errors)), 4),
                "max_abs_error": round(max(map(abs, errors)), 4),
                "mean_error": round(statistics.mean(errors), 4)}

    apart = [r for r in rows if (r["model"], r["seq"]) == APART]
    rest = [r for r in rows if r not in apart]
    long = [r for r in rest if r["seq"] >= 16384]
    return {"all_but_30b_8192": stats(rest), "from_16384_tokens": stats(long),
            "30b_8192": stats(apart)}


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    rows = [predict(parse(line)) for line in quoted_rows(TABLE)]
    result = {"source": SOURCE, "rows": rows, "summary": summarise(rows),
              "note": "Held out: none of these rows is in runs.json. Planned as validation.json "
                      "plans llm-foundry (its --trainer keys: Triton attention priced as "
                      "FlashAttention 1, FSDP1 collectives waited on); PURE and the validation's "
                      "DEFAULT mixed precision both gathered and reduced in bf16 then",
              "config": provenance()}

    def show(r: dict) -> None:
        for row in r["rows"]:
            print(f"{row['model']:<8} seq {row['seq']:>6}  published "
                  f"{row['tokens_per_s_per_gpu']:>8.0f}  planned "
                  f"{row['predicted_tokens_per_s_per_gpu']:>8.0f}  error {row['error']:+7.1%}  "
                  f"attention {row['attention_share']:5.1%}  {row['memory_gb']:5.1f} GB")
        for name, s in r["summary"].items():
            print(f"{name}: {s['rows']} rows, mean |error| {s['mean_abs_error']:.1%}, "
                  f"max {s['max_abs_error']:.1%}, mean {s['mean_error']:+.1%}")

    return write_result(result, args.out, show)


if __name__ == "__main__":
    main()
