"""The parameter-server hybrid against its single-process run, over a whole training run: the
figures docs/parameter-server.md quotes (the test, tests/test_parameter_server.py, checks 8
steps of each layout step by step).

    python benchmarks/ps_parity.py --out benchmarks/results/cpu-2core-x86_64/ps_parity.json

configs/hybrid_ps.toml (SGD, 100 steps) on 1 server x 2 trainers (whole tables), 2 x 2 (whole
tables, and split by rows), 3 x 4 (rows), and 2 x 2 rows again (two runs of one layout must be
bit-identical); Adagrad on 2 x 2 rows. Per layout: the largest relative difference of a step's
loss from the single-process run's, and of the final tables and MLP weights, each relative to
the largest magnitude of that tensor (an element whose sum nearly cancels is rounding noise
elementwise).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _launch import provenance, write_result  # noqa: E402

CONFIG = HERE.parent / "configs" / "hybrid_ps.toml"
ADAGRAD = ["train.optimizer=adagrad", "train.lr=0.02", "train.table_lr=0.1"]
LAYOUTS = {
    "1x2 table sgd": [],
    "2x2 table sgd": ["ps.servers=2"],
    "2x2 row sgd": ["ps.servers=2", "ps.sharding=row"],
    "3x4 row sgd": ["ps.servers=3", "ps.trainers=4", "ps.sharding=row"],
    "2x2 row sgd, again": ["ps.servers=2", "ps.sharding=row"],
    "2x2 row adagrad": ["ps.servers=2", "ps.sharding=row", *ADAGRAD],
}


def _scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def compare(got: dict, ref) -> dict:
    losses = [abs(g - r) / abs(r) for g, r in zip(got["losses"], ref.losses, strict=True)]
    return {"loss_first": ref.losses[0], "loss_last": ref.losses[-1],
            "max_loss_rel_diff": max(losses),
            "max_table_diff_of_scale": max(_scaled(a, b) for a, b in
                                           zip(got["tables"], ref.tables, strict=True)),
            "max_mlp_diff_of_scale": max(_scaled(got["dense"][k], w)
                                         for k, w in ref.dense.items())}


def main(argv: list[str] | None = None) -> dict:
    from meshloom.ps.config import load_ps_config
    from meshloom.ps.launch import launch
    from meshloom.ps.local import train_local

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=HERE / "results" / "ps_parity.json")
    args = p.parse_args(argv)
    refs, runs, rows = {}, {}, {}
    for name, overrides in LAYOUTS.items():
        cfg = load_ps_config(CONFIG, [f"train.steps={args.steps}", *overrides])
        key = tuple(o for o in overrides if not o.startswith("ps."))
        if key not in refs:
            refs[key] = train_local(cfg)
        with tempfile.TemporaryDirectory() as tmp:
            got = launch(cfg, Path(tmp), collect=True)
        got.pop("steps", None)  # per-step records: the test's business, not kept here
        runs[name] = got
        rows[name] = {"overrides": overrides, **compare(got, refs[key])}
        print(name, rows[name], flush=True)
    a, b = runs["2x2 row sgd"], runs["2x2 row sgd, again"]
    identical = (a["losses"] == b["losses"]
                 and all(torch.equal(x, y) for x, y in zip(a["tables"], b["tables"], strict=True))
                 and all(torch.equal(a["dense"][k], b["dense"][k]) for k in a["dense"]))
    result = {"config": {"config": "configs/hybrid_ps.toml", "steps": args.steps,
                         **provenance(),
                         "command": "python benchmarks/ps_parity.py " + " ".join(
                             argv if argv is not None else sys.argv[1:])},
              "layouts": rows, "two_runs_bit_identical": identical}
    return write_result(result, args.out, lambda r: print(
        f"two runs of one layout bit-identical: {r['two_runs_bit_identical']}"))


if __name__ == "__main__":
    main()
