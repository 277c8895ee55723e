"""Smoke test of benchmarks/pp_schedules.py: one short `meshloom train` per schedule at pp 2 on
the tiny model, then the report's numbers, checked for shape and for the unit-cost bubbles that
the schedules alone fix."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark


def test_pp_schedules_smoke(tmp_path):
    out = tmp_path / "pp_schedules.json"
    steps, m = 2, 4
    bench = load_benchmark("pp_schedules")
    result = bench.main(["--preset", "tiny", "--steps", str(steps), "--microbatches", str(m),
                         "--micro-batch", "1", "--seq", "32", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    runs = result["runs"]
    assert list(runs) == ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb"]
    # What the runs' own timelines say they ran (as `meshloom report` reads them).
    assert all(r["schedule_run"] == name and r["microbatches"] == m for name, r in runs.items())
    assert runs["interleaved_1f1b"]["virtual_stages"] == runs["interleaved_zb"][
        "virtual_stages"] == 2
    # Unit costs, p = 2, m = 4: (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(vm+p-1) interleaved,
    # (p-1)/(3m+p-1) for zb_h1, (p-1)/(3vm+p-1) for interleaved_zb (docs/pipeline.md). A run
    # under the wrong schedule breaks these.
    unit = {k: r["predicted_bubble_unit_costs"] for k, r in runs.items()}
    assert unit == pytest.approx({"gpipe": 1 / 5, "1f1b": 1 / 5, "interleaved_1f1b": 1 / 9,
                                  "zb_h1": 1 / 13, "interleaved_zb": 1 / 25})
    for r in runs.values():
        assert len(r["bubble_per_step"]) == steps
        assert 0 <= r["measured_bubble"] < 1 and r["makespan_ms"] > 0
        assert 0 <= r["predicted_bubble_measured_costs"] < 1
