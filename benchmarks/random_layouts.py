"""Parity over randomly drawn layouts: each draw combines the parallel axes (tp, pp, cp,
dp_replicate, dp_shard, ep) with the options that change how a step runs (ZeRO stage, sequence
parallel, pipeline schedule and micro-batches, gradient accumulation, recompute, resharding,
ZeRO-3's whole-gradient reduce_once),
on the tiny preset of a random family, and trains it on 2 or 4 Gloo ranks against the same
family's single-process run.

    python benchmarks/random_layouts.py --layouts 300 --seed 0
    python benchmarks/random_layouts.py --layouts 100 --dtype bf16
    python benchmarks/random_layouts.py --layouts 20 --compile

The parity tests check a fixed matrix; this samples the combinations between its points. A draw
the pre-launch validation refuses is counted as refused, with its one-line reason; a draw it
accepts must train. Per draw the result records the largest relative per-step difference of the
loss and of the global gradient norm (the norm catches a gradient scaled wrongly, which AdamW
would hide from the losses, tests/conftest.py). Bounds: fp32 as DESIGN.md's parity rule (loss
1e-5; norm 1e-5 at the first step and 1e-4 after, tests/conftest.py `assert_same_grad_norms`);
bf16 as tests/test_mixed_precision_layouts.py (2e-3, 1e-2), against the fp32 run as there. In
bf16 each draw is also compared with one process in bf16 (`same_dtype`; that process computes
under autocast, while ZeRO stages compute with bf16 working parameters,
docs/mixed-precision.md), and the summary gives how far that one process lies from fp32 per
family.
Exit status 1 if a draw exceeds its bound or an accepted draw fails.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import parser, provenance, write_result  # noqa: E402

from meshloom.config import ConfigError, load_config  # noqa: E402
from meshloom.launch import RankError, run_ranks  # noqa: E402
from meshloom.parallel.pipeline_schedule import INTERLEAVED, SCHEDULES  # noqa: E402
from meshloom.validation import validate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cpu-2core-x86_64"
FAMILIES = {"llama": "tiny", "gpt2": "gpt2-tiny", "mistral": "mistral-tiny",
            "qwen2": "qwen2-tiny", "qwen3": "qwen3-tiny", "mixtral": "mixtral-tiny"}
MODEL_EXTRA = {  # dropout off (its masks differ by layout); a window ring attention applies
    "gpt2": ["model.dropout=0.0"], "mistral": ["model.sliding_window=64"]}
COMMON = ["train.steps=4", "train.eval_every=0", "train.eval_sequences=0",
          "train.sample_tokens=0", "train.warmup_steps=1", "train.eps=1e-6",
          "run.checkpoint_every=0", "run.device=cpu"]
BOUNDS = {"fp32": {"loss": 1e-5, "norm_first": 1e-5, "norm_later": 1e-4},
          "bf16": {"loss": 2e-3, "norm_first": 1e-2, "norm_later": 1e-2}}


def draw(rng: random.Random) -> tuple[str, int, list[str]]:
    """(family, ranks, overrides) of one random layout."""
    family = rng.choice(list(FAMILIES))
    world = rng.choice((2, 4, 4))
    axes = {"tp": 1, "pp": 1, "cp": 1, "dp_replicate": 1}
    room = world if rng.random() < 0.4 else world // 2  # else keep a dp_shard of 2 or more
    for axis in rng.sample(list(axes), len(axes)):
        if room > 1 and rng.random() < 0.5:
            axes[axis], room = 2, room // 2
    shard = world // (axes["tp"] * axes["pp"] * axes["cp"] * axes["dp_replicate"])
    ov = [f"parallel.{a}={v}" for a, v in axes.items()] + [f"parallel.dp_shard={shard}"]
    zero = rng.choice((0, 1, 2, 3)) if shard > 1 else 0
    ov.append(f"parallel.zero_stage={zero}")
    if axes["tp"] > 1 and rng.random() < 0.5:
        ov.append("parallel.sequence_parallel=true")
    if axes["pp"] > 1:
        schedule = rng.choice(SCHEDULES)
        ov.append(f"parallel.pp_schedule={schedule}")
        if schedule in INTERLEAVED:
            ov.append("parallel.pp_virtual_stages=2")
        ov.append(f"parallel.pp_microbatches={rng.choice((0, 2, 4))}")
    if family == "mixtral" and rng.random() < 0.8:
        ov.append(f"parallel.ep={rng.choice((2, 2, 4))}")
    if rng.random() < 0.4:
        ov.append(f"train.micro_batch={rng.choice((1, 2, 4))}")
    if rng.random() < 0.4:
        ov.append(f"train.activation_checkpointing={rng.choice(('selective', 'full'))}")
    if rng.random() < 0.3:
        ov.append(f"parallel.reshard_after_forward={rng.choice(('true', 'false'))}")
    if zero == 3 and rng.random() < 0.5:
        ov.append("parallel.reduce_once=true")
    return family, world, ov


def _model(family: str) -> list[str]:
    return [f"model.preset={FAMILIES[family]}", *MODEL_EXTRA.get(family, [])]


def _config(run_dir: str, cache: str, overrides: list[str]):
    return load_config(ROOT / "configs" / "tiny.toml",
                       [f"run.dir={run_dir}", f"data.cache_dir={cache}", *COMMON, *overrides])


def _train(run_dir: str, cache: str, overrides: list[str]) -> dict:
    from meshloom.train import train

    r = train(_config(run_dir, cache, overrides))
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {"losses": r.losses, "norms": [json.loads(line)["grad_norm"] for line in lines]}


def _rel(ref: list[float], got: list[float]) -> list[float]:
    return [abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True)]


def _covered(rows: list[dict]) -> dict[str, int]:
    """How many trained draws used each axis at 2 or more and each option."""
    def count(test) -> int:
        return sum(any(test(o) for o in r["overrides"]) for r in rows)
    out = {a: count(lambda o, a=a: o.startswith(f"parallel.{a}=") and int(o.split("=")[1]) > 1)
           for a in ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard")}
    out |= {f"zero_stage={z}": count(lambda o, z=z: o == f"parallel.zero_stage={z}")
            for z in (1, 2, 3)}
    out |= {s: count(lambda o, s=s: o == f"parallel.pp_schedule={s}") for s in SCHEDULES}
    out |= {"sequence_parallel": count(lambda o: o == "parallel.sequence_parallel=true"),
            "micro_batch set": count(lambda o: o.startswith("train.micro_batch=")),
            "recompute": count(lambda o: o.startswith("train.activation_checkpointing=")),
            "reshard_after_forward=false":
                count(lambda o: o == "parallel.reshard_after_forward=false"),
            "reduce_once": count(lambda o: o == "parallel.reduce_once=true")}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--layouts", type=int, default=300, help="accepted draws to train")
    p.add_argument("--seed", type=int, default=0, help="seeds the draws")
    p.add_argument("--dtype", choices=tuple(BOUNDS), default="fp32")
    p.add_argument("--compile", action="store_true",
                   help="every draw with torch.compile'd blocks (the reference stays eager)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    suffix = ("" if args.dtype == "fp32" else f"_{args.dtype}") + \
        ("_compiled" if args.compile else "")
    out = args.out or RESULTS / f"random_layouts{suffix}.json"
    bound = BOUNDS[args.dtype]
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="random-layouts-"))
    cache = str(tmp / "cache")
    refs: dict[tuple[str, str], dict] = {}  # (family, dtype) -> one process's run
    low = args.dtype != "fp32"
    rows, refused, draws = [], Counter(), 0
    while len(rows) < args.layouts:
        family, world, ov = draw(rng)
        draws += 1
        ov = [*_model(family), *ov, f"train.compile={str(args.compile).lower()}",
              f"train.dtype={args.dtype}"]
        try:
            validate(_config(str(tmp / "check"), cache, ov), world, check_data=False)
        except ConfigError as e:
            refused[str(e).split(":")[0].split("=")[0]] += 1
            continue
        for dtype in {"fp32", args.dtype}:
            if (family, dtype) not in refs:
                refs[family, dtype] = run_ranks(_train, 1, str(tmp / f"ref-{family}-{dtype}"),
                                                cache, [*_model(family), f"train.dtype={dtype}"])[0]
        row = {"family": family, "ranks": world, "overrides": ov[len(_model(family)):-2]}
        try:
            got = run_ranks(_train, world, str(tmp / f"run-{len(rows)}"), cache, ov,
                            timeout=600)[0]
        except RankError as e:  # accepted before launch, then failed: a finding
            row |= {"ok": False, "error": str(e).strip().splitlines()[-1][:300]}
        else:
            ref = refs[family, "fp32"]
            loss, norm = _rel(ref["losses"], got["losses"]), _rel(ref["norms"], got["norms"])
            row |= {"max_rel_loss_diff": max(loss), "max_rel_grad_norm_diff": max(norm),
                    "ok": max(loss) <= bound["loss"] and norm[0] <= bound["norm_first"]
                    and max(norm) <= bound["norm_later"]}
            if low:  # and against one process in the same precision
                same = refs[family, args.dtype]
                row |= {"same_dtype": {
                    "max_rel_loss_diff": max(_rel(same["losses"], got["losses"])),
                    "max_rel_grad_norm_diff": max(_rel(same["norms"], got["norms"]))}}
        rows.append(row)
        shown = row.get("error") or f"loss {row['max_rel_loss_diff']:.1e} " \
            f"norm {row['max_rel_grad_norm_diff']:.1e}"
        print(f"{len(rows):4d} {'ok ' if row['ok'] else 'BAD'} {family:8s} {world} ranks "
              f"{shown}  {' '.join(row['overrides'])}", flush=True)
    done = [r for r in rows if "error" not in r]
    summary = {
        "layouts": len(rows), "draws": draws, "refused_before_launch": sum(refused.values()),
        "refused_by_key": dict(refused.most_common()),
        "failed_after_acceptance": sum("error" in r for r in rows),
        "beyond_bound": sum(not r["ok"] for r in done),
        "max_rel_loss_diff": max((r["max_rel_loss_diff"] for r in done), default=None),
        "max_rel_grad_norm_diff": max((r["max_rel_grad_norm_diff"] for r in done), default=None),
        "bounds": bound,
        "covered": _covered(rows),
    }
    if low:  # how far the precision alone moves one process, per family
        summary["one_process_vs_fp32"] = {
            f: {"max_rel_loss_diff": max(_rel(r["losses"], refs[f, args.dtype]["losses"])),
                "max_rel_grad_norm_diff": max(_rel(r["norms"], refs[f, args.dtype]["norms"]))}
            for (f, dtype), r in refs.items() if dtype == "fp32"}
        for key in ("max_rel_loss_diff", "max_rel_grad_norm_diff"):
            summary[f"same_dtype_{key}"] = max((r["same_dtype"][key] for r in done),
                                               default=None)
    result = {"config": {"seed": args.seed, "dtype": args.dtype, "compile": args.compile,
                         "families": FAMILIES,
                         "common": COMMON, **provenance()},
              "summary": summary, "rows": rows}
    write_result(result, out, lambda r: print(json.dumps(r["summary"], indent=1)))
    if summary["failed_after_acceptance"] or summary["beyond_bound"]:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
