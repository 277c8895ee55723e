"""What the `meshloom train` loop does around forward and backward, piece by piece, on one GPU:
the work the stripped MFU benchmark (gpu_mfu.py) leaves out, timed at a model's real gradient
sizes (docs/gpu.md, "The training loop against the benchmark"). Needs CUDA.

    python benchmarks/step_overheads.py --model llama3-1b --out overheads.json

Each row is the median of CUDA-event times over repeated calls (device time), except the two
`host_wait_*` rows: how long the host is held while the GPU still has 20 ms of queued work,
which is GPU time lost at the next launch when the host then queues more.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from meshloom.config import TrainConfig
from meshloom.models.families import build_model, config_from_preset
from meshloom.optim import build_optimizer, clip_grads, decay_groups, grad_norm_tensor, guarded_step

REPS = 15


def device_ms(fn, reps: int = REPS) -> float:
    """Median device milliseconds of fn() (two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_wait_ms(fn, busy: torch.Tensor, reps: int = REPS) -> float:
    """Median host milliseconds fn() holds the host while ~20 ms of GPU work is queued."""
    import time

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        for _ in range(8):  # queue GPU work the host need not wait for
            busy @ busy
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def old_grad_norm(params) -> float:
    """The loop's norm before 2026-11-26: a squared copy of each gradient, summed one by one."""
    sq = torch.stack([p.grad.detach().float().pow(2).sum() for p in params]).sum()
    return float(sq.sqrt())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-1b")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_overheads.py: needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    cfg = config_from_preset(args.model, vocab_size=args.vocab)
    model = build_model(cfg, 0, device=device)
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = torch.randn_like(q)
    n = sum(q.numel() for q in params)
    optimizer = build_optimizer(*decay_groups(params), TrainConfig())
    norm = grad_norm_tensor(params)
    busy = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    batch = torch.randint(0, args.vocab, (8, 2048))

    rows = {
        "norm_per_tensor_pow_sum_ms": device_ms(lambda: old_grad_norm(params)),
        "norm_foreach_ms": device_ms(lambda: float(grad_norm_tensor(params))),
        "clip_foreach_mul_ms": device_ms(lambda: clip_grads(params, 1.0, 2.0)),
        "adamw_fused_step_ms": device_ms(optimizer.step),
        "adamw_fused_step_clip_in_kernel_ms": device_ms(
            lambda: guarded_step(optimizer, norm, 1.0, True)()),
        "zero_grads_ms": device_ms(lambda: [q.grad.zero_() for q in params]),
        "host_wait_batch_to_gpu_pageable_ms": host_wait_ms(lambda: batch.to(device), busy),
        "host_wait_batch_to_gpu_pinned_ms": host_wait_ms(
            lambda: batch.pin_memory().to(device, non_blocking=True), busy),
    }
    result = {"model": args.model, "vocab": args.vocab, "parameters": n,
              "grad_bytes": 4 * n, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "reps": REPS, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for k, v in rows.items():
        print(f"{k:<40} {v:8.2f}")
    return result


if __name__ == "__main__":
    main()
