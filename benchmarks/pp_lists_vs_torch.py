"""meshloom's pipeline action lists against the ones torch.distributed.pipelining builds.

torch's multi-stage schedule classes decide each rank's actions up front (their
`pipeline_order`), in their own code. For a grid of pipeline sizes, stages per rank and
micro-batch counts this script builds torch's lists, in one process (a "fake" process group
stands in for the ranks: the lists depend only on the sizes), and meshloom's lists of the same
schedule, and compares them:
- whether they are the same, action for action, and whether their forwards and input-gradient
  passes (or whole backwards) run in the same order on every rank, the weight passes aside;
  for interleaved_zb also whether torch's are meshloom's `w_order="lagged"` lists (the weight
  passes the planner prices for a torchtitan run);
- the bubble each leaves with unit costs (F = B = I = W = 1), from meshloom's simulator, which
  runs any list (it checks dependencies, so a list that could deadlock would fail here);
- the most chunk activations any rank holds at once (a forward adds one, the backward that frees
  its inputs removes it: B, or W when the backward is split), i.e. the activation memory.

Pairs: interleaved_1f1b / ScheduleInterleaved1F1B, interleaved_zb /
ScheduleInterleavedZeroBubble (v >= 2), zb_h1 / ScheduleInterleavedZeroBubble over one stage
per rank. No training runs, nothing is timed: the figures are exact.

    python benchmarks/pp_lists_vs_torch.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from meshloom.parallel.pipeline_schedule import (
    Action,
    compute_lists,
    simulate,
    with_communication,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import provenance, write_result  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pp_lists_vs_torch.json"
TORCH_CLASSES = {"interleaved_1f1b": ScheduleInterleaved1F1B,
                 "interleaved_zb": ScheduleInterleavedZeroBubble,
                 "zb_h1": ScheduleInterleavedZeroBubble}
KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", default="2,4,8", help="pipeline sizes")
    p.add_argument("--virtual-stages", default="2,4", help="stages per rank (interleaved)")
    p.add_argument("--rounds", default="1,2,4", help="micro-batch counts, as multiples of pp")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    try:
        for name in ("pp", "virtual_stages", "rounds"):
            values = [int(x) for x in getattr(args, name).split(",") if x]
            if not values or min(values) < 1:
                raise ValueError
            setattr(args, name, values)
    except ValueError:
        p.error("--pp, --virtual-stages and --rounds take comma-separated positive integers")
    if min(args.pp) < 2:
        p.error("--pp: a pipeline needs at least 2 ranks")
    if min(args.virtual_stages) < 2:
        p.error("--virtual-stages: 2 or more (one stage per rank is zb_h1, always compared)")
    return args


def torch_lists(schedule: str, pp: int, m: int, v: int) -> list[list[Action]]:
    """Every rank's compute actions as torch's schedule class lays them out. Rank 0's schedule
    object computes every rank's list; its stages need only their index and the group size."""
    dist.init_process_group("fake", store=_fake_store(), rank=0, world_size=pp)
    try:
        shape = torch.empty(1, 1, device="meta")
        stages = [PipelineStage(nn.Identity(), c * pp, pp * v, torch.device("cpu"),
                                input_args=shape, output_args=shape) for c in range(v)]
        order = TORCH_CLASSES[schedule](stages, m).pipeline_order
        return [[Action(KINDS[a.computation_type.name], a.stage_index, a.microbatch_index)
                 for a in order[r] if a is not None and a.computation_type.name in KINDS]
                for r in range(pp)]
    finally:
        dist.destroy_process_group()


def _fake_store():
    # torch's own stand-in store for the "fake" backend (part of its test utilities).
    from torch.testing._internal.distributed.fake_pg import FakeStore
    return FakeStore()


def peak_alive(lists: list[list[Action]]) -> list[int]:
    """Per rank, the most chunk activations alive at once."""
    peaks = []
    for acts in lists:
        alive = peak = 0
        for a in acts:
            alive += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def describe(lists: list[list[Action]], pp: int, v: int) -> dict:
    tl = simulate(with_communication(lists, pp, pp * v))
    return {"bubble_unit_cost": tl.bubble(), "makespan_units": tl.makespan,
            "peak_chunk_activations": peak_alive(lists)}


def compare(schedule: str, pp: int, m: int, v: int) -> dict:
    ours, theirs = compute_lists(schedule, pp, m, v), torch_lists(schedule, pp, m, v)
    if sorted(a for r in ours for a in r) != sorted(a for r in theirs for a in r):
        raise RuntimeError(f"{schedule} pp={pp} m={m} v={v}: the two sides run different "
                           "actions")
    def no_w(lists: list[list[Action]]) -> list[list[Action]]:
        return [[a for a in acts if a.kind != "W"] for acts in lists]

    row = {"schedule": schedule, "pp": pp, "v": v, "microbatches": m,
           "same_lists": ours == theirs, "same_order_without_w": no_w(ours) == no_w(theirs)}
    if schedule == "interleaved_zb":
        row["same_as_lagged"] = compute_lists(schedule, pp, m, v, w_order="lagged") == theirs
    return {**row, "meshloom": describe(ours, pp, v), "torch": describe(theirs, pp, v)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rows = []
    for pp in args.pp:
        for m in (k * pp for k in args.rounds):
            rows.append(compare("zb_h1", pp, m, 1))
            for v in args.virtual_stages:
                for schedule in ("interleaved_1f1b", "interleaved_zb"):
                    rows.append(compare(schedule, pp, m, v))
    result = {"config": {"pp": args.pp, "virtual_stages": args.virtual_stages,
                         "rounds": args.rounds, **provenance()},
              "rows": rows,
              "note": "bubble_unit_cost: meshloom's simulator on the lists with F = B = I = W "
                      "= 1 and free communication, 1 - busy / (ranks x makespan); "
                      "peak_chunk_activations: per rank, the most forwards whose freeing "
                      "backward (B, or W when split) has not run, in chunks of one stage's "
                      "layers x one micro-batch; torch's lists from its classes' "
                      "pipeline_order, built on rank 0 of a fake process group"}
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    print(f"{'schedule':18}{'pp':>4}{'v':>3}{'m':>4}{'same':>6}{'F/I':>5}{'lagged':>7}"
          f"{'bubble ours':>13}{'torch':>8}{'peak ours':>11}{'torch':>7}")
    for row in r["rows"]:
        o, t = row["meshloom"], row["torch"]
        print(f"{row['schedule']:18}{row['pp']:4}{row['v']:3}{row['microbatches']:4}"
              f"{'yes' if row['same_lists'] else 'no':>6}"
              f"{'yes' if row['same_order_without_w'] else 'no':>5}"
              f"{({True: 'yes', False: 'no'}).get(row.get('same_as_lagged'), '-'):>7}"
              f"{o['bubble_unit_cost']:13.3f}"
              f"{t['bubble_unit_cost']:8.3f}{max(o['peak_chunk_activations']):11}"
              f"{max(t['peak_chunk_activations']):7}")
    print("same: the lists; F/I: their order without the W passes; lagged: torch's are "
          "meshloom's w_order=lagged lists; bubble: unit costs; peak: the most chunk "
          "activations alive on any rank")


if __name__ == "__main__":
    main()
