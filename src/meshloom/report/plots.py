"""The pictures of `meshloom report` and of the docs, drawn with matplotlib (an optional extra:
`pip install 'meshloom[plot]'`; `report.py` imports this module only when it draws).

Figures are built on matplotlib's object API with the Agg canvas, never through pyplot: no
display is needed and no global plotting state is touched in a program that imports meshloom.
Each run picture returns the data it drew, read back from the plotted artists, so a test can
hold the picture against metrics.jsonl.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from meshloom.parallel.pipeline_schedule import (
    INTERLEAVED,
    SCHEDULES,
    Timeline,
    build_schedule,
    simulate,
)

DPI = 100
KIND_COLORS = {"F": "#4285f4", "B": "#34a853", "I": "#f28500", "W": "#8e44ad"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
RANK_COLORS = ["#4285f4", "#ea8600", "#34a853", "#9b59b6", "#db4437", "#00acc1", "#f4b400",
               "#795548"]
Series = dict[str, tuple[list[float], list[float]]]


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | os.PathLike) -> None:
    """Write the PNG under a temporary name and move it into place: a reader never sees half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=DPI)
    tmp.replace(path)


def byte_unit(largest: float) -> tuple[str, float]:
    """The binary unit (and its size) that shows `largest` bytes as a number from 1 to 1024."""
    for name, size in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if largest >= size:
            return name, size
    return "bytes", 1.0


def _drawn(ax) -> Series:
    """What the axes hold, line by labelled line, in the plotted units."""
    return {line.get_label(): ([float(x) for x in line.get_xdata()],
                               [float(y) for y in line.get_ydata()])
            for line in ax.get_lines() if not line.get_label().startswith("_")}


def _style(ax, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, color="#e0e0e0", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.xaxis.get_major_locator().set_params(integer=True)


# ---------------------------------------------------------------- a run's curves


def loss_picture(path: str | os.PathLike, loss: Series, eval_loss: Series) -> dict:
    """Training loss per logged step, and the held-out loss where it was evaluated."""
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    for label, (x, y) in loss.items():
        ax.plot(x, y, color="#4285f4", linewidth=1.6, label=label)
    for label, (x, y) in eval_loss.items():
        ax.plot(x, y, color="#db4437", linewidth=1.4, marker="o", markersize=5, label=label)
    _style(ax, "Loss", "cross-entropy (nats per token)")
    ax.legend(loc="best")
    _save(fig, path)
    return {"unit": "nats", "scale": 1.0, "series": _drawn(ax)}


def _count_label(n: float, _pos=None, digits: int = 6) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.{digits}g}{unit}"
    return f"{n:.{digits}g}"


def throughput_picture(path: str | os.PathLike, tokens_per_s: Series,
                       mfu_per_token_per_s: float | None = None) -> dict:
    """Tokens per second per logged step with its median; where MFU is known (a fixed multiple
    of tokens/s in a run), the right-hand axis reads the same line as MFU."""
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    (label, (x, y)), = tokens_per_s.items()
    ax.plot(x, y, color="#34a853", linewidth=1.6, marker="." if len(x) < 40 else None,
            label=label)
    drawn = _drawn(ax)
    finite = sorted(v for v in y if math.isfinite(v))
    if finite:
        median = statistics.median(finite)
        ax.axhline(median, color="#555555", linestyle="--", linewidth=1,
                   label=f"median {_count_label(median, digits=3)} tokens/s")
        ax.set_ylim(0, finite[-1] * 1.15 or 1)
    _style(ax, "Throughput (global batch)", "tokens / s")
    ax.yaxis.set_major_formatter(FuncFormatter(_count_label))
    if mfu_per_token_per_s:
        k = 100 * mfu_per_token_per_s
        right = ax.secondary_yaxis("right", functions=(lambda t: t * k, lambda m: m / k))
        right.set_ylabel("MFU (%)")
    ax.legend(loc="lower right")
    _save(fig, path)
    return {"unit": "tokens/s", "scale": 1.0, "series": drawn,
            "mfu_per_token_per_s": mfu_per_token_per_s}


def _rank_colors(n: int) -> list:
    if n <= len(RANK_COLORS):
        return RANK_COLORS[:n]
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(i / (n - 1)) for i in range(n)]


