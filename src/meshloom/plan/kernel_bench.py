"""Measure the kernel rates of the device this runs on into a kernel table (the schema of
plan/kernel_table.py, docs/kernel-tables.md): what `meshloom bench kernels` writes.

- GEMMs: every distinct (m, n, k) of `step_kernels.all_gemms` over the asked models,
  micro-batches and tensor-parallel degrees, plus a grid of square sizes, timed as
  `torch.matmul(A[m, k], B[k, n])` on contiguous tensors. A measured table answers the
  planner's own shapes exactly instead of interpolating.
- fp8 GEMMs (bf16 runs on a GPU with fp8 tensor cores, compute capability 8.9 and up): the
  same shapes as `torch._scaled_mm` of e4m3 operands with tensor-wise scales and a bf16
  output (what torchao's Float8Linear calls), each written with the bf16 rate of the same
  shape in the same run (`gemm_fp8` rows: the planner prices Float8 by their ratio).
- Attention: `scaled_dot_product_attention` forward, and backward alone (the forward runs
  outside the timed call), FLOPs counted as `kernel_table.attention_flops` counts them.
- HBM: a large `copy_` (bytes read + written over time) and an elementwise add.
- Launch gap: a long stream of one-element adds, synchronised only at its two ends.

On CUDA, times are CUDA events around each call, with L2 flushed before each GEMM and
attention call; on CPU, `time.perf_counter`. Each figure is the median of its repetitions after
warm-up calls. A CPU table (fp32: CPU bf16 matmuls are not
what a GPU's tensor cores do) only exercises the pipeline; it says nothing about any GPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from meshloom.plan import PlanError
from meshloom.plan.kernel_table import TABLE_DIR, attention_flops
from meshloom.plan.models import ModelShape
from meshloom.plan.step_kernels import all_gemms

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Square GEMM sizes beside the models' shapes: the planner's fallback for shapes far from both.
SQUARES = {"cuda": (1024, 2048, 4096, 8192, 16384), "cpu": (64, 128, 256)}
SQUARES_QUICK = {"cuda": (1024, 4096), "cpu": (32, 64)}
ATTENTION_SEQS = {"cuda": (512, 1024, 2048, 4096, 8192, 16384), "cpu": (64, 128, 256)}
ATTENTION_SEQS_QUICK = {"cuda": (1024, 4096), "cpu": (32, 64)}
HEAD_DIMS = (64, 128)
# One attention call holds ATTENTION_TOKENS tokens (batch = tokens / seq) of a model of width
# ATTENTION_WIDTH (heads = width / head_dim): enough work per call at every length.
ATTENTION_TOKENS = {"cuda": 16384, "cpu": 128}
ATTENTION_WIDTH = {"cuda": 2048, "cpu": 128}
STREAM_BYTES = {"cuda": 1 << 30, "cpu": 32 << 20}  # per buffer: far past any cache
LAUNCHES = 1000
# Written between timed GEMM and attention calls on CUDA, so each call reads its inputs from
# HBM as in a training step (another kernel ran in between), not from the last call's L2
# (50 MB on an H100).
L2_FLUSH_BYTES = 256 << 20
GEMM_BUDGET_S = 0.25  # a GEMM's timed calls stop near this (never fewer than MIN_REPS)
MIN_REPS = 3
# Device name -> preset: every word in `has`, none in `lacks` (upper case). Anything else is
# refused: a table under a preset's name must be that preset's part (an H100 PCIe is no SXM).
GPU_NAMES = (
    ("h200", ("H200",), ()),
    ("h100", ("H100", "HBM3"), ()),  # the SXM part; PCIe and NVL names lack HBM3
    ("a100-80g", ("A100", "80GB"), ("PCIE",)),
    ("a100-40g", ("A100", "40GB"), ("PCIE",)),
    ("titan-rtx-24g", ("TITAN RTX",), ()),
)
GPU_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True)
class AttentionCase:
    seq: int
    head_dim: int
    causal: bool
    batch: int
    heads: int


@dataclass(frozen=True)
class BenchPlan:
    """What to measure and how often."""
    gemms: tuple[tuple[int, int, int], ...]
    attention: tuple[AttentionCase, ...]
    stream_bytes: int
    launches: int
    warmup: int
    reps: int


def model_gemm_shapes(models: Iterable[ModelShape], seq: int, micro_batches: Iterable[int],
                      tps: Iterable[int]) -> list[tuple[int, int, int]]:
    """Distinct (m, n, k) of every model's forward, input- and weight-gradient GEMMs."""
    shapes = set()
    for shape in models:
        for mb in micro_batches:
            for tp in tps:
                for g in all_gemms(shape, mb * seq, tp):
                    if min(g.m, g.n, g.k) > 0:  # a tp wider than a projection leaves nothing
                        shapes.add((g.m, g.n, g.k))
    return sorted(shapes)


