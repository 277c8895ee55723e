"""`python benchmarks/planner_results.py` regenerates every planner result: each file committed
under benchmarks/results/planner/ is written by one of its steps, and every benchmark script
that writes there is one of them (a new one left out would go stale unnoticed)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
PLANNER = BENCHMARKS / "results" / "planner"
# Scripts that read the planner results without writing any.
READERS = {"tables.py", "run_all.py", "planner_results.py"}


def _written(script: str, args: list[str]) -> set[Path]:
    if "--out" in args:
        return {(ROOT / args[args.index("--out") + 1]).resolve()}
    module = load_benchmark(script.removesuffix(".py"))
    if script == "planner_examples.py":
        return ({(module.OUT / f"{name}.json").resolve() for name in module.EXAMPLES}
                | {(module.OUT / f"{module.WORKED}.txt").resolve()})
    out = getattr(module, "DEFAULT_OUT", None) or getattr(module, "OUT", None)
    return {Path(out).resolve()} if out is not None else set()


def test_every_planner_result_is_written_by_a_step():
    steps = load_benchmark("planner_results").STEPS
    written = set().union(*(_written(script, args) for script, *args in steps))
    committed = {p.resolve() for p in PLANNER.iterdir() if p.is_file()}
    assert committed - written == set(), "committed but written by no step"
    assert written - committed == set(), "written by a step but not committed"


def test_every_script_writing_planner_results_is_a_step():
    steps = {script for script, *_ in load_benchmark("planner_results").STEPS}
    writes = re.compile(r'"results"\s*/\s*"planner"|results/planner/')
    writers = {p.name for p in BENCHMARKS.glob("*.py")
               if p.name not in READERS and writes.search(p.read_text())}
    assert writers <= steps, sorted(writers - steps)


def test_the_steps_inputs_are_committed():
    for script, *args in load_benchmark("planner_results").STEPS:
        assert (BENCHMARKS / script).is_file(), script
        for flag in ("--profile", "--kernels"):
            if flag in args:
                assert (ROOT / args[args.index(flag) + 1]).is_file(), (script, flag)
