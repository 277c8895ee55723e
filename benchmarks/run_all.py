"""Rerun every CPU benchmark with the settings the docs quote, then regenerate the README tables.

    python benchmarks/run_all.py                 # all jobs, then the tables (takes a while)
    python benchmarks/run_all.py --only cp_memory,planner_validation
    python benchmarks/run_all.py --tables-only   # tables from the committed files, runs nothing

Each job writes `results/<machine>/<job>.json`, to which this script adds a `meta` block: the
commit, torch and Python versions, the machine (CPU model, cores), the date, the exact command
and the load average sampled every few seconds while the job ran. The jobs run one after the
other, never two at once: each benchmark interleaves the variants it compares within one run,
which is what keeps its ratios meaningful on a shared machine; two benchmarks side by side would
only load each other.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tables  # noqa: E402
from _launch import git_state, parser  # noqa: E402

MACHINE = f"cpu-{len(os.sched_getaffinity(0))}core-{platform.machine()}"
LOAD_SAMPLE_S = 5.0
PLANNER_NOTE = "analytical: the planner's formulas, no hardware measured; the machine is irrelevant"
NOTE = ("a shared machine: other jobs (the lead's and other helpers' tests) ran beside this one, "
        "see load_average; each benchmark interleaves the variants it compares within one run, so "
        "its ratios hold under load while its absolute times do not")

# (job name, script, arguments): the settings the docs and benchmarks/README.md quote.
JOBS: list[tuple[str, str, list[str]]] = [
    ("planner_validation", "planner_validation.py", []),
    ("ddp_vs_torch_demo", "ddp_vs_torch.py", ["--preset", "demo", "--steps", "100"]),
    ("ddp_vs_torch_small", "ddp_vs_torch.py", ["--preset", "small", "--steps", "60"]),
    ("dp_vs_ddp_demo", "dp_vs_ddp.py", ["--preset", "demo", "--steps", "30"]),
    ("dp_vs_ddp_small", "dp_vs_ddp.py", ["--preset", "small", "--steps", "16"]),
    ("zero_vs_fsdp2_demo", "zero_vs_fsdp2.py", ["--preset", "demo", "--steps", "20"]),
    ("zero3_accumulation_demo", "zero3_accumulation.py", ["--preset", "demo", "--steps", "20"]),
    ("tp_vs_dtensor_demo", "tp_vs_dtensor.py", ["--preset", "demo", "--steps", "20"]),
    ("pp_vs_torch_demo", "pp_vs_torch.py", ["--preset", "demo", "--steps", "30"]),
    ("pp_lists_vs_torch", "pp_lists_vs_torch.py", []),
    ("cp_memory", "cp_memory.py", ["--seq", "4096", "--steps", "5"]),
    ("moe_ep", "moe_ep.py", ["--nproc", "2", "--steps", "30"]),
    ("tp_generate", "tp_generate.py", ["--repeats", "5"]),
    ("pp_schedules", "pp_schedules.py", ["--steps", "6"]),
    # Read by tests/test_plan_validation.py: the planner's bubble against this recorded run.
    ("pp_bubble", "pp_bubble.py", ["--steps", "40"]),
    ("dp_vs_ddp_tiny", "dp_vs_ddp.py", ["--preset", "tiny", "--steps", "30"]),
    ("zero_vs_fsdp2_small", "zero_vs_fsdp2.py", ["--preset", "small", "--steps", "10"]),
    ("tp_vs_dtensor_small", "tp_vs_dtensor.py", ["--preset", "small", "--steps", "20"]),
    ("tp_generate_long_prompt", "tp_generate.py",
     ["--tps", "1,2", "--prompt-len", "512", "--new-tokens", "32", "--repeats", "3"]),
    ("gpt2_vs_transformers", "gpt2_vs_transformers.py",
     ["--layers", "2", "--steps", "12", "--threads", "1"]),
    ("ps_parity", "ps_parity.py", ["--steps", "100"]),
]


class LoadSampler:
    """Samples the 1-minute load average in a thread while a job runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(round(os.getloadavg()[0], 2))
            if self._stop.wait(LOAD_SAMPLE_S):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def record(self) -> dict:
        s = self.samples
        return {"min": min(s), "max": max(s), "mean": round(sum(s) / len(s), 2),
                "samples": s, "every_s": LOAD_SAMPLE_S}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def meta(command: list[str], started: str, seconds: float, load: dict) -> dict:
    return {"machine": MACHINE, "cpu_model": cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "torch": torch.__version__,
            "python": platform.python_version(), **git_state(), "date": started,
            "wall_s": round(seconds, 1), "command": " ".join(command),
            "load_average_1min": load, "note": NOTE}


def run_job(name: str, script: str, args: list[str], results: Path) -> bool:
    out = tables.planner_file(results) if name == "planner_validation" else results / f"{name}.json"
    shown = out.relative_to(HERE.parent) if out.is_relative_to(HERE.parent) else out
    command = ["python", f"benchmarks/{script}", *args, "--out", str(shown)]
    started = datetime.now(UTC).isoformat(timespec="seconds")
    print(f"== {name}: {' '.join(command)}", flush=True)
    t0 = time.monotonic()
    with LoadSampler() as load:
        rc = subprocess.run([sys.executable, str(HERE / script), *args, "--out", str(out)],
                            cwd=HERE.parent).returncode
    if rc != 0 or not out.exists():
        print(f"== {name} failed (exit status {rc})", flush=True)
        return False
    result = json.loads(out.read_text())
    result["meta"] = meta(command, started, time.monotonic() - t0, load.record())
    if name == "planner_validation":
        result["meta"]["note"] = PLANNER_NOTE
    out.write_text(json.dumps(result, indent=2) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--tables-only", action="store_true",
                   help="regenerate the README tables from the committed results, run nothing")
    p.add_argument("--only", default="", help="comma-separated job names (default: all)")
    p.add_argument("--results", type=Path, default=None,
                   help=f"folder of the result files (default: results/{MACHINE}/ when running, "
                        "the README's own folder with --tables-only)")
    args = p.parse_args(argv)
    if args.results is None and args.tables_only:
        try:
            args.results = tables.readme_results(tables.README.read_text())
        except ValueError as e:
            p.error(str(e))
    args.results = args.results or HERE / "results" / MACHINE
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {j[0] for j in JOBS})
    if unknown:
        p.error(f"--only: unknown job(s) {','.join(unknown)}; known: "
                f"{','.join(j[0] for j in JOBS)}")
    failed = []
    if not args.tables_only:
        args.results.mkdir(parents=True, exist_ok=True)
        for name, script, job_args in JOBS:
            if (not names or name in names) and not run_job(name, script, job_args, args.results):
                failed.append(name)
    try:
        text = tables.apply(tables.README.read_text(), tables.render(args.results))
    except FileNotFoundError as e:
        print(f"run_all.py: no result file {e.filename}: run its job first (--only NAME)",
              file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"run_all.py: {e}", file=sys.stderr)
        return 2
    tables.README.write_text(text)
    print(f"tables regenerated in {tables.README}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
