"""`meshloom report RUN_DIR`: the measured pipeline timeline next to the simulator's prediction.

A pipelined run leaves, for every rank, `RUN_DIR/pipeline/timeline_rank{R}.json` (written by
`train._write_timeline`): when each compute action of the last step ran on that rank. The report
takes the ranks of one pipeline (those whose other mesh coordinates are all 0, one per pp rank),
puts their spans on one clock (each rank's times count from its own start of the step, shifted
by the wall-clock time at which that rank started it; the earliest start becomes 0) and
compares them with `simulate()` run on the same schedule, with each action costing what it cost
on average in the run (per kind and stage), and with unit costs.

Bubble fraction everywhere is `Timeline.bubble()`: 1 - busy / (ranks x makespan).

Writes `RUN_DIR/pipeline/timeline.png` (measured on top, predicted below) and
`RUN_DIR/pipeline/report.json`; `format_report()` gives the table the command prints.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from meshloom.parallel.pipeline_schedule import (
    Action,
    Timeline,
    build_schedule,
    compute_lists,
    simulate,
)
from meshloom.png import Canvas, text_height, text_width

KIND_COLORS = {"F": (66, 133, 244), "B": (52, 168, 83), "I": (242, 133, 0), "W": (142, 68, 173)}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
INK, GRID, MUTED = (20, 20, 20), (225, 225, 225), (110, 110, 110)


KEYS = ("rank", "pp_rank", "pp", "schedule", "virtual_stages", "microbatches", "coords", "spans")


class ReportError(ValueError):
    """Bad input for the report (one line, for the command's error message)."""


# ---------------------------------------------------------------- reading a run


def load_pipeline(run_dir: str | os.PathLike) -> list[dict]:
    """The timeline files of one pipeline (other mesh coordinates all 0), in pp-rank order."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReportError(f"{run_dir} does not exist")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder (pass a run folder, RUN_DIR)")
    files = sorted((run_dir / "pipeline").glob("timeline_rank*.json"))
    if not files:
        raise ReportError(f"{run_dir} holds no pipeline timelines (pipeline/timeline_rank*.json):"
                          " it was not trained with parallel.pp > 1, or has not finished")
    ours = []
    for f in files:
        try:
            data = json.loads(f.read_text())
            missing = [k for k in KEYS if k not in data]
            if missing:
                raise KeyError(missing[0])
            coords, pp_rank = data["coords"], int(data["pp_rank"])
            for key in ("pp", "virtual_stages", "microbatches"):
                data[key] = int(data[key])
            others = [int(c) for axis, c in coords.items() if axis != "pp"]
            data["spans"] = sorted(((float(s), float(e), Action(str(k), int(st), int(mb)))
                                    for s, e, k, st, mb in data["spans"]),
                                   key=lambda span: span[:2])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            what = f"no key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise ReportError(f"{f} is not a pipeline timeline ({what})") from None
        if not any(others):
            ours.append((pp_rank, f, data))
    if not ours:
        raise ReportError(f"{run_dir / 'pipeline'} holds no timeline of the first pipeline "
                          "(the ranks whose coordinates other than pp are all 0)")
    ours.sort(key=lambda t: t[0])
    first = ours[0][2]
    pp = first["pp"]
    for _, f, data in ours:
        for key in ("pp", "schedule", "virtual_stages", "microbatches"):
            if data[key] != first[key]:
                raise ReportError(f"{f} says {key}={data[key]!r}, {ours[0][1].name} says "
                                  f"{first[key]!r}: timelines of different runs?")
    have = [r for r, _, _ in ours]
    if have != list(range(pp)):
        raise ReportError(f"{run_dir / 'pipeline'}: the first pipeline needs one timeline per pp "
                          f"rank 0..{pp - 1}, found pp ranks {', '.join(map(str, have))}")
    return [data for _, _, data in ours]


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


# ---------------------------------------------------------------- the report


def report(run_dir: str | os.PathLike, draw: bool = True) -> dict:
    """Measured vs predicted pipeline timeline of a run: the numbers (also written to
    RUN_DIR/pipeline/report.json) and, with `draw`, RUN_DIR/pipeline/timeline.png."""
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
            title = f"{schedule}  pp={pp} v={v} m={m}"
            draw_timelines(pipe / "timeline.png", [
                (f"measured: {title}  bubble {measured.bubble():.1%}  "
                 f"makespan {measured.makespan * 1e3:.4g} ms", measured),
                (f"predicted: bubble {predicted.bubble():.1%}  makespan "
                 f"{predicted.makespan * 1e3:.4g} ms  (unit costs: {unit.bubble():.1%})",
                 predicted),
            ], scale=1e3, unit="ms", row_label="pp")
        tmp = pipe / ".report.json.tmp"
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(pipe / "report.json")
    except OSError as e:
        raise ReportError(f"cannot write the report into {pipe}: {e.strerror or e}") from None
    return result


def format_report(r: dict) -> str:
    """The table `meshloom report` prints."""
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
        lines.append(f"timeline: {r['png']}")
    lines.append(f"numbers:  {r['json']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- drawing

WIDTH, LEFT, RIGHT, ROW_H, ROW_GAP = 1000, 64, 16, 26, 6


def draw_timelines(path: str | os.PathLike, panels: list[tuple[str, Timeline]],
                   scale: float = 1.0, unit: str = "", row_label: str = "rank") -> None:
    """One PNG with a panel per (title, timeline), stacked, on one time axis: a row per rank,
    a box per compute action coloured by kind (lighter for later chunks), labelled with its
    micro-batch when wide enough. Times are multiplied by `scale` for the axis labels."""
    t_end = max((t.makespan + t.start for _, t in panels), default=0.0) or 1.0
    n_stages = 1 + max((a.stage for _, t in panels for r in t.spans for _, _, a in r), default=0)
    pp = max((len(t.spans) for _, t in panels), default=1)
    v = max(1, math.ceil(n_stages / pp))
    kinds = [k for k in KIND_COLORS if any(a.kind == k for _, t in panels
                                           for r in t.spans for _, _, a in r)]
    panel_h = [22 + len(t.spans) * (ROW_H + ROW_GAP) + 26 for _, t in panels]
    canvas = Canvas(WIDTH, sum(panel_h) + 34)
    y = 8
    for (title, timeline), h in zip(panels, panel_h, strict=True):
        _panel(canvas, y, title, timeline, t_end, scale, unit, row_label, pp)
        y += h
    _legend(canvas, y, kinds, v)
    canvas.save(path)


def _panel(canvas: Canvas, y: int, title: str, timeline: Timeline, t_end: float,
           scale: float, unit: str, row_label: str, pp: int) -> None:
    canvas.text(LEFT, y, title, INK, scale=1 if text_width(title, 2) > WIDTH - LEFT else 2)
    x_of = _axis_map(t_end)
    top = y + 22
    bottom = top + len(timeline.spans) * (ROW_H + ROW_GAP)
    step = _tick_step(t_end * scale)
    ticks = [i * step for i in range(int(t_end * scale / step + 1e-9) + 1)]
    for t in ticks:
        canvas.rect(x_of(t / scale), top - 2, x_of(t / scale) + 1, bottom, GRID)
    def fits(s: float, e: float, a: Action, size: int) -> bool:
        return text_width(str(a.mb), size) + 4 <= x_of(e) - x_of(s) - 1

    # One label size for the panel (large where nearly every box has room), small as a fallback.
    boxes = [span for spans in timeline.spans for span in spans]
    large = sum(fits(*b, 2) for b in boxes) >= 0.9 * len(boxes)
    for r, spans in enumerate(timeline.spans):
        ry = top + r * (ROW_H + ROW_GAP)
        canvas.text(6, ry + (ROW_H - text_height(1)) // 2, f"{row_label} {r}", INK)
        for s, e, a in spans:
            x0, x1 = x_of(s), x_of(e)
            color = _shade(KIND_COLORS.get(a.kind, MUTED), a.stage // pp)
            canvas.rect(x0, ry, max(x1 - 1, x0 + 1), ry + ROW_H, color)  # 1 px gap between
            label = str(a.mb)
            for size in (2, 1) if large else (1,):
                if fits(s, e, a, size):
                    ink = (255, 255, 255) if sum(color) < 450 else INK
                    canvas.text(round((x0 + x1 - 1 - text_width(label, size)) / 2),
                                ry + (ROW_H - text_height(size)) // 2, label, ink, size)
                    break
    canvas.rect(LEFT, bottom, WIDTH - RIGHT, bottom + 1, INK)
    for t in ticks:
        x = x_of(t / scale)
        canvas.rect(x, bottom, x + 1, bottom + 4, INK)
        label = f"{t:g}"
        canvas.text(round(x - text_width(label) / 2), bottom + 7, label, MUTED)
    if unit:
        canvas.text(WIDTH - RIGHT - text_width(unit), bottom + 16, unit, MUTED)


def _axis_map(t_end: float):
    span = WIDTH - LEFT - RIGHT
    return lambda t: round(LEFT + t / t_end * span)


def _tick_step(extent: float) -> float:
    """1, 2 or 5 x 10^k: about 8 to 20 ticks over the extent."""
    raw = extent / 12 if extent > 0 else 1.0
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _shade(color: tuple[int, int, int], chunk: int) -> tuple[int, int, int]:
    """The kind's colour for chunk 0, mixed with more white for each later chunk."""
    mix = min(0.6, 0.4 * chunk)
    return tuple(round(c + (255 - c) * mix) for c in color)


def _legend(canvas: Canvas, y: int, kinds: list[str], v: int) -> None:
    x = LEFT
    for k in kinds:
        canvas.rect(x, y, x + 14, y + 14, KIND_COLORS[k])
        x = canvas.text(x + 20, y + 4, f"{k} {KIND_NAMES[k]}", INK) + 18
    if v > 1:
        for c in range(v):
            canvas.rect(x + 16 * c, y, x + 16 * c + 14, y + 14, _shade(KIND_COLORS["F"], c))
        canvas.text(x + 16 * v + 6, y + 4, "chunk 0, 1, ... (lighter: later chunk)", INK)
    canvas.text(WIDTH - RIGHT - text_width("numbers: micro-batch"), y + 4,
                "numbers: micro-batch", MUTED)


def schedule_pictures(folder: str | os.PathLike, pp: int = 4, m: int = 8, v: int = 2) -> dict:
    """docs/img/pp_<schedule>.png: every schedule simulated on unit costs; returns the bubbles."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bubbles = {}
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
        vv = v if name == "interleaved_1f1b" else 1
        t = simulate(build_schedule(name, pp, m, vv))
        bubbles[name] = t.bubble()
        extra = f" v={vv}" if vv > 1 else ""
        title = (f"{name}  p={pp}{extra} m={m}  unit costs  makespan {t.makespan:g}  "
                 f"bubble {t.bubble():.1%}")
        draw_timelines(folder / f"pp_{name}.png", [(title, t)], unit="time (units)")
    return bubbles


_RANK_COLORS = [(66, 133, 244), (234, 134, 0), (52, 168, 83), (155, 89, 182),
                (219, 68, 55), (0, 172, 193), (244, 180, 0), (121, 85, 72)]


def zigzag_picture(path: str | os.PathLike, cp: int = 4, cell: int = 22) -> dict[str, float]:
    """docs/img/cp_zigzag.png: the causal score matrix in 2·cp x 2·cp chunk blocks, each
    unmasked block coloured by the cp rank whose queries it is, for the contiguous split (left)
    and the zigzag split (right); returns each split's max/min work ratio."""
    from meshloom.parallel.context import attention_work

    n = 2 * cp
    pad, gap, top = 14, 40, 34
    side = n * cell
    canvas = Canvas(2 * side + gap + 2 * pad, side + top + 44)
    ratios = {}
    for panel, zigzag in enumerate((False, True)):
        x0 = pad + panel * (side + gap)
        owner = ([i if i < cp else n - 1 - i for i in range(n)] if zigzag
                 else [i // 2 for i in range(n)])
        work = [attention_work(64 * n, cp, r, zigzag) for r in range(cp)]
        ratios["zigzag" if zigzag else "contiguous"] = max(work) / min(work)
        title = f"{'zigzag' if zigzag else 'contiguous'}: max/min work {max(work) / min(work):.2f}"
        canvas.text(x0, 8, title, scale=1)
        for qc in range(n):
            for kc in range(qc + 1):
                color = _RANK_COLORS[owner[qc] % len(_RANK_COLORS)]
                if kc == qc:  # half of the diagonal block is masked
                    color = tuple(int(c + (255 - c) * 0.45) for c in color)
                canvas.rect(x0 + kc * cell + 1, top + qc * cell + 1,
                            x0 + (kc + 1) * cell - 1, top + (qc + 1) * cell - 1, color)
        canvas.frame(x0, top, x0 + side, top + side, (120, 120, 120))
    y = top + side + 10
    x = pad
    for r in range(cp):
        canvas.rect(x, y, x + 12, y + 10, _RANK_COLORS[r % len(_RANK_COLORS)])
        x = canvas.text(x + 16, y + 2, f"rank {r}") + 14
    canvas.text(pad, y + 18, "rows: query chunks, columns: key chunks (causal)")
    canvas.save(path)
    return ratios
