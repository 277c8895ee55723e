"""Regenerate every planner result (benchmarks/results/planner/) and the docs and README tables
that quote them, in one command, after a change to the planner:

    python benchmarks/planner_results.py

Analytical throughout (the planner's formulas on committed inputs: published runs, kernel
tables, a profiled step; no hardware is measured), so any machine gives the same files, in
about a minute. `git diff` then shows what the change moved; the tests (test_plan_validation,
test_plan_examples and the others that read these files) hold the committed files to the code.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEASURED = "benchmarks/measured/h100-2026-11-26"

# In order: the sweeps and the held-out session read the validation's published runs, and the
# README tables come last, from the files written before them.
STEPS: list[list[str]] = [
    ["planner_validation.py"],
    ["planner_examples.py"],
    ["llmfoundry_seq_sweep.py"],
    ["llmfoundry_mb_sweep.py"],
    ["llmfoundry_h100old.py"],
    ["nccl_choice.py"],
    ["gpt2_fsdp_plan.py", "--out", "benchmarks/results/planner/gpt2_fsdp.json"],
    ["profile_vs_plan.py", "--profile", f"{MEASURED}/profile_kernels.json",
     "--kernels", f"{MEASURED}/h100-kernels.json"],
    ["run_all.py", "--tables-only"],
]


def main() -> int:
    for script, *args in STEPS:
        print(f"== python benchmarks/{' '.join([script, *args])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run([sys.executable, str(HERE / script), *args], cwd=HERE.parent,
                            stdout=subprocess.DEVNULL).returncode
        if rc != 0:
            print(f"planner_results: {script} failed (exit status {rc}); the files after it "
                  "were not regenerated", file=sys.stderr)
            return rc
        print(f"   done in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
