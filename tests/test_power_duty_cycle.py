"""benchmarks/power_duty_cycle.py, the GPU measurement a power model needs (docs/kernel-tables.md,
"Power"): the parts that run without a GPU, so the script is ready when one is lent."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT, load_benchmark


def test_a_cycle_fills_its_period_at_the_asked_gemm_duty():
    """The GEMM and copy counts of one period reproduce the asked duty from the idle timings
    to within one kernel of either kind, and duty 1 is GEMMs only."""
    pdc = load_benchmark("power_duty_cycle")
    gemm_s, copy_s = 1.4e-3, 0.4e-3  # an 8192^3 bf16 GEMM and a 1 GiB copy on an H100
    for duty in (0.25, 0.5, 0.7, 0.85):
        cycle = pdc.plan_cycle(duty, gemm_s, copy_s)
        assert cycle.gemms >= 1 and cycle.copies >= 1
        assert abs(cycle.gemms * gemm_s - duty * pdc.PERIOD_S) <= gemm_s / 2
        assert abs(cycle.duty(gemm_s, copy_s) - duty) < 0.03
    full = pdc.plan_cycle(1.0, gemm_s, copy_s)
    assert full.copies == 0 and full.duty(gemm_s, copy_s) == 1.0
    for bad in (0.0, 1.2, -0.5):
        with pytest.raises(ValueError, match="must be in"):
            pdc.plan_cycle(bad, gemm_s, copy_s)
    with pytest.raises(ValueError, match="positive"):
        pdc.plan_cycle(0.5, 0.0, copy_s)


def test_a_run_is_summarised_from_its_settled_half():
    """The first half of a run (the clock still falling from idle) is left out."""
    pdc = load_benchmark("power_duty_cycle")
    samples = [{"gemm_tflops": 700.0, "copy_gbps": 2900.0, "sm_mhz": 1980.0, "power_w": 500.0,
                "duty_measured": 0.5}] * 4 + \
              [{"gemm_tflops": 600.0, "copy_gbps": None, "sm_mhz": 1500.0, "power_w": 700.0,
                "duty_measured": 0.6}] * 4
    out = pdc.summarise(samples)
    assert out == {"gemm_tflops": 600.0, "copy_gbps": None, "sm_mhz": 1500.0,
                   "power_w": 700.0, "duty_measured": 0.6}
    with pytest.raises(ValueError):
        pdc.summarise([])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_the_script_says_so_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "power_duty_cycle.py"),
                          "--out", str(tmp_path / "x.json")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and not (tmp_path / "x.json").exists()
    assert out.stderr.strip().splitlines() == [
        "power_duty_cycle.py: needs a CUDA GPU (none is visible)"]
