"""benchmarks/power_model.py: the power limit's effect on GEMMs, read from kernel-level
measurements (the H200 duty-cycle sweep, the H100 and H200 sustained GEMMs)."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

pm = load_benchmark("power_model")


def test_committed_duty_curve_falls_from_one():
    curve = pm.duty_curve()
    assert curve[0] == (0.0, 1.0) and len(curve) == 7
    duties = [d for d, _ in curve]
    ratios = [r for _, r in curve]
    assert duties == sorted(duties) and duties[-1] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(ratios, ratios[1:], strict=False))  # busier is slower
    assert 0.8 < ratios[-1] < 0.9  # the H200 held 0.84 of its rate from idle at duty 1


def test_interpolate_and_anchor():
    curve = [(0.0, 1.0), (0.5, 0.9), (1.0, 0.8)]
    assert pm.interpolate(curve, 0.25) == pytest.approx(0.95)
    assert pm.interpolate(curve, 1.7) == pytest.approx(0.8)  # clamped
    assert pm.interpolate(curve, -1.0) == pytest.approx(1.0)
    f = pm.anchored(curve, 0.9)  # the drop halved
    assert f(0.0) == pytest.approx(1.0) and f(1.0) == pytest.approx(0.9)
    assert f(0.5) == pytest.approx(0.95)
    with pytest.raises(ValueError):
        pm.anchored(curve, 1.5)


def test_sustained_ratios_of_both_gpus_agree():
    """The H100's curve is the H200's scaled to the H100's own duty-1 point: the two GPUs'
    sustained / from-idle ratios over the same four GEMMs differ by a few points only."""
    h100 = pm.duty_one_ratio(pm.sustained_rows())
    h200 = pm.duty_one_ratio(pm.sustained_rows(
        pm.HERE / "measured" / "h200-2026-11-28" / "gemm_sustained.json"))
    assert 0.8 < h200 < h100 < 0.9 and h100 - h200 < 0.04


def test_table_fraction():
    rows = [{"m": 1, "n": 1, "k": 1, "burst_tflops": 100.0, "sustained_tflops": 80.0},
            {"m": 2, "n": 2, "k": 2, "burst_tflops": 200.0, "sustained_tflops": 160.0}]
    assert pm.table_fraction(rows, lambda m, n, k: 90.0 * m) == pytest.approx(0.9)
    assert pm.table_fraction(rows, lambda m, n, k: 90.0 * m, "sustained_tflops") == \
        pytest.approx(1.125)


def test_fixed_point_settles_where_duty_and_rate_agree():
    """A step of 6 s of GEMMs at the table's rate and 4 s of other work; the GEMM factor is
    linear in the duty. The fixed point solves f = r(6/f / (6/f + 4)) / fraction."""
    ratio = lambda d: 1.0 - 0.2 * d  # noqa: E731
    factor, duty = pm.fixed_point(lambda f: (6.0 / f, 6.0 / f + 4.0), ratio, 0.9)
    assert duty == pytest.approx((6.0 / factor) / (6.0 / factor + 4.0), abs=1e-3)
    assert factor == pytest.approx(ratio(duty) / 0.9, abs=1e-3)
    with pytest.raises(RuntimeError):  # a map that never settles is refused, not looped on
        pm.fixed_point(lambda f: (1.0, 2.0 if f >= 1.1 else 1.25), lambda d: d, 0.5,
                       rounds=5)


def test_duty_curve_refuses_a_file_without_rows(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"burst_tflops": 800.0, "rows": []}))
    with pytest.raises(ValueError):
        pm.duty_curve(bad)
