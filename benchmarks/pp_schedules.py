"""Measured pipeline bubble of every schedule: `meshloom train` at pp 2, then `meshloom report`.

    python benchmarks/pp_schedules.py --steps 6

One `meshloom train` run per schedule (gpipe, 1f1b, interleaved_1f1b with v = 2, zb_h1,
interleaved_zb with v = 2), the
demo model on 2 Gloo ranks (one pipeline stage each), `--microbatches` micro-batches of
`--micro-batch` x `--seq` tokens, then the same numbers `meshloom report RUN_DIR` prints: the
last step's measured bubble and makespan, the simulator's bubble for the same schedule with each
(kind, stage) costing its mean measured duration, and with unit costs; plus every recorded step's
bubble with and without the waits on transfers. Runs one schedule at a time.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from meshloom.report import report

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import parser, provenance, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "pp_schedules.json"
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1,  # name: virtual stages
             "interleaved_zb": 2}


def _train(run_dir: Path, schedule: str, v: int, args) -> None:
    sets = {"model.preset": args.preset, "data.seq_len": args.seq,
            "train.global_batch": args.microbatches * args.micro_batch,
            "train.micro_batch": args.micro_batch, "train.steps": args.steps,
            "train.eval_every": 0, "train.eval_sequences": 0, "train.sample_tokens": 0,
            "parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": schedule,
            "parallel.pp_virtual_stages": v, "run.dir": run_dir}
    cmd = [sys.executable, "-m", "meshloom", "train", str(ROOT / "configs" / "tiny.toml"),
           "--nproc", "2"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--preset", default="demo", choices=["demo", "tiny", "small"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.steps < 1 or args.microbatches < 2 or args.micro_batch < 1:
        p.error("need --steps >= 1, --microbatches >= 2, --micro-batch >= 1")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="pp_schedules_") as tmp:
        for schedule, v in SCHEDULES.items():
            run_dir = Path(tmp) / schedule
            _train(run_dir, schedule, v, args)
            r = report(run_dir, draw=False)["pipeline"]
            without = [b for b in r["bubble_per_step_without_transfers"] if b is not None]
            runs[schedule] = {
                "schedule_run": r["schedule"], "virtual_stages": r["virtual_stages"],
                "microbatches": r["microbatches"], "measured_bubble": r["measured"]["bubble"],
                "predicted_bubble_measured_costs": r["predicted"]["bubble"],
                "predicted_bubble_unit_costs": r["predicted_unit_cost"]["bubble"],
                "makespan_ms": r["measured"]["makespan_ms"], "mean_cost_ms": r["mean_cost_ms"],
                "bubble_per_step": r["bubble_per_step"],
                "bubble_median": statistics.median(r["bubble_per_step"]),
                "bubble_per_step_without_transfers": r["bubble_per_step_without_transfers"],
                "bubble_without_transfers_median": statistics.median(without) if without else None,
                "cpu_share_per_step": r["cpu_share_per_step"]}
    result = {"runs": runs,
              "config": {"preset": args.preset, "pp": 2, "microbatches": args.microbatches,
                         "micro_batch": args.micro_batch, "seq": args.seq, "steps": args.steps,
                         "backend": "gloo", **provenance()},
              "note": "measured_bubble, makespan and the predictions are the last step's, as "
                      "meshloom report prints them; bubble_median is over the recorded steps"}
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    print(f"{'schedule':18}{'measured':>10}{'predicted':>11}{'unit':>8}{'makespan':>10}")
    for name, x in r["runs"].items():
        print(f"{name:18}{x['measured_bubble']:10.1%}{x['predicted_bubble_measured_costs']:11.1%}"
              f"{x['predicted_bubble_unit_costs']:8.1%}{x['makespan_ms']:8.0f}ms")


if __name__ == "__main__":
    main()
