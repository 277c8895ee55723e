"""`meshloom report RUN_DIR`: pictures of any run, and a pipelined run's measured timeline next
to the simulator's prediction.

Every run: from `metrics.jsonl` (rank 0, one object per logged step) and each rank's
`memory/rank{R}.jsonl` (written by `metrics.MetricsLogger`), `RUN_DIR/report/` gets loss.png
(loss and eval loss), throughput.png (tokens/s, MFU when known), memory.png (peak memory per
rank over the steps; runs from before the per-rank files: summary.json's per-rank peaks) and
comm.png (bytes per mesh axis per step, when the run communicated). The pictures need
matplotlib (`pip install 'meshloom[plot]'`); without it the report prints its text and a
one-line hint.

A pipelined run also leaves, for every rank, `RUN_DIR/pipeline/timeline_rank{R}.json` (written
by `train._write_timeline`): when each compute action of the last step ran on that rank. The
report takes the ranks of one pipeline (those whose other mesh coordinates are all 0, one per pp
rank), puts their spans on one clock (each rank's times count from its own start of the step,
shifted by the wall-clock time at which that rank started it; the earliest start becomes 0) and
compares them with `simulate()` run on the same schedule, with each action costing what it cost
on average in the run (per kind and stage), and with unit costs. Bubble fraction everywhere is
`Timeline.bubble()`: 1 - busy / (ranks x makespan). That part writes
`RUN_DIR/pipeline/timeline.png` (measured on top, predicted below) and
`RUN_DIR/pipeline/report.json`.

`format_report()` gives the text the command prints. Reading and checking the run's files is
`report/files.py`; drawing is `report/plots.py`.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from types import ModuleType

from meshloom.parallel.pipeline_schedule import (
    Timeline,
    build_schedule,
    compute_lists,
    simulate,
)
from meshloom.report.files import (
    ReportError,
    comm_series,
    load_pipeline,
    memory_series,
    mfu_per_token_per_s,
    read_jsonl,
    read_summary,
    series,
)

__all__ = ["ReportError", "load_pipeline", "report", "format_report", "pipeline_report",
           "step_bubbles", "step_bubbles_without_transfers", "step_cpu_shares"]
PLOT_HINT = "meshloom: install matplotlib for pictures: pip install 'meshloom[plot]'"


# ---------------------------------------------------------------- a pipeline's numbers


def measured_timeline(files: list[dict]) -> Timeline:
    """The files' spans (parsed by `load_pipeline`) as one Timeline, times shifted so that the
    earliest start is 0."""
    # Each rank counts from its own start of the step; with the wall-clock start recorded
    # ("t0"), the ranks' clocks are aligned, otherwise they are taken to have started together.
    starts = [float(data.get("t0", 0.0)) for data in files]
    spans = [[(s + t - min(starts), e + t - min(starts), a) for s, e, a in data["spans"]]
             for data, t in zip(files, starts, strict=True)]
    t0 = min((s[0][0] for s in spans if s), default=0.0)
    return Timeline([[(s - t0, e - t0, a) for s, e, a in rank] for rank in spans])


def mean_costs(timeline: Timeline) -> dict[tuple[str, int], float]:
    """Mean duration of each (kind, stage) over the micro-batches."""
    sums: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rank in timeline.spans:
        for s, e, a in rank:
            sums[(a.kind, a.stage)].append(e - s)
    return {key: sum(d) / len(d) for key, d in sums.items()}


def step_bubbles(files: list[dict]) -> list[float]:
    """The bubble of each recorded step (the last STEP_HISTORY): 1 - sum of the ranks' busy
    time / (ranks x the step's span from the first start to the last end on any rank)."""
    per_rank = [f.get("steps") or [] for f in files]
    n = min(len(st) for st in per_rank)
    out = []
    for i in range(n):
        rows = [st[len(st) - n + i] for st in per_rank]
        span = max(r[1] for r in rows) - min(r[0] for r in rows)
        out.append(1.0 - sum(r[2] for r in rows) / (len(rows) * span) if span > 0 else 0.0)
    return out


def step_bubbles_without_transfers(files: list[dict]) -> list[float | None]:
    """Per recorded step (as `step_bubbles`), the bubble the step would have had if transfers
    took no time: the schedule replayed through the simulator with every action's measured
    duration and zero latency. This is what the planner's `bubble_fraction` predicts (it
    prices transfers apart, in pp_comm), while the plain timeline counts a rank waiting on a
    transfer as idle. None where a timeline does not record the actions."""
    per_rank = [f.get("steps") or [] for f in files]
    n = min(len(st) for st in per_rank)
    head = files[0]
    lists = build_schedule(head["schedule"], head["pp"], head["microbatches"],
                           head["virtual_stages"])
    out: list[float | None] = []
    for i in range(n):
        rows = [st[len(st) - n + i] for st in per_rank]
        if any(len(r) < 5 for r in rows):
            out.append(None)
            continue
        took = {(k, s, m): d for r in rows for k, s, m, d in r[4]}
        out.append(simulate(lists, lambda a, took=took: took[(a.kind, a.stage, a.mb)]).bubble())
    return out


def step_cpu_shares(files: list[dict]) -> list[float | None]:
    """Per recorded step (as `step_bubbles`), the smallest over the ranks of CPU seconds / busy
    wall seconds of their compute: about 1 on a CPU run whose ranks had their cores to
    themselves, lower when another process took a core in the middle of an action (that step's
    timeline then measures the machine's load, not the pipeline). None where a timeline does
    not record CPU time."""
    per_rank = [f.get("steps") or [] for f in files]
    n = min(len(st) for st in per_rank)
    out: list[float | None] = []
    for i in range(n):
        rows = [st[len(st) - n + i] for st in per_rank]
        if any(len(r) < 4 or r[2] <= 0 for r in rows):
            out.append(None)
        else:
            out.append(min(r[3] / r[2] for r in rows))
    return out


def _busy(timeline: Timeline) -> list[float]:
    return [sum(e - s for s, e, _ in rank) for rank in timeline.spans]


def _summary(timeline: Timeline, scale: float, unit: str) -> dict:
    span, busy = timeline.makespan, _busy(timeline)
    return {"bubble": timeline.bubble(), f"makespan_{unit}": span * scale,
            f"busy_{unit}": [b * scale for b in busy],
            "busy_fraction": [b / span if span else 0.0 for b in busy]}


# ---------------------------------------------------------------- a run's curves


def run_report(run_dir: Path, plots: ModuleType | None) -> dict | None:
    """The run's curves: what metrics.jsonl and the per-rank memory files hold, summarised,
    and (given the plots module) drawn into RUN_DIR/report/. None without metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = read_jsonl(path)
    summary = read_summary(run_dir)
    loss, evals = series(records, "loss", path), series(records, "eval_loss", path)
    tps = series(records, "tokens_per_s", path)
    series(records, "mfu", path)  # checked: numbers or null
    comm = comm_series(records, path)
    memory = memory_series(run_dir)
    # CUDA runs log the allocator's reserved peak; on a CPU the peak is the process's RSS.
    cuda = any("reserved" in m for m in memory.values()) or any(
        r.get("peak_mem_reserved_bytes") is not None for r in records)
    what = "CUDA allocated; dashed: reserved" if cuda else "resident set size"
    result: dict = {"steps": [r["step"] for r in records], "loss": loss, "eval_loss": evals,
                    "tokens_per_s": tps, "comm_bytes": comm, "memory_per_rank": memory,
                    "memory_source": "per-rank files" if memory else None, "pictures": {}}
    if not memory:  # a run from before the per-rank files: its whole-run peaks, else rank 0's
        peaks = summary.get("peak_mem_bytes_per_rank")
        if isinstance(peaks, list) and peaks and all(isinstance(p, int) for p in peaks):
            result["memory_source"] = "summary.json"
            result["memory_whole_run"] = peaks
        elif series(records, "peak_mem_bytes", path)[0]:
            result["memory_source"] = "metrics.jsonl (rank 0 only)"
            memory = {0: {"peak": series(records, "peak_mem_bytes", path)}}
            result["memory_per_rank"] = memory
    if plots is None or not records:
        return result
    folder = run_dir / "report"
    pictures = result["pictures"]
    try:
        folder.mkdir(exist_ok=True)
        pictures["loss"] = plots.loss_picture(folder / "loss.png", {"loss": loss},
                                              {"eval loss": evals} if evals[0] else {})
        pictures["throughput"] = plots.throughput_picture(
            folder / "throughput.png", {"tokens/s": tps}, mfu_per_token_per_s(records))
        if memory:
            pictures["memory"] = plots.memory_picture(folder / "memory.png", memory, what)
        elif result["memory_source"] == "summary.json":
            reserved = summary.get("peak_mem_reserved_bytes_per_rank")
            pictures["memory"] = plots.memory_bars_picture(
                folder / "memory.png", result["memory_whole_run"],
                reserved if isinstance(reserved, list) else None,
                "CUDA allocator" if cuda else "resident set size")
        if comm:  # a one-process run moves nothing: no empty picture
            pictures["comm"] = plots.comm_picture(folder / "comm.png", comm)
    except OSError as e:
        raise ReportError(f"cannot write the pictures into {folder}: {e.strerror or e}") from None
    for name, drawn in pictures.items():
        drawn["png"] = str(folder / f"{name}.png")
    return result


# ---------------------------------------------------------------- a pipeline's timeline


def pipeline_report(run_dir: str | os.PathLike, draw: bool = True,
                    plots: ModuleType | None = None) -> dict:
    """Measured vs predicted pipeline timeline of a run: the numbers (also written to
    RUN_DIR/pipeline/report.json) and, with `draw` and matplotlib installed,
    RUN_DIR/pipeline/timeline.png."""
    run_dir = Path(run_dir)
    files = load_pipeline(run_dir)
    schedule, pp = files[0]["schedule"], files[0]["pp"]
    v, m = files[0]["virtual_stages"], files[0]["microbatches"]
    try:
        expected = compute_lists(schedule, pp, m, v)
        lists = build_schedule(schedule, pp, m, v)
    except ValueError as e:
        raise ReportError(f"cannot rebuild the run's schedule: {e}") from None
    measured = measured_timeline(files)
    for r, rank in enumerate(measured.spans):
        if Counter(a for _, _, a in rank) != Counter(expected[r]):
            raise ReportError(f"the timeline of pp rank {r} (rank {files[r]['rank']}) does not "
                              f"hold the actions of {schedule} with pp={pp}, v={v}, m={m}")
    costs = mean_costs(measured)  # every (kind, stage) ran: checked just above
    predicted = simulate(lists, lambda a: costs[(a.kind, a.stage)])
    unit = simulate(lists)
    pipe = run_dir / "pipeline"
    if draw and plots is None:
        plots = load_plots()
    draw = draw and plots is not None
    result = {
        "run_dir": str(run_dir), "schedule": schedule, "pp": pp, "virtual_stages": v,
        "microbatches": m, "ranks": [int(f["rank"]) for f in files],
        "peak_alive": [f.get("peak_alive") for f in files],
        "measured": _summary(measured, 1e3, "ms"),
        "predicted": _summary(predicted, 1e3, "ms"),
        "predicted_unit_cost": _summary(unit, 1.0, "units"),
        "mean_cost_ms": {f"{k}{s}": c * 1e3 for (k, s), c in sorted(costs.items())},
        "bubble_per_step": step_bubbles(files),
        "bubble_per_step_without_transfers": step_bubbles_without_transfers(files),
        "cpu_share_per_step": step_cpu_shares(files),
        "json": str(pipe / "report.json"),
        "png": str(pipe / "timeline.png") if draw else None,
    }
    try:
        if draw:
            title = f"{schedule}, pp={pp}, v={v}, m={m}"
            plots.draw_timelines(pipe / "timeline.png", [
                (f"measured ({title}, last step): bubble {measured.bubble():.1%}, "
                 f"makespan {measured.makespan * 1e3:.4g} ms", measured),
                (f"predicted from the measured mean costs: bubble {predicted.bubble():.1%}, "
                 f"makespan {predicted.makespan * 1e3:.4g} ms (unit costs: bubble "
                 f"{unit.bubble():.1%})", predicted),
            ], scale=1e3, unit="ms", row_label="pp")
        tmp = pipe / ".report.json.tmp"
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(pipe / "report.json")
    except OSError as e:
        raise ReportError(f"cannot write the report into {pipe}: {e.strerror or e}") from None
    return result


# ---------------------------------------------------------------- the command


def load_plots() -> ModuleType | None:
    """meshloom.report.plots, or None where matplotlib is not installed (an optional extra)."""
    try:
        return importlib.import_module("meshloom.report.plots")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise  # a broken install of something else is not "matplotlib is missing"
        return None


def report(run_dir: str | os.PathLike, draw: bool = True) -> dict:
    """Everything `meshloom report` shows of a run: its curves (`run`, from metrics.jsonl)
    and, for a pipelined run, its timeline (`pipeline`); `hint` is the one line to print
    when pictures were wanted and matplotlib is missing."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReportError(f"{run_dir} does not exist")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder (pass a run folder, RUN_DIR)")
    plots = load_plots() if draw else None
    run = run_report(run_dir, plots)
    has_pipeline = any((run_dir / "pipeline").glob("timeline_rank*.json"))
    if run is None and not has_pipeline:
        raise ReportError(f"{run_dir} holds no metrics.jsonl and no pipeline timelines: not a "
                          "run folder (run.dir), or the run has not logged a step yet")
    pipe = pipeline_report(run_dir, plots is not None, plots) if has_pipeline else None
    return {"run_dir": str(run_dir), "run": run, "pipeline": pipe,
            "hint": PLOT_HINT if draw and plots is None else None}


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_run(r: dict) -> list[str]:
    """The text lines of a run's curves."""
    steps = r["steps"]
    if not steps:
        return ["run: metrics.jsonl holds no step yet"]
    lines = [f"run: {len(steps)} logged steps ({steps[0]} to {steps[-1]})"]
    (_, loss), (ev_steps, ev) = r["loss"], r["eval_loss"]
    if loss:
        lines.append(f"loss: {loss[0]:.4f} -> {loss[-1]:.4f}" + (
            f"; eval loss {ev[-1]:.4f} at step {ev_steps[-1]}" if ev else ""))
    tps = r["tokens_per_s"][1]
    if tps:
        lines.append(f"tokens/s: median {statistics.median(tps):,.0f}")
    memory = r["memory_per_rank"]
    if memory:
        peaks = {rank: max(s["peak"][1]) for rank, s in memory.items() if s["peak"][1]}
        if peaks:
            top = max(peaks, key=peaks.get)
            lines.append(f"peak memory: {_bytes(peaks[top])} (rank {top}; {len(peaks)} ranks, "
                         f"from {r['memory_source']})")
    elif r.get("memory_whole_run"):
        whole = r["memory_whole_run"]
        lines.append(f"peak memory: {_bytes(max(whole))} (rank {whole.index(max(whole))}; "
                     f"whole run, from summary.json)")
    comm = r["comm_bytes"]
    lines.append("comm per step (rank 0, median): " + (", ".join(
        f"{a} {_bytes(statistics.median(ys))}" for a, (_, ys) in comm.items())
        if comm else "none (one process)"))
    for name, drawn in r["pictures"].items():
        lines.append(f"{name + ':':11} {drawn['png']}")
    return lines