def memory_picture(path: str | os.PathLike, per_rank: dict[int, Series], what: str) -> dict:
    """Peak memory of every rank over the steps (each rank's own log): one line per rank, the
    CUDA allocator's reserved peak dashed beside the allocated one when there is one."""
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    ranks = sorted(per_rank)
    top = max((v for s in per_rank.values() for _, ys in s.values() for v in ys), default=1.0)
    unit, size = byte_unit(top)
    colors = _rank_colors(len(ranks))
    for rank, color in zip(ranks, colors, strict=True):
        for label, (x, y) in per_rank[rank].items():
            reserved = label == "reserved"
            ax.plot(x, [v / size for v in y], color=color, linewidth=1.2 if reserved else 1.6,
                    linestyle="--" if reserved else "-",
                    label=f"rank {rank}" + (" reserved" if reserved else ""))
    _style(ax, f"Peak memory per rank ({what})", unit)
    ax.set_ylim(0, top / size * 1.15)  # room above the lines for the legend
    if len(ranks) <= len(RANK_COLORS):
        ax.legend(loc="upper center", ncols=min(4, len(ax.get_lines())), fontsize=9)
    else:  # too many ranks for a legend: colour runs from the first rank to the last
        ax.text(0.99, 0.02, f"ranks {ranks[0]} (dark) to {ranks[-1]} (yellow)",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=9)
    _save(fig, path)
    return {"unit": unit, "scale": size, "series": _drawn(ax)}


