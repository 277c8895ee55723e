"""DDP against FSDP (ZeRO-3) for GPT-2 Large and XL on 2 x 24 GB, from the planner: for each
model, strategy and per-GPU micro-batch, `meshloom plan --json` with the layout pinned, and
whether it fits. No hardware is measured (docs/gpt2_fsdp.md reads the result).

    python benchmarks/gpt2_fsdp_plan.py --out benchmarks/results/planner/gpt2_fsdp.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _launch import provenance  # noqa: E402
from planner_examples import printed  # noqa: E402

MODELS = ("gpt2-large", "gpt2-xl")
STRATEGIES = {"ddp": 0, "fsdp": 3}
GB = 1e9


def plan_args(model: str, zero: int, micro: int, gpu: str, seq: int) -> list[str]:
    # FSDP as the experiment ran it, resharding after forward (the search would otherwise
    # hold the units where that fits: docs/plan.md, Search).
    held = ",reshard_after_forward=true" if zero == 3 else ""
    return ["plan", "--model", model, "--gpus", "2", "--gpu", gpu, "--seq", str(seq),
            "--global-batch", str(2 * micro), "--dtype", "bf16", "--top", "1", "--json",
            "--fix", f"tp=1,pp=1,dp=2,zero={zero},micro_batch={micro},recompute=none{held}"]


def run_plan(argv: list[str]) -> dict:
    return json.loads(printed(argv))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="titan-rtx-24g")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--max-micro-batch", type=int, default=16)
    p.add_argument("--out", type=Path, default=HERE / "results" / "planner" / "gpt2_fsdp.json")
    args = p.parse_args(argv)
    rows, best = [], {}
    for model in MODELS:
        for strategy, zero in STRATEGIES.items():
            for micro in range(1, args.max_micro_batch + 1):
                cmd = plan_args(model, zero, micro, args.gpu, args.seq)
                c = run_plan(cmd)["candidates"][0]
                mem = c["memory_per_gpu_bytes"]
                rows.append({"model": model, "strategy": strategy, "zero": zero,
                             "micro_batch": micro, "fits": c["fits"],
                             "memory_gb": round(mem["total"] / GB, 2),
                             "model_states_gb": round((mem["params"] + mem["grads"]
                                                       + mem["optimizer"]) / GB, 2),
                             "activations_gb": round(mem["activations"] / GB, 2),
                             "tokens_per_s_per_gpu": round(c["tokens_per_s_per_gpu"]),
                             "command": "meshloom " + " ".join(cmd)})
                if c["fits"]:
                    best[f"{model} {strategy}"] = micro
            best.setdefault(f"{model} {strategy}", 0)
    result = {"config": {"gpus": 2, "gpu": args.gpu, "seq": args.seq, "dtype": "bf16",
                         "recompute": "none", "models": list(MODELS), **provenance(),
                         "command": "python benchmarks/gpt2_fsdp_plan.py " + " ".join(
                             argv if argv is not None else sys.argv[1:])},
              "largest_micro_batch_that_fits": best, "rows": rows,
              "note": "analytical: the planner's memory model (docs/plan.md), no hardware "
                      "measured; micro_batch is sequences per GPU per forward pass"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for key, micro in best.items():
        print(f"{key}: largest micro-batch that fits {micro}")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
