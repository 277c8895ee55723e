"""A GEMM's rate in a short burst (as `meshloom bench kernels` times it) against the same GEMM
run back to back for many seconds, as a training step keeps the GPU busy, with the SM clock
and power read from NVML beside each. Needs CUDA:

    python benchmarks/gemm_sustained.py --seconds 20 --out sustained.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from meshloom.plan import kernel_bench as kb

# 1B Llama FFN (8 x 2048 tokens), a 70B tp-8 FFN, square 8192, and a 1B attention projection.
SHAPES = ((16384, 8192, 2048), (8192, 3584, 8192), (8192, 8192, 8192), (16384, 2048, 2048))


def smi() -> dict:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    clock, power, temp = (float(v) for v in out.stdout.strip().split(","))
    return {"sm_mhz": clock, "power_w": power, "temp_c": temp}


def sustained(m: int, n: int, k: int, seconds: float) -> list[dict]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    samples, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls = 0
        t = time.perf_counter()
        while time.perf_counter() - t < 0.5:
            for _ in range(20):
                torch.matmul(a, b, out=c)
            calls += 20
        stop.record()
        clocks = smi()  # read while the queue still runs
        stop.synchronize()
        tflops = 2 * m * n * k * calls / (start.elapsed_time(stop) / 1e3) / 1e12
        samples.append({"t_s": round(seconds - (end - time.perf_counter()), 2),
                        "tflops": round(tflops, 1), **clocks})
    return samples


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    for m, n, k in SHAPES:
        torch.cuda.synchronize()
        time.sleep(3)  # let the clocks recover: the burst is measured from idle, as the bench is
        burst = 2 * m * n * k / kb._gemm_seconds(m, n, k, device, torch.bfloat16, 5, 20) / 1e12
        series = sustained(m, n, k, args.seconds)
        tail = series[len(series) // 2:]
        rows.append({"m": m, "n": n, "k": k, "burst_tflops": round(burst, 1),
                     "sustained_tflops": round(sum(s["tflops"] for s in tail) / len(tail), 1),
                     "sustained_sm_mhz": round(sum(s["sm_mhz"] for s in tail) / len(tail)),
                     "series": series})
        print(f"{m}x{n}x{k}: burst {burst:.0f}, sustained {rows[-1]['sustained_tflops']:.0f} "
              f"TFLOP/s at {rows[-1]['sustained_sm_mhz']} MHz", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "seconds": args.seconds, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
