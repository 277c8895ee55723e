"""Do llm-foundry's FSDP1 collectives hide behind compute? Its own controlled sweep says no:
one session on 8 A100s, the same MPT model and settings, only the micro-batch changed
(published/llmfoundry_mb_sweep.txt). No hardware needed:

    python benchmarks/llmfoundry_mb_sweep.py

Every micro-batch gathers each unit twice and reduce-scatters it once, whatever its size, so
the share of the step those collectives cost falls as the micro-batch grows only if they are
not hidden. Each row is planned both ways: as the validation plans llm-foundry (collectives
waited on, `fsdp_prefetch=false`: plan/trainers.py) and with them overlapped
(`fsdp_prefetch=true`, the planner's default). The ratio of each row's throughput to the same
model's at one sequence per GPU does not depend on the kernel rates' level, only on how the
step's fixed and per-token parts are priced: that is what tells the two apart.

Then a check on rows that decided nothing: every row of llm-foundry's H100 table at 2048 tokens
on more than 8 GPUs that the validation does not hold (published/llmfoundry_h100_multinode.txt),
planned both ways.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from meshloom.plan.search import search

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import parser, provenance, write_result  # noqa: E402
from llmfoundry_seq_sweep import parse as parse_readme  # noqa: E402
from llmfoundry_seq_sweep import planned_run  # noqa: E402
from llmfoundry_seq_sweep import quoted_rows as _quoted  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "planner" / "llmfoundry_mb_sweep.json"
SOURCE = ("mosaicml/llm-foundry scripts/train/benchmarking/larger_mb_1.md at "
          "beb8dee6922c5e31d27a24a713a1315b4013185d")
TABLE = HERE / "published" / "llmfoundry_mb_sweep.txt"
HELD_OUT = HERE / "published" / "llmfoundry_h100_multinode.txt"  # README.md@061f2c7 rows
GPUS = {"a100_80gb": "a100-80g", "h100_80gb": "h100"}
PRICINGS = {"waited": False, "overlapped": True}  # name -> fsdp_prefetch


def quoted_rows(path: Path = TABLE) -> list[str]:
    return _quoted(path)


def parse(line: str) -> dict:
    """One row of larger_mb_1.md (its columns, h100old.md's too: no model-FLOP column, unlike
    the README's)."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return {"model": f"mpt-{cells[0]}", "seq": int(cells[1]), "gpus": int(cells[2]),
            "gpu": GPUS[cells[3]], "micro_batch": int(cells[6]), "grad_accum": int(cells[7]),
            "tokens_per_s": float(cells[10]), "tokens_per_s_per_gpu": float(cells[11]),
            "recompute": cells[16] == "True", "cpu_offload": cells[17] == "True",
            "params": int(cells[18]), "quote": line.strip()}


def predict(row: dict, fsdp_prefetch: bool) -> float:
    """Planned tokens/s per GPU for the row, its collectives overlapped or waited on."""
    run, shape, fixed, cluster = planned_run(row)
    best = search(shape, cluster, run["seq"], run["global_batch"],
                  {**fixed, "fsdp_prefetch": fsdp_prefetch}, top=1)[0]
    return best.tokens_per_s_per_gpu


def both_ways(row: dict) -> dict:
    """The published row with its throughput planned under each pricing, and the errors."""
    planned = {name: predict(row, flag) for name, flag in PRICINGS.items()}
    return {**{k: row[k] for k in ("model", "gpu", "gpus", "seq", "micro_batch", "grad_accum",
                                   "tokens_per_s_per_gpu", "quote")},
            **{f"planned_{n}": round(v, 1) for n, v in planned.items()},
            **{f"error_{n}": round(v / row["tokens_per_s_per_gpu"] - 1, 4)
               for n, v in planned.items()}}


def sweep() -> list[dict]:
    rows = sorted((parse(line) for line in quoted_rows()),
                  key=lambda r: (r["model"], r["micro_batch"]))
    out = [both_ways(row) for row in rows]
    for row in out:  # each throughput over its model's at the smallest micro-batch
        first = min((r for r in out if r["model"] == row["model"]),
                    key=lambda r: r["micro_batch"])
        row["ratio_published"] = round(row["tokens_per_s_per_gpu"]
                                       / first["tokens_per_s_per_gpu"], 4)
        for n in PRICINGS:
            row[f"ratio_{n}"] = round(row[f"planned_{n}"] / first[f"planned_{n}"], 4)
            row[f"ratio_error_{n}"] = round(row[f"ratio_{n}"] / row["ratio_published"] - 1, 4)
    return out


