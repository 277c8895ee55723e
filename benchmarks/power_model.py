"""What a GPU's power limit would do to a planned step, from kernel-level measurements only.

A Hopper GPU at its 700 W limit lowers its clock the more of the time its tensor cores are
busy. `power_duty_cycle.py` measured the GEMM rate against that busy fraction (the duty) on an
H200 (benchmarks/measured/h200-2026-11-28): 0.99 of the rate from idle at duty 0.3, 0.84 at
duty 1. `gemm_sustained.py` measured the duty-1 end on the H100 itself (0.86, 2026-11-26) and
on the H200 (0.84). The H100 curve here is the H200's, its drop scaled so that duty 1 lands on
the H100's own measurement: both are the same GH100 die at the same 700 W, and their duty-1
points differ by two points.

The kernel table's GEMM rates are not rates from idle: the H100 table's rows are mostly one
continuous sweep (shisa's mamf-finder run), and at the four shapes both were measured the
table reads 0.88 of the H100's from-idle rate and 1.02 of its sustained one. So a step at
duty d runs its GEMMs at `ratio(d) / table_fraction` times the table's rate. The validation
(planner_validation.py, `error_power_duty`) prices each H100 row so, to a fixed point: the
duty is the step's GEMM and attention seconds over its step time, under the GEMM rate that
duty gives. Communication waits and bubbles count as the copies the measurement filled its
idle part with, which draw more power than an idle GPU: the slowdown is if anything
overstated.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
DUTY_CYCLE = HERE / "measured" / "h200-2026-11-28" / "power_duty_cycle.json"
H100_SUSTAINED = HERE / "measured" / "h100-2026-11-26" / "gemm_sustained.json"

Curve = list[tuple[float, float]]


def duty_curve(path: Path = DUTY_CYCLE) -> Curve:
    """(measured duty, GEMM rate in the mix / rate from idle), rising in duty, from (0, 1)."""
    raw = json.loads(path.read_text())
    burst = raw["burst_tflops"]
    points = sorted((r["duty_measured"], r["gemm_tflops"] / burst) for r in raw["rows"])
    if not points or points[0][0] <= 0.0:
        raise ValueError(f"{path.name}: needs rows with a positive measured duty")
    return [(0.0, 1.0), *points]


def interpolate(curve: Curve, duty: float) -> float:
    """The curve at `duty` (clamped to [0, 1]), linear between measured points."""
    duty = min(1.0, max(0.0, duty))
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if duty <= x1:
            return y0 + (y1 - y0) * (duty - x0) / (x1 - x0) if x1 > x0 else y1
    return curve[-1][1]


def anchored(curve: Curve, duty_one: float) -> Callable[[float], float]:
    """The curve with its drop from 1 scaled so that duty 1 gives `duty_one`."""
    own = interpolate(curve, 1.0)
    if not 0.0 < own < 1.0 or not 0.0 < duty_one <= 1.0:
        raise ValueError("duty-1 ratios must lie in (0, 1)")
    scale = (1.0 - duty_one) / (1.0 - own)
    return lambda d: 1.0 - (1.0 - interpolate(curve, d)) * scale


def sustained_rows(path: Path = H100_SUSTAINED) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def duty_one_ratio(rows: list[dict]) -> float:
    """Mean sustained / from-idle GEMM rate over gemm_sustained.json's shapes."""
    return statistics.mean(r["sustained_tflops"] / r["burst_tflops"] for r in rows)


def table_fraction(rows: list[dict], rate: Callable[[int, int, int], float],
                   against: str = "burst_tflops") -> float:
    """Mean of the table's rate / the measured rate (`against`: from idle or sustained) over
    gemm_sustained.json's shapes."""
    return statistics.mean(rate(r["m"], r["n"], r["k"]) / r[against] for r in rows)


def fixed_point(step: Callable[[float], tuple[float, float]], ratio: Callable[[float], float],
                fraction: float, tol: float = 1e-4, rounds: int = 20) -> tuple[float, float]:
    """(GEMM rate factor on the table, duty) where they agree. `step(factor)` prices the step
    with the table's GEMM rates times `factor` and returns (tensor-core seconds, step seconds);
    the factor a duty gives is ratio(duty) / fraction."""
    factor = 1.0
    for _ in range(rounds):
        busy, total = step(factor)
        duty = busy / total
        new = ratio(duty) / fraction
        if abs(new - factor) < tol:
            return new, duty
        factor = new
    raise RuntimeError(f"power fixed point did not settle in {rounds} rounds")
