"""Planner bubble vs a measured pipeline: record a pp=2 CPU run per schedule, as data.

For each schedule (1f1b, gpipe, interleaved_1f1b) this runs `meshloom.train` on 2 forked Gloo
ranks (dim 384, 8 layers, 4 micro-batches of 4 x 64 tokens, `--steps` steps) and keeps, per
step and rank, what the pipeline timeline records: the step's span, busy and CPU seconds and
every action's duration. Apart from the pipeline run it measures how much single actions vary on
this machine (`action_cv`: one 4-layer stage's forward and backward timed 40 times in one
process). Both go into the JSON, with the bubble measured and the planner's prediction.

`tests/test_plan_validation.py` re-derives both from the committed file: the measured bubble is
each step replayed through the simulator with its recorded durations and no transfer latency
(report.step_bubbles_without_transfers), median over the undisturbed steps; the prediction is
the planner's for the same layout, told the recorded action_cv. That keeps the test free of this
machine's timing while it still holds the planner to a real run.

    python benchmarks/run_all.py --only pp_bubble   # the committed record, results/<machine>/
    python benchmarks/pp_bubble.py --steps 40 --out FILE
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# benchmarks/ is a folder of scripts, not a package: make its shared modules importable however
# this file was loaded (as a script, or by path from a test).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import git_state, launch, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2))
DIM, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ = 384, 8, 6, 2, 257, 64
MICROBATCHES, GLOBAL_BATCH = 4, 16
UNDISTURBED = 0.9  # a step counts if every rank's compute got >= 90% of a core (CPU / wall time)


def action_cv(repeats: int = 40) -> float:
    """Variability of single pipeline actions, measured apart from the pipeline run: one
    4-layer stage (one micro-batch of 4 x 64 tokens), forward and backward timed `repeats` times
    after 2 warm-ups. The spread is the interquartile range / 1.349 (the standard deviation, for
    a normal) over the median, robust to the odd outlier as the median bubble it predicts is;
    the mean of the forward's and the backward's."""
    from meshloom.models.llama import Llama, config_from_preset

    torch.manual_seed(0)
    model = Llama(config_from_preset("tiny", dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                                     n_layers=LAYERS // 2))
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH // MICROBATCHES, SEQ))
    fwd, bwd = [], []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        loss = model(x).float().logsumexp(-1).mean()
        t1 = time.perf_counter()
        loss.backward()
        if i >= 2:
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)

    def spread(times: list[float]) -> float:
        q1, _, q3 = statistics.quantiles(times, n=4)
        return (q3 - q1) / 1.349 / statistics.median(times)

    return statistics.mean(spread(t) for t in (fwd, bwd))


def _cv_rank(args: argparse.Namespace, rank: int, world: int) -> float:
    return action_cv()


def _pipeline_rank(args: argparse.Namespace, rank: int, world: int) -> str:
    from meshloom.config import load_config
    from meshloom.train import train

    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"run.dir={args.run_dir}", f"data.cache_dir={args.cache_dir}", "train.eval_every=0",
        "train.eval_sequences=0", "train.sample_tokens=0", f"model.dim={DIM}",
        f"model.n_heads={HEADS}", f"model.n_layers={LAYERS}", "parallel.pp=2",
        f"parallel.pp_schedule={args.schedule}", f"parallel.pp_virtual_stages={args.v}",
        f"parallel.pp_microbatches={MICROBATCHES}", f"train.global_batch={GLOBAL_BATCH}",
        f"train.steps={args.steps}"])
    train(cfg)
    return str(args.run_dir)


def timelines(run_dir: str) -> list[dict]:
    """What the replay needs of each pp rank's timeline file: the schedule and the steps."""
    from meshloom.report import load_pipeline

    keep = ("pp", "schedule", "virtual_stages", "microbatches", "steps")
    return [{k: f[k] for k in keep} for f in load_pipeline(run_dir)]


def bubble_check(record: dict) -> dict:
    """Measured and predicted bubble of one recorded schedule (see the module docstring)."""
    from meshloom.plan.hardware import make_cluster
    from meshloom.plan.layout import Layout
    from meshloom.plan.models import from_dims
    from meshloom.plan.search import evaluate
    from meshloom.report import step_bubbles, step_bubbles_without_transfers, step_cpu_shares

    files = record["timelines"]
    bubbles, shares = step_bubbles_without_transfers(files), step_cpu_shares(files)
    # The first step is left out: it warms up allocators and caches.
    clean = [b for b, c in zip(bubbles[1:], shares[1:], strict=True)
             if c is not None and b is not None and c >= UNDISTURBED]
    head = files[0]
    shape = from_dims("llama", DIM, LAYERS, HEADS, VOCAB, kv_heads=KV_HEADS)
    lay = Layout(pp=head["pp"], dp=1, micro_batch=GLOBAL_BATCH // head["microbatches"],
                 schedule=head["schedule"], v=head["virtual_stages"])
    # A CPU run: no GPU's kernel table applies, so the stages are priced by their FLOPs and
    # bytes alone (the bubble depends only on the stages' relative costs).
    cluster = make_cluster("h100", 2, action_cv=record["action_cv"], kernels="datasheet")
    predicted = evaluate(shape, lay, cluster, SEQ, GLOBAL_BATCH, "fp32").timing.bubble_fraction
    raw = step_bubbles(files)
    return {"measured": statistics.median(clean) if clean else None, "predicted": predicted,
            "undisturbed_steps": len(clean), "steps": len(bubbles),
            "measured_with_transfers": statistics.median(raw[1:]) if len(raw) > 1 else None}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pp_bubble.json")
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error("--steps must be >= 4")
    wanted = [s for s in args.schedules.split(",") if s]
    known = dict(SCHEDULES)
    if not wanted or any(s not in known for s in wanted):
        p.error(f"--schedules: names from {','.join(known)}")
    args.device = "cpu"
    result: dict = {"benchmark": "pp_bubble", "git": git_state(), "torch": torch.__version__,
                    "config": {"dim": DIM, "layers": LAYERS, "seq": SEQ, "pp": 2,
                               "microbatches": MICROBATCHES, "global_batch": GLOBAL_BATCH,
                               "steps": args.steps, "undisturbed": UNDISTURBED},
                    "schedules": {}}
    with tempfile.TemporaryDirectory() as tmp:
        args.cache_dir = str(Path(tmp) / "cache")
        for schedule in wanted:
            args.nproc = 1
            cv = launch(_cv_rank, args)
            args.schedule, args.v, args.nproc = schedule, known[schedule], 2
            args.run_dir = str(Path(tmp) / schedule)
            record = {"action_cv": cv, "timelines": timelines(launch(_pipeline_rank, args))}
            record["check"] = bubble_check(record)
            result["schedules"][schedule] = record

    def show(r: dict) -> None:
        for name, rec in r["schedules"].items():
            c = rec["check"]
            print(f"{name:17s} action cv {rec['action_cv']:.3f}  predicted {c['predicted']:.3f}"
                  f"  measured {c['measured']}  ({c['undisturbed_steps']} of {c['steps']} "
                  "steps undisturbed)")

    return write_result(result, args.out, show)


if __name__ == "__main__":
    main(sys.argv[1:])
