"""`meshloom bench kernels`: measure this machine's kernel rates into a kernel table that
`meshloom plan` reads (plan/kernel_bench.py measures; docs/kernel-tables.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshloom.launch import EXIT_BAD_INPUT
from meshloom.plan import PlanError

DEFAULT_MODELS = ("llama3-8b", "llama3-70b")
DEFAULT_SEQ = 2048
DEFAULT_MICRO_BATCHES = "1,2,4,8"
DEFAULT_TPS = "1,2,4,8"
# --quick on CPU: the smallest preset at a short sequence, so CI runs it in seconds.
QUICK_CPU_MODEL, QUICK_CPU_SEQ = "tiny", 32

EXAMPLE = ("examples:\n"
           "  meshloom bench kernels                 # on a GPU: writes plan/kernels/<gpu>.json\n"
           "  meshloom bench kernels --model megatron-18.4b --tp 8 --micro-batch 1\n"
           "  meshloom bench kernels --quick --out /tmp/cpu.json   # CPU: the pipeline only")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure this machine: kernel rates for the planner")
    kinds = p.add_subparsers(dest="bench_command", required=True, metavar="kernels",
                             parser_class=type(p))
    k = kinds.add_parser("kernels", help="GEMM, attention, HBM and launch rates -> kernel table",
                         epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("--model", nargs="+", action="extend", metavar="PRESET",
                   help="model presets whose GEMM shapes to measure (also comma-separated; "
                        f"default {','.join(DEFAULT_MODELS)})")
    k.add_argument("--seq", type=int, help=f"tokens per sequence (default {DEFAULT_SEQ})")
    k.add_argument("--micro-batch", metavar="N,...",
                   help=f"sequences per micro-batch (default {DEFAULT_MICRO_BATCHES})")
    k.add_argument("--tp", metavar="N,...",
                   help=f"tensor-parallel degrees (default {DEFAULT_TPS})")
    k.add_argument("--shapes", metavar="FILE",
                   help="a JSON list of [m, n, k] GEMM shapes to measure beside the models' "
                        "(benchmarks/validation_shapes.py writes the validation rows' shapes)")
    k.add_argument("--head-dims", metavar="D,...",
                   help="attention head widths (default 64,128; --quick 64)")
    k.add_argument("--attention-seqs", metavar="N,...",
                   help="attention sequence lengths (default 512,...,16384 on a GPU)")
    k.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                   help="GEMM and attention inputs on a GPU (a CPU always measures fp32)")
    k.add_argument("--reps", type=int, help="timed calls per kernel (default 20; --quick 3)")
    k.add_argument("--out", help="the table to write (default "
                   "src/meshloom/plan/kernels/<gpu-name>.json)")
    k.add_argument("--gpu-name", help="the GPU preset the table is for (default: from the "
                   "device name, e.g. h100, h200, a100-80g)")
    k.add_argument("--force", action="store_true", help="replace a published table")
    k.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="also time each GEMM shape in fp8 (torch._scaled_mm) for the table's "
                        "gemm_fp8 rows (default: on for bf16 on a GPU with fp8 tensor cores)")
    k.add_argument("--quick", action="store_true",
                   help="a reduced set in seconds (CI); on CPU the tiny preset at seq 32")
    k.set_defaults(func=run_kernels)


def _sizes(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"{flag}={text!r}: give positive integers, comma-separated") from None
    if not values or min(values) < 1:
        raise PlanError(f"{flag}={text!r}: give positive integers, comma-separated")
    return values


def _read_shapes(path: str) -> list[tuple[int, int, int]]:
    import json

    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"--shapes {path}: cannot read a JSON list ({e})") from None
    ok = isinstance(raw, list) and all(
        isinstance(g, list) and len(g) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in g)
        for g in raw)
    if not ok:
        raise PlanError(f"--shapes {path}: give a JSON list of [m, n, k] positive integers")
    return [tuple(g) for g in raw]


def _command(args, models: list[str], seq: int, mbs: list[int], tps: list[int],
             gpu: str) -> str:
    """The command line that reproduces the measurement (without --out: where it was written
    is not what was measured)."""
    words = ["meshloom bench kernels", "--model", ",".join(models), "--seq", str(seq),
             "--micro-batch", ",".join(map(str, mbs)), "--tp", ",".join(map(str, tps)),
             "--dtype", args.dtype, "--gpu-name", gpu]
    for flag, value in (("--shapes", args.shapes), ("--head-dims", args.head_dims),
                        ("--attention-seqs", args.attention_seqs)):
        if value:
            words += [flag, value]
    if args.reps:
        words += ["--reps", str(args.reps)]
    if args.fp8 is not None:
        words.append("--fp8" if args.fp8 else "--no-fp8")
    return " ".join(words + (["--quick"] if args.quick else []))


def kernels(args) -> int:
    import torch

    from meshloom.plan import kernel_bench as kb
    from meshloom.plan.models import resolve_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu_quick = args.quick and device.type == "cpu"
    names = [n for item in (args.model or []) for n in item.split(",") if n.strip()]
    names = names or ([QUICK_CPU_MODEL] if cpu_quick else list(DEFAULT_MODELS))
    models = [resolve_model(n.strip()) for n in names]
    seq = args.seq if args.seq is not None else (QUICK_CPU_SEQ if cpu_quick else DEFAULT_SEQ)
    if seq < 1:
        raise PlanError(f"--seq={seq} must be a positive number of tokens")
    quick_default = "1" if args.quick else None
    mbs = _sizes(args.micro_batch or quick_default or DEFAULT_MICRO_BATCHES, "--micro-batch")
    tps = _sizes(args.tp or quick_default or DEFAULT_TPS, "--tp")
    if args.reps is not None and args.reps < 1:
        raise PlanError(f"--reps={args.reps} must be at least 1")
    extra = _read_shapes(args.shapes) if args.shapes else []
    head_dims = _sizes(args.head_dims, "--head-dims") if args.head_dims else None
    seqs = _sizes(args.attention_seqs, "--attention-seqs") if args.attention_seqs else None

    name = kb.device_name(device)
    gpu = args.gpu_name or ("cpu" if device.type == "cpu" else kb.infer_gpu_name(name))
    if gpu is None:
        raise PlanError(f"device {name!r} is no GPU preset this command knows; give "
                        "--gpu-name NAME (e.g. h100)")
    if not kb.GPU_NAME_RE.match(gpu):
        raise PlanError(f"--gpu-name={gpu!r}: lower-case letters, digits, '.', '_', '-'")
    if args.out:
        out = Path(args.out)
    elif device.type == "cpu":
        raise PlanError("no GPU here: a CPU table only tests the pipeline, so give --out PATH "
                        "(it is not written among the GPU tables)")
    elif args.quick:
        raise PlanError("--quick measures a reduced set, not a table for the planner: give "
                        "--out PATH")
    else:
        out = kb.default_out(gpu)
    kb.check_out(out, args.force)
    if args.fp8 and not kb.fp8_supported(device):
        raise PlanError(f"--fp8: {name} has no fp8 tensor cores (compute capability 8.9 and "
                        "up, on CUDA)")

    dtype_name = args.dtype if device.type == "cuda" else "fp32"
    note = ("" if device.type == "cuda" else
            "CPU run, fp32 (CPU bf16 matmuls are not representative): for testing the "
            "pipeline only, not a GPU's rates")
    if note:
        print(f"meshloom bench kernels: {note}", file=sys.stderr)
    plan = kb.make_plan(models, seq, mbs, tps, device.type, args.quick, args.reps,
                        extra_gemms=extra, head_dims=head_dims, attention_seqs=seqs)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"measuring {name} ({device.type}, {dtype_name}) into {out}")
    results = kb.measure(plan, device, kb.DTYPES[dtype_name], log, fp8=args.fp8)
    if not results["gemm"]:
        raise PlanError("no GEMM shape fitted in the device's memory; nothing to write")
    command = _command(args, [n.strip() for n in names], seq, mbs, tps, gpu)
    table = kb.make_table(gpu, name, dtype_name, results,
                          kb.provenance(device, name, command, plan, results["skipped"], note,
                                        results.get("attention_kernels")))
    kb.write_table(out, table)
    print(kb.format_summary(table))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def run_kernels(args) -> int:
    try:
        return kernels(args)
    except (PlanError, OSError) as e:
        print(f"meshloom bench kernels: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