def fixed_cost(rows: list[dict]) -> dict:
    """Per model, the seconds a micro-batch costs whatever its size, from the published rows
    at its two smallest micro-batches: seconds per token per GPU are a + b / micro-batch, so
    b = (1/t1 - 1/t2) / (1/m1 - 1/m2), times the tokens of a sequence."""
    out = {}
    for model in sorted({r["model"] for r in rows}):
        a, b = sorted((r for r in rows if r["model"] == model),
                      key=lambda r: r["micro_batch"])[:2]
        per_token = ((1 / a["tokens_per_s_per_gpu"] - 1 / b["tokens_per_s_per_gpu"])
                     / (1 / a["micro_batch"] - 1 / b["micro_batch"]))
        out[model] = round(per_token * a["seq"], 4)
    return out


def held_out() -> list[dict]:
    """The H100 table's multi-node rows at 2048 tokens that validation.json does not hold,
    planned both ways."""
    return [both_ways(parse_readme(line)) for line in quoted_rows(HELD_OUT)]


def _errors(rows: list[dict], pricing: str) -> dict:
    errs = [abs(r[f"error_{pricing}"]) for r in rows]
    return {"mean_abs_error": round(statistics.mean(errs), 4),
            "max_abs_error": round(max(errs), 4)}


def summarise_held_out(rows: list[dict]) -> dict:
    return {n: {"rows": len(rows), **_errors(rows, n)} for n in PRICINGS}


def summarise(rows: list[dict]) -> dict:
    out = {"published_fixed_s_per_micro_batch": fixed_cost(rows)}
    for n in PRICINGS:
        ratios = [abs(r[f"ratio_error_{n}"]) for r in rows if r["ratio_published"] != 1]
        out[n] = {**_errors(rows, n), "max_abs_ratio_error": round(max(ratios), 4)}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    rows = sweep()
    others = held_out()
    result = {"source": SOURCE, "rows": rows, "summary": summarise(rows),
              "held_out_source": "mosaicml/llm-foundry scripts/train/benchmarking/README.md at "
                                 "061f2c7 (runs.json source llmfoundry-bench)",
              "held_out": others, "held_out_summary": summarise_held_out(others),
              "note": "waited: fsdp_prefetch=false (how the validation plans llm-foundry); "
                      "overlapped: fsdp_prefetch=true. ratio_*: a row's tokens/s per GPU over "
                      "its model's at the smallest micro-batch",
              "config": provenance()}

    def show(r: dict) -> None:
        print(f"{'model':<8}{'mb':>3}{'published':>10}{'ratio':>7}  waited (ratio)    "
              f"overlapped (ratio)")
        for row in r["rows"]:
            print(f"{row['model']:<8}{row['micro_batch']:>3}{row['tokens_per_s_per_gpu']:>10.0f}"
                  f"{row['ratio_published']:>7.3f}  {row['error_waited']:+6.1%} "
                  f"({row['ratio_waited']:.3f})   {row['error_overlapped']:+6.1%} "
                  f"({row['ratio_overlapped']:.3f})")
        print("published seconds per micro-batch whatever its size:",
              r["summary"]["published_fixed_s_per_micro_batch"])
        for n in PRICINGS:
            s = r["summary"][n]
            print(f"{n}: mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%}, "
                  f"ratios off by at most {s['max_abs_ratio_error']:.1%}")
        print("held out: H100 rows at 2048 tokens on more than 8 GPUs")
        for row in r["held_out"]:
            print(f"{row['model']:<9}{row['gpus']:>3} GPUs {row['tokens_per_s_per_gpu']:>8.0f}  "
                  f"waited {row['error_waited']:+6.1%}  overlapped {row['error_overlapped']:+6.1%}")
        for n, s in r["held_out_summary"].items():
            print(f"{n}: mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%}")
    return write_result(result, args.out, show)


if __name__ == "__main__":
    main()