def memory_bars_picture(path: str | os.PathLike, peaks: list[int],
                        reserved: list[int] | None, what: str) -> dict:
    """Peak memory per rank over the whole run (runs that logged no per-rank memory files)."""
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    unit, size = byte_unit(max(peaks + (reserved or []), default=1))
    ranks = list(range(len(peaks)))
    width = 0.4 if reserved else 0.7
    shift = width / 2 if reserved else 0.0
    bars = {"peak": ax.bar([r - shift for r in ranks], [p / size for p in peaks], width,
                           color="#4285f4", label="peak")}
    if reserved:
        bars["reserved"] = ax.bar([r + shift for r in ranks], [p / size for p in reserved],
                                  width, color="#a0c3ff", label="reserved")
    ax.set_title(f"Peak memory per rank, whole run ({what})", fontsize=11)
    ax.set_xlabel("rank")
    ax.set_ylabel(unit)
    ax.set_xticks(ranks)
    ax.grid(True, axis="y", color="#e0e0e0", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.set_ylim(0, max(peaks + (reserved or []), default=1) / size * 1.15)
    ax.legend(loc="upper center", ncols=2)
    _save(fig, path)
    series = {label: (ranks, [float(b.get_height()) for b in group])
              for label, group in bars.items()}
    return {"unit": unit, "scale": size, "series": series}


def _bytes_label(n: float, _pos=None) -> str:
    unit, size = byte_unit(n)
    return f"{n / size:g} {unit}" if unit != "bytes" else f"{n:g} B"


def comm_picture(path: str | os.PathLike, per_axis: Series) -> dict:
    """Payload bytes rank 0 handed to collectives in each logged step, one line per mesh axis.
    Axes that differ by orders of magnitude (a few loss scalars beside the gradients) share
    a log scale, where each line keeps its own shape."""
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    values = [v for _, ys in per_axis.values() for v in ys]
    top = max(values, default=1.0)
    positive = [v for v in values if v > 0]
    log = bool(positive) and top / min(positive) > 100
    unit, size = ("bytes", 1.0) if log else byte_unit(top)
    for i, (axis, (x, y)) in enumerate(sorted(per_axis.items())):
        ax.plot(x, [v / size for v in y], color=RANK_COLORS[i % len(RANK_COLORS)],
                linewidth=1.6, marker="." if len(x) < 40 else None, label=axis)
    _style(ax, "Communication per step, rank 0 (payload bytes per mesh axis)",
           "bytes per step (log scale)" if log else unit)
    if log:
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(FuncFormatter(_bytes_label))
        ax.set_ylim(min(positive) / 4, top * 4)
    else:
        ax.set_ylim(0, top / size * 1.12 or 1)
    ax.legend(title="axis", loc="best")
    _save(fig, path)
    return {"unit": unit, "scale": size, "series": _drawn(ax)}


# ---------------------------------------------------------------- pipeline timelines


def _shade(color: str, chunk: int) -> tuple[float, float, float]:
    """The kind's colour for chunk 0, mixed with more white for each later chunk."""
    mix = min(0.6, 0.4 * chunk)
    return tuple(c + (1 - c) * mix for c in to_rgb(color))


def draw_timelines(path: str | os.PathLike, panels: list[tuple[str, Timeline]],
                   scale: float = 1.0, unit: str = "", row_label: str = "rank") -> None:
    """One PNG with a panel per (title, timeline), stacked on one time axis: a row per rank, a
    box per compute action coloured by kind (lighter for later chunks), labelled with its
    micro-batch where the box is wide enough. Times are multiplied by `scale` for the axis."""
    t_end = max((t.makespan + t.start for _, t in panels), default=0.0) or 1.0
    pp = max((len(t.spans) for _, t in panels), default=1)
    stages = 1 + max((a.stage for _, t in panels for r in t.spans for _, _, a in r), default=0)
    v = max(1, math.ceil(stages / pp))
    kinds = [k for k in KIND_COLORS
             if any(a.kind == k for _, t in panels for r in t.spans for _, _, a in r)]
    width = 10.0
    heights = [0.42 * len(t.spans) + 0.75 for _, t in panels]
    fig = _figure(width, sum(heights) + 0.55)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    # Pixels per unit of time, for deciding which boxes can hold their label.
    px_per_t = 0.88 * width * DPI / (t_end * scale)
    for ax, (title, timeline) in zip(axes, panels, strict=True):
        for r, spans in enumerate(timeline.spans):
            for s, e, a in spans:
                color = _shade(KIND_COLORS.get(a.kind, "#888888"), a.stage // pp)
                ax.add_patch(Rectangle((s * scale, r - 0.4), (e - s) * scale, 0.8,
                                       facecolor=color, edgecolor="white", linewidth=0.6))
                label = str(a.mb)
                if (e - s) * scale * px_per_t >= 7 * len(label) + 4:
                    ink = "white" if sum(color) < 1.8 else "#141414"
                    ax.text((s + e) / 2 * scale, r, label, ha="center", va="center",
                            fontsize=8, color=ink)
        ax.set_ylim(len(timeline.spans) - 0.5, -0.5)  # rank 0 on top
        ax.set_yticks(range(len(timeline.spans)),
                      [f"{row_label} {r}" for r in range(len(timeline.spans))])
        ax.set_xlim(0, t_end * scale)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(True, axis="x", color="#e0e0e0", linewidth=0.8)
        ax.set_axisbelow(True)
        ax.tick_params(axis="y", length=0)
    axes[-1].set_xlabel(f"time ({unit})" if unit else "time")
    if unit == "units":  # unit costs: whole numbers on the time axis
        axes[-1].xaxis.get_major_locator().set_params(integer=True)
    handles = [Patch(color=KIND_COLORS[k], label=f"{k}: {KIND_NAMES[k]}") for k in kinds]
    if v > 1:
        handles += [Patch(color=_shade(KIND_COLORS["F"], c), label=f"chunk {c}: lighter")
                    for c in range(1, v)]
    handles.append(Patch(color="white", label="numbers: micro-batch"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=9,
               frameon=False)
    _save(fig, path)


def schedule_pictures(folder: str | os.PathLike, pp: int = 4, m: int = 8, v: int = 2) -> dict:
    """docs/img/pp_<schedule>.png: every schedule simulated on unit costs; returns the bubbles."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bubbles = {}
    for name in SCHEDULES:
        vv = v if name in INTERLEAVED else 1
        t = simulate(build_schedule(name, pp, m, vv))
        bubbles[name] = t.bubble()
        extra = f", v={vv}" if vv > 1 else ""
        title = (f"{name}: p={pp}{extra}, m={m}, unit costs: makespan {t.makespan:g}, "
                 f"bubble {t.bubble():.1%}")
        draw_timelines(folder / f"pp_{name}.png", [(title, t)], unit="units")
    return bubbles


def zigzag_picture(path: str | os.PathLike, cp: int = 4) -> dict[str, float]:
    """docs/img/cp_zigzag.png: the causal score matrix in 2·cp x 2·cp chunk blocks, each
    unmasked block coloured by the cp rank whose queries it is, for the contiguous split (left)
    and the zigzag split (right); returns each split's max/min work ratio."""
    from meshloom.parallel.context import attention_work

    n = 2 * cp
    fig = _figure(7.5, 4.6)
    axes = fig.subplots(1, 2)
    ratios = {}
    for ax, zigzag in zip(axes, (False, True), strict=True):
        owner = ([i if i < cp else n - 1 - i for i in range(n)] if zigzag
                 else [i // 2 for i in range(n)])
        work = [attention_work(64 * n, cp, r, zigzag) for r in range(cp)]
        name = "zigzag" if zigzag else "contiguous"
        ratios[name] = max(work) / min(work)
        for qc in range(n):
            for kc in range(qc + 1):
                color = RANK_COLORS[owner[qc] % len(RANK_COLORS)]
                if kc == qc:  # half of the diagonal block is masked
                    color = _shade(color, 1)
                ax.add_patch(Rectangle((kc, qc), 1, 1, facecolor=color, edgecolor="white",
                                       linewidth=1.5))
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_aspect("equal", adjustable="box")
        ax.set_xticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)], fontsize=8)
        ax.set_yticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)], fontsize=8)
        ax.tick_params(length=0)
        ax.set_xlabel("key chunk")
        ax.set_ylabel("query chunk")
        ax.set_title(f"{name}: max/min work {ratios[name]:.2f}", fontsize=10)
    handles = [Patch(color=RANK_COLORS[r % len(RANK_COLORS)], label=f"rank {r}")
               for r in range(cp)]
    fig.legend(handles=handles, loc="outside lower center", ncols=cp, frameon=False,
               title=f"cp = {cp}: who computes each block (light: diagonal, half masked)",
               title_fontsize=9)
    _save(fig, path)
    return ratios