def format_pipeline(r: dict) -> list[str]:
    """The measured-vs-predicted table of a pipelined run."""
    me, pr, un = r["measured"], r["predicted"], r["predicted_unit_cost"]
    ranks = ", ".join(map(str, r["ranks"]))
    lines = [f"pipeline: {r['schedule']}, pp={r['pp']}, virtual stages={r['virtual_stages']}, "
             f"micro-batches={r['microbatches']} (ranks {ranks}; last step)",
             f"{'':22}{'measured':>10}{'predicted':>11}{'unit-cost':>11}",
             f"{'bubble':22}{me['bubble']:>10.1%}{pr['bubble']:>11.1%}{un['bubble']:>11.1%}",
             f"{'makespan':22}{me['makespan_ms']:>8.2f}ms{pr['makespan_ms']:>9.2f}ms"
             f"{un['makespan_units']:>5g} units"]
    for i in range(r["pp"]):
        lines.append(f"{f'busy, pp rank {i}':22}{me['busy_fraction'][i]:>10.1%}"
                     f"{pr['busy_fraction'][i]:>11.1%}{un['busy_fraction'][i]:>11.1%}")
    steps = r.get("bubble_per_step") or []
    if len(steps) > 1:
        lines.append(f"bubble over the last {len(steps)} steps: median "
                     f"{statistics.median(steps):.1%}, range {min(steps):.1%} to {max(steps):.1%}")
    if any(p is not None for p in r["peak_alive"]):
        lines.append("peak micro-batches alive: " + ", ".join(
            f"pp rank {i}: {p}" for i, p in enumerate(r["peak_alive"])))
    if r["png"]:
        lines.append(f"timeline:   {r['png']}")
    lines.append(f"numbers:    {r['json']}")
    return lines


def format_report(r: dict) -> str:
    """What `meshloom report` prints (the hint apart: it goes to stderr)."""
    lines = format_run(r["run"]) if r["run"] is not None else []
    if r["pipeline"] is not None:
        lines += ([""] if lines else []) + format_pipeline(r["pipeline"])
    return "\n".join(lines)
