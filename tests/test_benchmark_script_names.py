"""A script run as `python benchmarks/NAME.py` has benchmarks/ first on its import path, so a
script named like an installed module hides it from everything the script imports. It happened:
transformers 5 imports Hugging Face's `kernels` package, and benchmarks/kernels.py (now
kernel_rates.py) stood in its place, failing benchmarks/gpu_mfu.py's GPT-2 import."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_no_benchmark_script_shadows_an_installed_or_standard_module():
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != BENCHMARKS]
    clashes = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        name = script.stem
        if name in sys.stdlib_module_names or name in sys.builtin_module_names:
            clashes.append(f"{name} (standard library)")
        elif importlib.machinery.PathFinder.find_spec(name, elsewhere) is not None:
            clashes.append(f"{name} (installed)")
    assert not clashes, f"benchmarks/ scripts named like other modules: {', '.join(clashes)}"
