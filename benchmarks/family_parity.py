"""How close each model family trains to its single-process run, per layout: the largest
relative per-step loss difference and the largest weight difference after the run.

    python benchmarks/family_parity.py

The parity tests (tests/test_family_*.py) assert bounds (loss within 1e-5 relative, weights
within rtol 1e-5 / atol 1e-6); this records the figures themselves, on the tiny preset of every
family, 3 steps, fp32, CPU, Gloo ranks. AdamW eps is 1e-5, as in tests/test_family_variants.py
(it keeps last-bit noise of near-cancelling gradients from being amplified into the weights).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import parser, provenance, write_result  # noqa: E402

from meshloom.config import load_config  # noqa: E402
from meshloom.launch import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "family_parity.json"
FAMILIES = {"llama": "tiny", "gpt2": "gpt2-tiny", "mistral": "mistral-tiny",
            "qwen2": "qwen2-tiny", "qwen3": "qwen3-tiny"}
LAYOUTS = {  # name -> (ranks, overrides)
    "ddp": (2, []),
    "zero3": (2, ["parallel.zero_stage=3"]),
    "hsdp": (4, ["parallel.zero_stage=3", "parallel.dp_replicate=2"]),
    "tp2+sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1"]),
    "pp2 1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.dp_shard=1"]),
    "cp2": (2, ["parallel.cp=2", "parallel.dp_shard=1"]),
    "dp2 x tp2 x pp2": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2",
                            "parallel.zero_stage=1"]),
    "dp2 x tp2 x pp2 x cp2": (16, ["parallel.pp=2", "parallel.tp=2", "parallel.cp=2",
                                   "parallel.dp_shard=2", "parallel.zero_stage=1"]),
}
COMMON = ["train.steps=3", "train.eval_every=0", "train.eval_sequences=0",
          "train.sample_tokens=0", "train.global_batch=8", "train.warmup_steps=1",
          "train.eps=1e-5"]


def _run(run_dir: str, cache: str, overrides: list[str]) -> dict:
    from meshloom.train import train

    cfg = load_config(ROOT / "configs" / "tiny.toml",
                      [f"run.dir={run_dir}", f"data.cache_dir={cache}", *COMMON, *overrides])
    r = train(cfg, keep_model=True)
    strategy = r.strategy
    state = strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else \
        {k: v.detach().clone() for k, v in r.model.state_dict().items()}
    return {"losses": r.losses, "state": state}


def _model(family: str, layout: str) -> list[str]:
    ov = [f"model.preset={FAMILIES[family]}"]
    if family == "mistral" and any(o.startswith("parallel.cp=") for o in LAYOUTS[layout][1]):
        # a window the ring attention can apply exactly (>= data.seq_len)
        ov.append("model.sliding_window=64")
    return ov


def _compare(ref: dict, ranks: list[dict]) -> dict:
    loss = max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], ranks[0]["losses"],
                                                  strict=True))
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:  # pipeline ranks hold their own stages
        merged.update(r["state"])
    weight = max(float((merged[n] - w).abs().max()) for n, w in ref["state"].items()
                 if n in merged)
    return {"max_rel_loss_diff": loss, "max_abs_weight_diff": weight,
            "weights_compared": sum(n in merged for n in ref["state"])}


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="family-parity-"))
    cache = str(tmp / "cache")
    rows = []
    for family in FAMILIES:
        refs: dict[tuple, dict] = {}
        for layout, (ranks, overrides) in LAYOUTS.items():
            model = _model(family, layout)
            if tuple(model) not in refs:
                refs[tuple(model)] = run_ranks(_run, 1, str(tmp / f"{family}-ref{len(refs)}"),
                                               cache, model)[0]
            got = run_ranks(_run, ranks, str(tmp / f"{family}-{layout}"), cache,
                            [*model, *overrides], timeout=600)
            row = {"family": family, "layout": layout, "ranks": ranks,
                   **_compare(refs[tuple(model)], got)}
            rows.append(row)
            print(f"{family:8s} {layout:16s} loss {row['max_rel_loss_diff']:.1e}  "
                  f"weights {row['max_abs_weight_diff']:.1e}", flush=True)
    result = {"config": {"families": FAMILIES, "layouts": {k: v[1] for k, v in LAYOUTS.items()},
                         "common": COMMON, **provenance()},
              "rows": rows}
    return write_result(result, args.out, lambda r: None)


if __name__ == "__main__":
    main()
