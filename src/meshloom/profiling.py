"""`run.profile_start` / `run.profile_steps`: PyTorch's profiler over a few training steps.

Each rank writes into `RUN_DIR/profile/`:
- `rank{R}.trace.json`: the Chrome / Perfetto trace of those steps (host ops and, on a GPU,
  every kernel on its stream);
- `rank{R}_kernels.json`: per kernel (on a GPU) or per op (on a CPU) the count and total time
  over the profiled steps, longest first, and their sum: where a step's time goes without
  opening the trace (docs/metrics.md).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from meshloom.checkpoint.files import write_json_atomic


class StepProfiler:
    """Profiles steps `start` .. `start + steps - 1` (1-based, as the metrics count them) of
    this rank's run; `step_done()` after each step."""

    def __init__(self, run_dir: Path, rank: int, device: torch.device, start: int, steps: int,
                 first_step: int = 1):
        self.out = run_dir / "profile"
        self.rank, self.device = rank, device
        self.cuda = device.type == "cuda"
        # One warm-up step before the active ones when the run has one to spare.
        skip = max(0, start - first_step)
        warmup = 1 if skip >= 1 else 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities,
                            schedule=schedule(wait=skip - warmup, warmup=warmup, active=steps,
                                              repeat=1),
                            on_trace_ready=self._write)
        self.steps = steps
        self.prof.start()
        self.stopped = False

    def step_done(self) -> None:
        if not self.stopped:
            self.prof.step()

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.prof.stop()

    def _write(self, prof) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out / f"rank{self.rank}.trace.json"))
        device_kind = torch.autograd.DeviceType.CUDA if self.cuda else None
        rows = []
        for e in prof.key_averages():
            if device_kind is not None and e.device_type != device_kind:
                continue  # on a GPU the kernels; their host ops are in the trace
            total_us = e.device_time_total if self.cuda else e.self_cpu_time_total
            if total_us > 0:
                rows.append({"name": e.key[:200], "count": e.count,
                             "total_ms": round(total_us / 1e3, 4)})
        rows.sort(key=lambda r: -r["total_ms"])
        summary = {"rank": self.rank, "steps": self.steps, "device": str(self.device),
                   "what": "GPU kernels" if self.cuda else "CPU ops (self time)",
                   "total_ms": round(sum(r["total_ms"] for r in rows), 3), "kernels": rows}
        write_json_atomic(self.out / f"rank{self.rank}_kernels.json", summary)