def attention_cases(seqs: Iterable[int], head_dims: Iterable[int], tokens: int,
                    width: int) -> list[AttentionCase]:
    return [AttentionCase(s, d, causal, max(1, tokens // s), max(1, width // d))
            for s in seqs for d in head_dims for causal in (True, False)]


def make_plan(models: list[ModelShape], seq: int, micro_batches: list[int], tps: list[int],
              device: str, quick: bool, reps: int | None = None,
              extra_gemms: Iterable[tuple[int, int, int]] = (),
              head_dims: Iterable[int] | None = None,
              attention_seqs: Iterable[int] | None = None) -> BenchPlan:
    """`extra_gemms`: (m, n, k) measured beside the models' own (e.g. every shape the planner
    asks for a set of validation rows); `head_dims` and `attention_seqs` replace the defaults."""
    squares = (SQUARES_QUICK if quick else SQUARES)[device]
    gemms = sorted(set(model_gemm_shapes(models, seq, micro_batches, tps))
                   | {(s, s, s) for s in squares} | {tuple(g) for g in extra_gemms})
    seqs = tuple(attention_seqs or (ATTENTION_SEQS_QUICK if quick else ATTENTION_SEQS)[device])
    dims = tuple(head_dims or (HEAD_DIMS[:1] if quick else HEAD_DIMS))
    cases = attention_cases(seqs, dims, ATTENTION_TOKENS[device], ATTENTION_WIDTH[device])
    stream = STREAM_BYTES[device] // (4 if quick else 1)
    return BenchPlan(tuple(gemms), tuple(cases), stream, LAUNCHES, 1 if quick else 5,
                     reps or (MIN_REPS if quick else 20))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_seconds(fn: Callable[[], object], device: torch.device, warmup: int, reps: int,
                    budget_s: float | None = None, flush_l2: bool = False) -> float:
    """Median seconds of one call of `fn` after `warmup` calls. With `budget_s`, the timed
    calls stop near that total (at least MIN_REPS), judged from the warm-up's pace. With
    `flush_l2` (CUDA), a large buffer is written before each timed call, outside its time."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(max(1, warmup)):
        fn()
    _sync(device)
    if budget_s is not None:
        pace = (time.perf_counter() - start) / max(1, warmup)
        reps = max(MIN_REPS, min(reps, math.ceil(budget_s / max(pace, 1e-9))))
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) \
            if flush_l2 else None
        for begin, end in events:
            if scratch is not None:
                scratch.zero_()
            begin.record()
            fn()
            end.record()
        _sync(device)
        return statistics.median(b.elapsed_time(e) for b, e in events) / 1e3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_seconds(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype,
                  warmup: int, reps: int) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    c = torch.empty(m, n, device=device, dtype=dtype)
    return measure_seconds(lambda: torch.matmul(a, b, out=c), device, warmup, reps,
                           GEMM_BUDGET_S, flush_l2=True)


def bench_gemms(shapes: Iterable[tuple[int, int, int]], device: torch.device, dtype: torch.dtype,
                warmup: int, reps: int, log: Callable[[str], None] = lambda s: None
                ) -> tuple[list[dict], list[str]]:
    """TFLOP/s (2mnk / time) of each C[m, n] = A[m, k] @ B[k, n]; shapes that do not fit in
    the device's memory are skipped and named."""
    rows, skipped = [], []
    for i, (m, n, k) in enumerate(shapes):
        try:
            seconds = _gemm_seconds(m, n, k, device, dtype, warmup, reps)
        except torch.OutOfMemoryError:
            skipped.append(f"gemm {m}x{n}x{k}: out of memory")
            continue
        finally:
            if device.type == "cuda":  # the next shape's buffers are of another size
                torch.cuda.empty_cache()
        rows.append({"m": m, "n": n, "k": k, "tflops": 2.0 * m * n * k / seconds / 1e12})
        if (i + 1) % 50 == 0:
            log(f"  {i + 1} GEMM shapes measured")
    return rows, skipped


# fp8 tensor cores: Ada (8.9) and Hopper (9.0) on; `torch._scaled_mm` wants every dimension a
# multiple of 16.
FP8_CAPABILITY = (8, 9)
FP8_ALIGN = 16


def fp8_supported(device: torch.device) -> bool:
    """Whether this device runs fp8 GEMMs on tensor cores (a CPU's `_scaled_mm` is no guide)."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY)


def _fp8_gemm_seconds(m: int, n: int, k: int, device: torch.device, warmup: int,
                      reps: int) -> float:
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major [k, n]
    one = torch.ones((), device=device)
    return measure_seconds(
        lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        device, warmup, reps, GEMM_BUDGET_S, flush_l2=True)


def bench_fp8_gemms(bf16_rows: Iterable[dict], device: torch.device, warmup: int, reps: int,
                    log: Callable[[str], None] = lambda s: None
                    ) -> tuple[list[dict], list[str]]:
    """fp8 TFLOP/s of each bf16 row's shape (`gemm_fp8` rows, each with that row's rate as
    `bf16_tflops`); shapes `_scaled_mm` cannot take, or that do not fit, are skipped and
    named."""
    rows, skipped = [], []
    for i, r in enumerate(bf16_rows):
        m, n, k = r["m"], r["n"], r["k"]
        if m % FP8_ALIGN or n % FP8_ALIGN or k % FP8_ALIGN:
            skipped.append(f"fp8 gemm {m}x{n}x{k}: a dimension is not a multiple of "
                           f"{FP8_ALIGN}")
            continue
        try:
            seconds = _fp8_gemm_seconds(m, n, k, device, warmup, reps)
        except torch.OutOfMemoryError:
            skipped.append(f"fp8 gemm {m}x{n}x{k}: out of memory")
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append({"m": m, "n": n, "k": k, "tflops": 2.0 * m * n * k / seconds / 1e12,
                     "bf16_tflops": r["tflops"]})
        if (i + 1) % 50 == 0:
            log(f"  {i + 1} fp8 GEMM shapes measured")
    return rows, skipped


# SDPA backends a GPU table measures, and the table's name for each kernel: "fa2" (the
# FlashAttention-2 kernels PyTorch ships) is every table's base series; the others are priced
# by their ratio to it (kernel_table.py). PyTorch 2.11 on an H100 picks cuDNN's when free to.
ATTENTION_BACKENDS = {"flash": "fa2", "cudnn": "cudnn"}


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION}[name])


def bench_attention_backends(cases: Iterable[AttentionCase], device: torch.device,
                             dtype: torch.dtype, warmup: int, reps: int,
                             backends: Iterable[str] = ("flash", "cudnn")
                             ) -> tuple[list[dict], list[str]]:
    """Rows per backend, each labelled with its kernel (none on CPU: PyTorch's choice there),
    and the backends this device or build could not run."""
    cases = list(cases)
    if device.type != "cuda":
        return bench_attention(cases, device, dtype, warmup, reps), []
    rows, skipped = [], []
    for backend in backends:
        try:
            with _sdpa_backend(backend):
                got = bench_attention(cases, device, dtype, warmup, reps)
        except RuntimeError as e:  # "No available kernel": this GPU, dtype or build lacks it
            skipped.append(f"attention {backend}: {str(e).splitlines()[0][:160]}")
            continue
        kernel = ATTENTION_BACKENDS[backend]
        rows += [r if kernel == "fa2" else {**r, "kernel": kernel} for r in got]
    return rows, skipped


def bench_attention(cases: Iterable[AttentionCase], device: torch.device, dtype: torch.dtype,
                    warmup: int, reps: int) -> list[dict]:
    """Forward and backward rows per case; the backward call is timed without its forward."""
    rows = []
    for case in cases:
        shape = (case.batch, case.heads, case.seq, case.head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))

        def forward(q=q, k=k, v=v, causal=case.causal):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        with torch.no_grad():
            fwd_s = measure_seconds(forward, device, warmup, reps, flush_l2=True)
        out = forward()
        grad = torch.randn_like(out)

        def backward(out=out, grad=grad, inputs=(q, k, v)):
            # Gradients returned, not accumulated into .grad: no extra add kernels timed.
            return torch.autograd.grad(out, inputs, grad, retain_graph=True)

        bwd_s = measure_seconds(backward, device, warmup, reps, flush_l2=True)
        for direction, seconds in (("fwd", fwd_s), ("bwd", bwd_s)):
            flops = attention_flops(case.batch * case.heads, case.seq, case.seq, case.head_dim,
                                    case.causal, direction)
            rows.append({"seq": case.seq, "head_dim": case.head_dim, "causal": case.causal,
                         "direction": direction, "tflops": flops / seconds / 1e12,
                         "batch": case.batch, "heads": case.heads})
        del q, k, v, out, grad
    return rows


def attention_kernel_names(device: torch.device, dtype: torch.dtype) -> dict[str, list[str]]:
    """The GPU kernels one causal SDPA forward and backward launch, with PyTorch free to
    choose (`sdpa_default`) and under each measured backend: which kernel each series is."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(1, 16, 2048, 128, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    names = {}
    for backend in (None, *ATTENTION_BACKENDS):
        try:
            with _sdpa_backend(backend) if backend else contextlib.nullcontext():
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                    _sync(device)
        except RuntimeError:
            continue
        names[backend or "sdpa_default"] = sorted(
            {e.key[:160] for e in prof.key_averages()
             if e.device_type == torch.autograd.DeviceType.CUDA})
    return names


def bench_stream(nbytes: int, device: torch.device, warmup: int, reps: int
                 ) -> tuple[float, float]:
    """(copy, add) GB/s: bytes read plus bytes written over time."""
    n = max(1, nbytes // 4)
    a = torch.rand(n, device=device)
    b = torch.rand(n, device=device)
    c = torch.empty(n, device=device)
    copy_s = measure_seconds(lambda: c.copy_(a), device, warmup, reps)
    add_s = measure_seconds(lambda: torch.add(a, b, out=c), device, warmup, reps)
    size = 4 * n
    return 2 * size / copy_s / 1e9, 3 * size / add_s / 1e9


def bench_launch(device: torch.device, launches: int, reps: int) -> float:
    """Microseconds per kernel in a long stream of one-element adds (on CUDA the gap the
    host's launch pace leaves, since each kernel itself is far shorter)."""
    x = torch.zeros(1, device=device)

    def stream():
        for _ in range(launches):
            x.add_(1.0)

    return measure_seconds(stream, device, 1, reps) / launches * 1e6


# A fused AdamW step moves, per fp32 parameter: weight, gradient and both moments read, and
# weight and moments written (plan/compute.py OPTIMIZER_BYTES_PER_PARAM).
ADAMW_BYTES_PER_PARAM = 28
ADAMW_TENSORS = 8  # a model's parameters come as many tensors; the kernel walks them as a list


def bench_optimizer(nbytes: int, device: torch.device, warmup: int, reps: int) -> float:
    """GB/s of an AdamW step over `nbytes` of fp32 parameters: the fused kernel on CUDA (what
    meshloom's loop runs, `train.optimizer_impl`), PyTorch's default elsewhere. The table's
    `optimizer_gbps`: a step that reads and writes four tensors per element runs below the
    copy rate (on an H100, 2552 against 2999 GB/s)."""
    n = max(ADAMW_TENSORS, nbytes // 4)
    params = [torch.nn.Parameter(torch.rand(n // ADAMW_TENSORS, device=device))
              for _ in range(ADAMW_TENSORS)]
    for p in params:
        p.grad = torch.rand_like(p)
    opt = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda")
    seconds = measure_seconds(opt.step, device, max(1, warmup), reps)
    return ADAMW_BYTES_PER_PARAM * sum(p.numel() for p in params) / seconds / 1e9


def measure(plan: BenchPlan, device: torch.device, dtype: torch.dtype,
            log: Callable[[str], None] = lambda s: None, fp8: bool | None = None) -> dict:
    """Every rate of the plan; `fp8` (default: a bf16 run on fp8 tensor cores) adds the
    GEMMs' fp8 rates."""
    log(f"GEMM: {len(plan.gemms)} shapes")
    gemm, skipped = bench_gemms(plan.gemms, device, dtype, plan.warmup, plan.reps, log)
    gemm_fp8 = []
    if fp8 is None:
        fp8 = dtype == torch.bfloat16 and fp8_supported(device)
    if fp8:
        log(f"fp8 GEMM: {len(gemm)} shapes")
        gemm_fp8, missed = bench_fp8_gemms(gemm, device, plan.warmup, plan.reps, log)
        skipped += missed
    log(f"attention: {len(plan.attention)} cases, forward and backward")
    attention, unavailable = bench_attention_backends(plan.attention, device, dtype,
                                                      plan.warmup, plan.reps)
    skipped += unavailable
    log(f"HBM stream: {plan.stream_bytes / 2**20:.0f} MiB buffers; launch gap")
    copy_gbps, add_gbps = bench_stream(plan.stream_bytes, device, plan.warmup, plan.reps)
    launch_us = bench_launch(device, plan.launches, max(MIN_REPS, plan.reps // 4))
    log("AdamW step")
    adam_gbps = bench_optimizer(plan.stream_bytes, device, plan.warmup, plan.reps)
    return {"gemm": gemm, "gemm_fp8": gemm_fp8, "attention": attention, "copy_gbps": copy_gbps,
            "add_gbps": add_gbps, "launch_us": launch_us, "optimizer_gbps": adam_gbps,
            "skipped": skipped,
            "attention_kernels": attention_kernel_names(device, dtype)}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def infer_gpu_name(name: str) -> str | None:
    """The preset a device name is, or None when it is none we know for sure."""
    upper = name.upper()
    for preset, has, lacks in GPU_NAMES:
        if all(w in upper for w in has) and not any(w in upper for w in lacks):
            return preset
    return None


def default_out(gpu: str) -> Path:
    return TABLE_DIR / f"{gpu}.json"


def check_out(path: Path, force: bool) -> None:
    """Refuse, before measuring anything, an output that cannot be written or would replace
    a published (cited) table."""
    if path.is_dir():
        raise PlanError(f"--out {path} is a folder; give a file path")
    folder = path.parent
    if not folder.is_dir():
        raise PlanError(f"--out {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise PlanError(f"--out {path}: folder {folder} is not writable")
    if path.exists() and not force:
        try:
            kind = json.loads(path.read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
        if kind == "published":
            raise PlanError(f"--out {path} is a published table (cited sources); "
                            "add --force to replace it with a measured one")


def make_table(gpu: str, name: str, dtype: str, results: dict, provenance: dict) -> dict:
    fp8 = {"gemm_fp8": results["gemm_fp8"]} if results.get("gemm_fp8") else {}
    return {
        "gpu": gpu, "device": name, "dtype": dtype, "kind": "measured",
        "provenance": provenance,
        "gemm": results["gemm"],
        **fp8,
        "attention": results["attention"],
        "hbm_gbps": {"value": results["copy_gbps"],
                     "what": "achieved streaming copy bandwidth, read+write bytes / time",
                     "elementwise_add_gbps": results["add_gbps"]},
        "launch_us": {"value": results["launch_us"],
                      "what": "per-kernel launch/gap overhead, microseconds"},
        "optimizer_gbps": {"value": results.get("optimizer_gbps"),
                           "what": f"AdamW step (fused on CUDA) over fp32 parameters: "
                                   f"{ADAMW_BYTES_PER_PARAM} bytes per parameter / time"},
    }


def provenance(device: torch.device, name: str, command: str, plan: BenchPlan,
               skipped: list[str], note: str,
               attention_kernels: dict[str, list[str]] | None = None) -> dict:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "device_name": name,
        "device": device.type, "threads": torch.get_num_threads(), "python": sys.version.split()[0],
        "command": command,
        "timer": "CUDA events" if device.type == "cuda" else "time.perf_counter",
        "warmup": plan.warmup, "reps": plan.reps,
        "reps_note": f"median of the timed calls; a GEMM's stop near {GEMM_BUDGET_S} s "
                     f"(at least {MIN_REPS})",
        "l2_flush": (f"{L2_FLUSH_BYTES >> 20} MiB written before each timed GEMM and attention "
                     "call, outside its time" if device.type == "cuda" else None),
        "skipped": skipped, "note": note,
        "attention_kernels": attention_kernels or {},
    }


def write_table(path: Path, table: dict) -> None:
    """Written whole to a temporary file beside `path`, then renamed: never half a table."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernels-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def format_summary(table: dict) -> str:
    gemm = table["gemm"]
    rates = sorted(r["tflops"] for r in gemm)
    lines = [f"{table['gpu']} ({table['device']}, {table['dtype']}): {len(gemm)} GEMM shapes, "
             f"TFLOP/s min {rates[0]:.4g}, median {statistics.median(rates):.4g}, "
             f"max {rates[-1]:.4g}"]
    squares = [r for r in gemm if r["m"] == r["n"] == r["k"]]
    if squares:
        lines.append("  square " + ", ".join(f"{r['m']}: {r['tflops']:.4g}" for r in squares))
    fp8 = table.get("gemm_fp8") or []
    if fp8:
        ratios = sorted(r["tflops"] / r["bf16_tflops"] for r in fp8)
        lines.append(f"  fp8 GEMM: {len(fp8)} shapes, over bf16 min {ratios[0]:.3g}, median "
                     f"{statistics.median(ratios):.3g}, max {ratios[-1]:.3g}")
    if table["attention"]:
        lines.append(f"  {'attention':<10}{'seq':>7}{'d':>5}{'causal':>8}{'TFLOP/s':>10}")
        for r in table["attention"]:
            lines.append(f"  {r['direction']:<10}{r['seq']:>7}{r['head_dim']:>5}"
                         f"{'yes' if r['causal'] else 'no':>8}{r['tflops']:>10.4g}"
                         f"  {r.get('kernel', 'fa2')}")
    lines.append(f"  HBM copy {table['hbm_gbps']['value']:.0f} GB/s, add "
                 f"{table['hbm_gbps']['elementwise_add_gbps']:.0f} GB/s; launch gap "
                 f"{table['launch_us']['value']:.2f} us")
    adam = (table.get("optimizer_gbps") or {}).get("value")
    if adam:
        lines.append(f"  AdamW step {adam:.0f} GB/s")
    return "\n".join(lines)
