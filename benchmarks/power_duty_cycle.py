"""How fast a GEMM runs when a step mixes it with memory-bound work: the GPU's power limit
lowers its clock the more of the time its tensor cores are busy, so a GEMM-dense step's GEMMs
run slower than the same GEMM timed from idle (`meshloom bench kernels`) and a step with much
elementwise work between its GEMMs runs them nearer that burst rate (docs/kernel-tables.md,
"Power"). This measures the GEMM rate, the copy bandwidth, the SM clock and the board power at
several GEMM duty cycles: each cycle runs GEMMs for a fraction `d` of a period and bandwidth-
bound copies for the rest, back to back for many seconds. Needs CUDA:

    python benchmarks/power_duty_cycle.py --seconds 12 --out power_duty_cycle.json

It only reads the GPU's settings (nvidia-smi); it never changes a clock or a power limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DUTIES = (0.25, 0.5, 0.7, 0.85, 1.0)
GEMM = (8192, 8192, 8192)  # bf16, compute-bound at every clock
COPY_BYTES = 1 << 30  # one copy reads and writes 512 MiB: far beyond L2, bandwidth-bound
PERIOD_S = 0.02  # one cycle: long against a launch, short against the power controller


@dataclass(frozen=True)
class Cycle:
    """One period of the mix: `gemms` GEMMs, then `copies` copies."""
    gemms: int
    copies: int

    def duty(self, gemm_s: float, copy_s: float) -> float:
        busy = self.gemms * gemm_s
        return busy / (busy + self.copies * copy_s) if busy else 0.0


def plan_cycle(duty: float, gemm_s: float, copy_s: float, period_s: float = PERIOD_S) -> Cycle:
    """The counts of GEMMs and copies whose times (each timed from idle) fill `period_s` with
    GEMMs for the fraction `duty` of it, at least one GEMM; duty 1 runs no copy."""
    if not 0.0 < duty <= 1.0:
        raise ValueError(f"duty {duty} must be in (0, 1]")
    if gemm_s <= 0 or copy_s <= 0:
        raise ValueError("gemm_s and copy_s must be positive")
    gemms = max(1, round(duty * period_s / gemm_s))
    if duty == 1.0:
        return Cycle(gemms, 0)
    copies = max(1, round(gemms * gemm_s * (1.0 - duty) / duty / copy_s))
    return Cycle(gemms, copies)


def summarise(samples: list[dict]) -> dict:
    """The settled half of a run (the second half of its samples): mean GEMM TFLOP/s and copy
    GB/s inside the mix, SM clock, power and the duty the timings show."""
    if not samples:
        raise ValueError("no samples")
    tail = samples[len(samples) // 2:]

    def mean(key: str) -> float | None:
        values = [s[key] for s in tail if s.get(key) is not None]
        return round(statistics.mean(values), 2) if values else None

    return {key: mean(key) for key in ("gemm_tflops", "copy_gbps", "sm_mhz", "power_w",
                                       "duty_measured")}


def smi() -> dict:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,power.limit",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    clock, power, limit = (float(v) for v in out.stdout.strip().split(","))
    return {"sm_mhz": clock, "power_w": power, "power_limit_w": limit}


def run_mix(cycle: Cycle, seconds: float, a, b, c, src, dst) -> list[dict]:  # pragma: no cover
    """Run `cycle` back to back for `seconds`; every ~0.5 s one sample of the GEMM and copy
    rates (CUDA events around each part of one cycle) and the clock and power."""
    import torch

    m, n, k = GEMM
    samples, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.5:
            for _ in range(cycle.gemms):
                torch.matmul(a, b, out=c)
            for _ in range(cycle.copies):
                dst.copy_(src)
        g0, g1, c1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        g0.record()
        for _ in range(cycle.gemms):
            torch.matmul(a, b, out=c)
        g1.record()
        for _ in range(cycle.copies):
            dst.copy_(src)
        c1.record()
        reading = smi()  # read while the queue still runs
        c1.synchronize()
        gemm_s = g0.elapsed_time(g1) / 1e3
        copy_s = g1.elapsed_time(c1) / 1e3
        samples.append({
            "t_s": round(seconds - (end - time.perf_counter()), 2),
            "gemm_tflops": round(2 * m * n * k * cycle.gemms / gemm_s / 1e12, 1),
            "copy_gbps": round(2 * src.numel() * src.element_size() * cycle.copies / copy_s
                               / 1e9, 1) if cycle.copies else None,
            "duty_measured": round(gemm_s / (gemm_s + copy_s), 3), **reading})
    return samples


def main(argv: list[str] | None = None) -> dict:  # pragma: no cover - needs a GPU
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=12.0, help="per duty cycle")
    p.add_argument("--duties", default=",".join(str(d) for d in DUTIES))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("power_duty_cycle.py: needs a CUDA GPU (none is visible)")
    duties = [float(d) for d in args.duties.split(",")]
    m, n, k = GEMM
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(COPY_BYTES // 4, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    from meshloom.plan import kernel_bench as kb

    def idle_times() -> tuple[float, float]:
        torch.cuda.synchronize()
        time.sleep(3)  # from idle, as the kernel table is timed
        gemm_s = kb._gemm_seconds(m, n, k, torch.device("cuda"), torch.bfloat16, 5, 20)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dst.copy_(src)
        start.record()
        for _ in range(20):
            dst.copy_(src)
        stop.record()
        stop.synchronize()
        return gemm_s, start.elapsed_time(stop) / 1e3 / 20

    gemm_s, copy_s = idle_times()
    rows = []
    for duty in duties:
        cycle = plan_cycle(duty, gemm_s, copy_s)
        time.sleep(3)  # let the clock recover between runs
        samples = run_mix(cycle, args.seconds, a, b, c, src, dst)
        rows.append({"duty": duty, "gemms": cycle.gemms, "copies": cycle.copies,
                     **summarise(samples), "series": samples})
        r = rows[-1]
        print(f"duty {duty:.2f} (measured {r['duty_measured']}): GEMM {r['gemm_tflops']} "
              f"TFLOP/s, copy {r['copy_gbps']} GB/s, {r['sm_mhz']} MHz, {r['power_w']} W",
              flush=True)
    burst = 2 * m * n * k / gemm_s / 1e12
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "gemm": list(GEMM), "copy_bytes": COPY_BYTES, "period_s": PERIOD_S,
              "seconds": args.seconds, "burst_tflops": round(burst, 1),
              "idle_copy_gbps": round(COPY_BYTES / copy_s / 1e9, 1),
              "limits": smi(), "rows": rows,
              "ratio_to_burst": {str(r["duty"]): round(r["gemm_tflops"] / burst, 3)
                                 for r in rows}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
