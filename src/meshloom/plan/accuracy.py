"""How far the planner's throughput has been from measured runs, GPU by GPU.

`benchmarks/planner_validation.py` plans meshloom's own measured runs and published runs of
other trainers and compares (benchmarks/results/planner/validation.json); `summarise` boils
those rows down per GPU preset into plan/accuracy.json, which ships with the package, and
`meshloom plan` quotes it under its table. A planned step time is a prediction: the user
should see next to it how far such predictions have landed from what ran, on that GPU.

Errors are predicted / measured tokens per second - 1: positive means the plan was faster
than the run. tests/test_plan_accuracy.py recomputes the file from validation.json, so the
quoted figures cannot drift from the validation they summarise.
"""

from __future__ import annotations

import json
import statistics
from functools import cache
from pathlib import Path

from meshloom.plan.trainers import trainer_key

ACCURACY_FILE = Path(__file__).resolve().parent / "accuracy.json"
SOURCE = "benchmarks/results/planner/validation.json (python benchmarks/planner_validation.py)"
# The validation's set of Megatron-LM's 2021 paper rows names no trainer field: it is one.
MEGATRON_2021 = "Megatron-LM (2021)"


def _trainer(row: dict) -> str:
    if row["set"].startswith("meshloom-"):
        return "meshloom"
    return row.get("trainer") or MEGATRON_2021


def _group(rows: list[dict]) -> dict:
    errors = [r["error"] for r in rows]
    return {"runs": len(rows),
            "trainers": sorted({_trainer(r) for r in rows}),
            "gpus": [min(r["gpus"] for r in rows), max(r["gpus"] for r in rows)],
            "mean_abs_error": round(statistics.mean(abs(e) for e in errors), 4),
            "mean_error": round(statistics.mean(errors), 4),
            "min_error": round(min(errors), 4),
            "max_error": round(max(errors), 4)}


def summarise(rows: list[dict]) -> dict:
    """Per GPU preset, meshloom's own runs (sets `meshloom-*`), the published runs of other
    trainers and, of those, the ones that trained in Float8 (sets `*-float8`), each
    summarised (`_group`)."""
    out: dict[str, dict] = {}
    for gpu in sorted({r["gpu"] for r in rows}):
        on_gpu = [r for r in rows if r["gpu"] == gpu]
        own = [r for r in on_gpu if r["set"].startswith("meshloom-")]
        others = [r for r in on_gpu if not r["set"].startswith("meshloom-")]
        float8 = [r for r in others if r["set"].endswith("-float8")]
        out[gpu] = {k: _group(sel) for k, sel in (("meshloom", own), ("published", others),
                                                  ("float8", float8)) if sel}
        keys = sorted({k for r in others if (k := trainer_key(r.get("trainer") or ""))})
        if keys:  # the published runs of each trainer `--trainer` names
            out[gpu]["by_trainer"] = {
                k: _group([r for r in others if trainer_key(r.get("trainer") or "") == k])
                for k in keys}
    return {"source": SOURCE,
            "error": "planned / measured tokens per second per GPU - 1 (positive: the plan "
                     "was faster than the run)",
            "gpus": out}


@cache
def load() -> dict:
    if not ACCURACY_FILE.exists():
        return {"gpus": {}}
    return json.loads(ACCURACY_FILE.read_text())


def for_gpu(gpu: str) -> dict:
    """The summary for one GPU preset ({} when no measured run on it was planned)."""
    return load()["gpus"].get(gpu, {})


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _signed(x: float) -> str:
    return f"{100 * x:+.1f}%".replace("-", "\u2212")


def _spread(g: dict) -> str:
    """Mean |error| and the range, or the one run's error."""
    if g["runs"] == 1:
        return f"{_signed(g['mean_error'])} off"
    return (f"{_pct(g['mean_abs_error'])} off on average, {_signed(g['min_error'])} to "
            f"{_signed(g['max_error'])}")


def _gpus(g: dict) -> str:
    lo, hi = g["gpus"]
    return f"{lo} GPU{'s' if lo > 1 else ''}" if lo == hi else f"{lo}\u2013{hi} GPUs"


def _published(g: dict, who: str) -> str:
    lean = "fast" if g["mean_error"] >= 0 else "slow"
    return (f"{g['runs']} published run{'s' if g['runs'] > 1 else ''} of {who} ({_gpus(g)}) "
            f"{_spread(g)}, planned {_pct(abs(g['mean_error']))} {lean} on average")


def describe(gpu: str, adjusted: bool = False, trainer: str = "meshloom",
             gpus: int = 1, float8: bool = False) -> list[str]:
    """Lines for `meshloom plan`'s output: how far plans on `gpu` have been from measured runs,
    those of `trainer` first when it is another trainer's plan, and the Float8 runs first of
    all for a plan priced in Float8 (`float8`). `adjusted`: the user changed the preset's
    figures or its kernel table, which the validation did not use; `gpus`: the plan's GPU
    count, beyond which meshloom's own runs were never measured."""
    acc = for_gpu(gpu)
    if not acc:
        return [f"accuracy on {gpu}: no measured run on this GPU has been compared with a plan "
                "(docs/plan-validation.md)"]
    parts = []
    f8 = acc.get("float8") if float8 else None
    if float8:
        parts.append(_published(f8, ", ".join(f8["trainers"])).replace(
            " published run", " published Float8 run", 1) if f8 else
            f"no published Float8 run on {gpu} was planned")

    def said(g: dict | None) -> bool:  # the Float8 line already covers these runs
        return bool(f8 and g and g["runs"] == f8["runs"])

    own = acc.get("meshloom")
    if trainer != "meshloom":
        mine = acc.get("by_trainer", {}).get(trainer)
        elsewhere = [g for g, a in load()["gpus"].items() if trainer in a.get("by_trainer", {})]
        if not said(mine):
            parts.append(_published(mine, trainer) if mine else
                         f"no published run of {trainer} on {gpu} was planned"
                         + (f" (its runs were on {', '.join(elsewhere)})" if elsewhere else ""))
    elif own:
        most = own["gpus"][1]
        beyond = (f"; none on more than {most} GPU{'s' if most > 1 else ''} yet"
                  if gpus > most else "")
        parts.append(f"meshloom's own {own['runs']} run{'s' if own['runs'] > 1 else ''} "
                     f"({_gpus(own)}) {_spread(own)}{beyond}")
    pub = acc.get("published")
    if pub and not said(pub) and (trainer == "meshloom" or pub["trainers"] != [trainer]):
        parts.append(("all " if trainer != "meshloom" else "")
                     + _published(pub, ", ".join(pub["trainers"])))
    note = (" Measured with the preset's figures and committed kernel table, which you "
            "changed." if adjusted else "")
    return ([f"accuracy on {gpu} (planned against measured throughput, "
             "docs/plan-validation.md):"] + [f"  {p}" for p in parts]
            + ([note.strip()] if note else []))
