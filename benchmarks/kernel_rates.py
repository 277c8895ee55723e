"""Measure this machine's kernel rates into a kernel table for the planner: the same code as
`meshloom bench kernels` (src/meshloom/plan/kernel_bench.py; docs/kernel-tables.md).

    python benchmarks/kernel_rates.py [--model PRESET ...] [--seq 2048 --micro-batch 1,2,4,8
        --tp 1,2,4,8] [--dtype bf16] [--out PATH] [--gpu-name NAME] [--quick]
"""

from __future__ import annotations

import sys

from meshloom.commands import main

if __name__ == "__main__":
    sys.exit(main(["bench", "kernels", *sys.argv[1:]]))
