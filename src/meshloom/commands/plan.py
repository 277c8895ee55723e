"""`meshloom plan`: arguments, the ranked table, `--json` and `--write-config`."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from typing import TYPE_CHECKING

from meshloom.plan import PlanError
from meshloom.plan.hardware import GPUS, make_cluster
from meshloom.plan.implementation import IMPL_KEYS
from meshloom.plan.trainers import TRAINERS, layout_problem, trainer_impl

if TYPE_CHECKING:  # the cost model imports torch (model presets); the parser must not
    from meshloom.plan.models import ModelShape
    from meshloom.plan.search import Candidate

ARCHS = ("gpt", "llama")
DTYPES = ("bf16", "fp32")

EXAMPLE = ("examples:\n"
           "  meshloom plan --model llama3-8b --gpus 64 --gpu h100 --seq 8192 "
           "--global-batch 512\n"
           "  meshloom plan --model megatron-145.6b --gpus 1536 --gpu a100-80g --seq 2048 \\\n"
           "      --global-batch 2304 --fix tp=8,pp=8,micro_batch=1,recompute=full\n"
           "  meshloom plan --model llama3-70b --gpus 64 --gpu h100 --seq 8192 "
           "--global-batch 128 --trainer nemo\n"
           "  meshloom plan --arch gpt --hidden 1600 --layers 48 --heads 25 --vocab 50257 \\\n"
           "      --gpus 2 --gpu titan-rtx-24g --seq 1024 --global-batch 2 --json")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory and speed of layouts; find the best one",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a preset or config.json, or explicit dimensions)")
    m.add_argument("--model", help="a preset of any family (gpt2 ... gpt2-xl, llama3-1b ... "
                   "llama3-405b, mistral-7b, qwen2.5-0.5b/7b, qwen3-0.6b/8b, meshloom's small "
                   "ones; docs/model.md), megatron-1.7b ... megatron-1t, or an HF config.json "
                   "path")
    m.add_argument("--arch", choices=ARCHS)
    for flag in ("--hidden", "--layers", "--heads", "--kv-heads", "--ffn-hidden", "--vocab"):
        m.add_argument(flag, type=int)
    # The rest of a shape given by dimensions (Megatron's --kv-channels, --num-query-groups,
    # --disable-bias-linear, --position-embedding-type rope, --untie-embeddings-and-output-weights
    # name the same things); each defaults to the arch's own.
    m.add_argument("--head-dim", type=int, help="width of a head (default hidden / heads)")
    m.add_argument("--sliding-window", type=int, help="keys each query sees (default: all)")
    m.add_argument("--positions", type=int,
                   help="learned position rows (gpt default 2048; 0: RoPE, llama's only value)")
    m.add_argument("--tied", action=argparse.BooleanOptionalAction,
                   help="output head tied to the token table (gpt default yes, llama no)")
    m.add_argument("--linear-bias", action=argparse.BooleanOptionalAction,
                   help="gpt: biases on the four linears (default yes)")
    m.add_argument("--dropout", action=argparse.BooleanOptionalAction,
                   help="dropout in training (gpt default yes, llama no)")
    m.add_argument("--qkv-bias", action="store_true", help="llama: biases on q, k, v (Qwen2)")
    m.add_argument("--qk-norm", action="store_true", help="llama: per-head q/k norms (Qwen3)")
    m.add_argument("--moe-imbalance", type=float, help="experts: the busiest expert rank's "
                   "tokens over the mean (default 1.25, or the model's capacity factor)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int,
                   help="GPUs in all (default 8, or what a --config's parallel degrees make)")
    c.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)}")
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--peak-tflops", type=float, help="override the GPU's dense bf16 peak")
    c.add_argument("--gpu-memory-gb", type=float, help="override the GPU's memory")
    c.add_argument("--intra-node-gbps", type=float, help="override NVLink GB/s (one way)")
    c.add_argument("--nvlink-mesh", type=int, default=0, metavar="N",
                   help="the node's N GPUs are wired to each other with no NVSwitch (a 4-GPU "
                        "SXM board): a pair gets 1/(N-1) of the NVLink rate; N = "
                        "--gpus-per-node")
    c.add_argument("--inter-node-gbps", type=float, help="override network GB/s per GPU")
    c.add_argument("--hbm-gbps", type=float,
                   help="override the GPU's memory bandwidth, GB/s (the kernel table's "
                        "achieved rates scale with it)")
    c.add_argument("--kernels", metavar="TABLE",
                   help="kernel rates: a table from `meshloom bench kernels` (JSON), or "
                        "'datasheet' for peak and bandwidth only (default: the GPU's committed "
                        "table in plan/kernels/)")
    c.add_argument("--action-cv", type=float, default=0.0,
                   help="measured coefficient of variation of single pipeline actions' times "
                        "(default 0: deterministic)")
    b = p.add_argument_group("batch and run")
    b.add_argument("--seq", type=int, help="sequence length (tokens; default 2048)")
    b.add_argument("--global-batch", type=int, default=0,
                   help="sequences per optimizer step (default: one per GPU)")
    b.add_argument("--dtype", choices=DTYPES, help="default bf16")
    b.add_argument("--attention", choices=("flash", "eager"), default="flash")
    p.add_argument("--trainer", default="meshloom", choices=("meshloom", *TRAINERS),
                   help="plan the step as this trainer runs it (its --fix keys, cited in "
                        "plan/trainers.py; --fix overrides them); default meshloom")
    p.add_argument("--fix", default="", metavar="KEY=V,...",
                   help="pin part of the layout: tp, pp, dp, cp, dp_replicate, micro_batch, "
                        "zero, recompute, schedule, v, sp, ep; or say how the trainer runs it "
                        "(default: as meshloom does; docs/plan.md): " + ", ".join(IMPL_KEYS))
    p.add_argument("--top", type=int, default=10, help="rows to show")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--explain", action="store_true",
                   help="after the table, the best layout's step time and memory term by term "
                        "(pin a layout with --fix to explain that one)")
    p.add_argument("--write-config", metavar="FILE", help="write the best layout as TOML")
    p.add_argument("--config", metavar="FILE",
                   help="price the layout a meshloom training config sets, as it stands: its "
                        "model, sequence, batch, dtype and parallel keys (docs/plan.md)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --config: override a config key, as `meshloom train --set` does")
    p.set_defaults(func=run)


def _model(args) -> ModelShape:
    from meshloom.plan.models import from_dims, resolve_model
    dims = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads",
                                           "ffn_hidden", "vocab")}
    options = {k: getattr(args, k) for k in _SHAPE_OPTIONS}
    # `is`, not `in`: 0 (--positions 0) is given, though 0 == False.
    given = [k for k, v in (dims | options).items() if v is not None and v is not False]
    if args.model:
        if args.arch or given:
            raise PlanError("give either --model or --arch with dimensions, not both (--"
                            + ", --".join(k.replace("_", "-") for k in given or ["arch"])
                            + f" with --model {args.model})")
        return resolve_model(args.model)
    if not args.arch:
        raise PlanError("no model: give --model PRESET|config.json, or --arch with --hidden "
                        "--layers --heads --vocab")
    missing = [k for k in ("hidden", "layers", "heads", "vocab") if dims[k] is None]
    if missing:
        raise PlanError(f"--arch {args.arch} needs " + ", ".join(
            "--" + k.replace("_", "-") for k in missing))
    return from_dims(args.arch, dims["hidden"], dims["layers"], dims["heads"], dims["vocab"],
                     kv_heads=dims["kv_heads"], ffn_hidden=dims["ffn_hidden"], **options)


# `meshloom plan` flags that set the rest of a shape given by dimensions (from_dims' keywords).
_SHAPE_OPTIONS = ("head_dim", "sliding_window", "positions", "tied", "linear_bias", "dropout",
                  "qkv_bias", "qk_norm")


def plan(args) -> tuple[ModelShape, list[Candidate], dict]:
    from meshloom.plan.layout import parse_fix
    from meshloom.plan.search import search
    if args.write_config and args.trainer != "meshloom":
        raise PlanError(f"--write-config writes a meshloom config, but --trainer {args.trainer} "
                        f"plans {args.trainer}'s step; drop one of them")
    from_config = _config_plan(args) if args.config else None
    if args.set and not from_config:
        raise PlanError("--set overrides a --config's keys; give --config FILE")
    shape = from_config.shape if from_config else _model(args)
    gpus = from_config.gpus if from_config else (8 if args.gpus is None else args.gpus)
    seq = from_config.seq if from_config else (2048 if args.seq is None else args.seq)
    dtype = from_config.dtype if from_config else args.dtype or "bf16"
    if args.moe_imbalance is not None:
        import dataclasses
        if not shape.is_moe:
            raise PlanError(f"--moe-imbalance: {shape.name} has no experts")
        shape = dataclasses.replace(shape, moe_imbalance=args.moe_imbalance)
    cluster = make_cluster(args.gpu, gpus, args.gpus_per_node,
                           peak_tflops=args.peak_tflops, memory_gb=args.gpu_memory_gb,
                           intra_gbps=args.intra_node_gbps, inter_gbps=args.inter_node_gbps,
                           hbm_gbps=args.hbm_gbps, action_cv=args.action_cv,
                           kernels=args.kernels, nvlink_mesh=args.nvlink_mesh)
    batch = from_config.global_batch if from_config else args.global_batch or gpus
    if seq < 1 or batch < 1:
        raise PlanError(f"--seq={seq} and --global-batch={batch} must be positive")
    if args.top < 1:
        raise PlanError(f"--top={args.top} must be at least 1")
    pinned = parse_fix(args.fix)
    if from_config:
        _no_fix_over_config(pinned, from_config.fixed)
        pinned = {**from_config.fixed, **pinned}
    fixed = {**trainer_impl(args.trainer), **pinned}
    refuses = None
    if args.trainer != "meshloom":  # only the layouts its code runs, bar what --fix pins
        refuses = functools.partial(layout_problem, args.trainer, pinned=frozenset(pinned))
    # meshloom's ZeRO-3 runs either way (parallel.reshard_after_forward, parallel.reduce_once):
    # try each unless pinned; other trainers' versions run as their entries say.
    own = args.trainer == "meshloom"
    found = search(shape, cluster, seq, batch, fixed, dtype,
                   args.attention == "flash", args.top, refuses,
                   try_held=own and "reshard_after_forward" not in pinned,
                   try_once=own and "fsdp_no_sync" not in pinned)
    setup = {"model": shape.to_dict(), "cluster": {"gpu": cluster.gpu.__dict__,
                                                    "gpus": cluster.n_gpus,
                                                    "gpus_per_node": cluster.gpus_per_node,
                                                    "nvlink_mesh": cluster.nvlink_mesh},
             "seq": seq, "global_batch": batch, "dtype": dtype,
             "attention": args.attention, "trainer": args.trainer, "fix": fixed,
             "rates": found[0].timing.detail.get("rates") if found else None,
             "accuracy": _accuracy(args)}
    return shape, found, setup


def _config_plan(args):
    """The model, batch and layout a `--config` sets (plan/from_config.py); the flags that
    would say them too are refused, each naming the config key to change instead."""
    from meshloom.config import ConfigError, load_config
    from meshloom.plan.from_config import plan_from_config
    told = {"--model": args.model, "--arch": args.arch, "--seq": args.seq,
            "--global-batch": args.global_batch or None, "--dtype": args.dtype,
            "--trainer": None if args.trainer == "meshloom" else args.trainer}
    told |= {"--" + k.replace("_", "-"): getattr(args, k)
             for k in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab",
                       *_SHAPE_OPTIONS) if getattr(args, k) not in (None, False)}
    given = [flag for flag, value in told.items() if value is not None]
    if given:
        raise PlanError(f"--config sets the model, batch and layout; drop {', '.join(given)} "
                        "(change the config's keys with --set)")
    try:
        cfg = load_config(args.config, args.set)
    except (ConfigError, OSError) as e:
        raise PlanError(f"--config {args.config}: {e}") from None
    return plan_from_config(cfg, args.gpus)


def _no_fix_over_config(pinned: dict, from_config: dict) -> None:
    from meshloom.plan.from_config import LAYOUT_KEYS
    clash = [k for k in pinned if k in from_config or k in LAYOUT_KEYS]
    if clash:
        raise PlanError(f"--fix {', '.join(clash)}: the --config sets the layout and run "
                        "options; change them with --set (e.g. --set parallel.tp=2)")


def _accuracy(args) -> dict:
    """How far plans on this GPU have landed from measured runs (plan/accuracy.py), and
    whether the user changed what those plans used (the preset's figures, its kernel table)."""
    from meshloom.plan import accuracy
    adjusted = any(v is not None for v in (args.peak_tflops, args.gpu_memory_gb,
                                            args.intra_node_gbps, args.inter_node_gbps,
                                            args.hbm_gbps, args.kernels))
    return {"gpu": args.gpu, "trainer": args.trainer, "adjusted": adjusted,
            **accuracy.for_gpu(args.gpu)}


def run(args) -> int:
    try:
        shape, found, setup = plan(args)
        if args.write_config:
            _write_config(args.write_config, shape, found[0], setup)
    except PlanError as e:
        print(f"meshloom plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**setup, "candidates": [c.to_dict() for c in found]}, indent=1))
    else:
        print(format_table(shape, found, setup))
    if args.explain and not args.json:
        from meshloom.plan.explain import explain
        print()
        print(explain(found[0]))
    if args.write_config:
        print(f"wrote {args.write_config}", file=sys.stderr)
    return 0


# The implementation keys a meshloom config can say (train.compile,
# parallel.reshard_after_forward, parallel.reduce_once, parallel.reduce_dtype), and what the
# run's environment decides: the kernel SDPA picks (FlashAttention-2 or cuDNN), NCCL's
# protocols (NCCL_PROTO).
# Any other key differing from meshloom's own describes a run the written config would not be.
_WRITABLE = ("compile", "reshard_after_forward", "fsdp_no_sync", "grad_reduce_dtype",
             "nccl_protocols")
_SDPA_PICKS = ("sdpa", "fa2", "cudnn")


def _unwritable(impl) -> list[str]:
    from meshloom.plan.implementation import MESHLOOM
    return [f"{k}={str(v).lower()}" for k, v in impl.to_dict().items()
            if k not in _WRITABLE and v != getattr(MESHLOOM, k)
            and not (k == "attention_kernel" and v in _SDPA_PICKS)]


def _write_config(path: str, shape: ModelShape, best: Candidate, setup: dict) -> None:
    from meshloom.plan.layout import config_toml
    if not best.fits:
        raise PlanError("no layout fits in memory; not writing a config")
    other = _unwritable(best.impl)
    if other:
        raise PlanError("--write-config writes a meshloom config, which cannot say "
                        f"{', '.join(other)} (from --fix); drop one of them")
    text = config_toml(best.layout, shape, setup["seq"], setup["global_batch"], setup["dtype"],
                       best.impl.compile, best.impl.reshard_after_forward,
                       best.impl.grad_reduce_dtype, best.impl.fsdp_no_sync)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise PlanError(f"--write-config: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".plan-", suffix=".toml")
    with os.fdopen(fd, "w") as f:  # written whole, then renamed: never half a config
        f.write(text)
    os.replace(tmp, path)


def _mesh_note(cl: dict) -> str:
    mesh = cl.get("nvlink_mesh", 0)
    return f", NVLink wired GPU to GPU on boards of {mesh}" if mesh else ""


def format_table(shape: ModelShape, found: list[Candidate], setup: dict) -> str:
    cl = setup["cluster"]
    gb = 1e9
    from meshloom.plan.moe import describe_best, describe_model
    lines = [f"model {shape.name}: {shape.params / 1e9:.3g}B parameters{describe_model(shape)} "
             f"({shape.arch}, "
             f"h={shape.hidden}, L={shape.layers}, heads={shape.heads}/{shape.kv_heads}, "
             f"vocab={shape.vocab});  {cl['gpus']} x {cl['gpu']['name']} "
             f"({cl['gpus_per_node']} per node{_mesh_note(cl)});  seq {setup['seq']}, global batch "
             f"{setup['global_batch']}, {setup['dtype']}, {setup['attention']} attention"]
    if found and not found[0].fits:
        lines.append("NOTHING FITS: the layouts below need the least memory.")
    # 72 columns, wider when a summary needs it (no-reshard and reduce-once both marked)
    width = max([72, *(len(c.short()) for c in found)])
    head = (f"{'#':>2}  {'layout':<{width}} {'fits':>4} {'mem GB':>7} {'step s':>8} "
            f"{'TFLOP/s':>7} {'MFU':>5} {'tok/s/GPU':>9}  time: compute/tp/cp/pp/dp/bubble %")
    lines += [head, "-" * len(head)]
    for i, c in enumerate(found, 1):
        t = c.timing
        parts = [t.compute, t.tp, t.cp, t.pp, t.dp, t.bubble]
        pct = "/".join(f"{100 * x / t.step_time_s:.0f}" for x in parts)
        lines.append(f"{i:>2}  {c.short():<{width}} {'yes' if c.fits else 'NO':>4} "
                     f"{c.memory.total / gb:>7.1f} {t.step_time_s:>8.3g} "
                     f"{c.tflops_per_gpu:>7.0f} {c.mfu:>5.0%} {c.tokens_per_s_per_gpu:>9.0f}  "
                     f"{pct}")
    best = found[0]
    mem = best.memory
    lines.append(f"best: memory per GPU {mem.total / gb:.1f} of {best.gpu_memory / gb:.0f} GB "
                 f"= params {mem.params / gb:.1f} + grads {mem.grads / gb:.1f} + optimizer "
                 f"{mem.optimizer / gb:.1f} + activations {mem.activations / gb:.1f} + buffers "
                 f"{mem.buffers / gb:.1f} + CUDA context {mem.context / gb:.1f}")
    lines += describe_best(best.moe, best.timing.step_time_s)
    if setup.get("accuracy"):
        from meshloom.plan.accuracy import describe
        acc = setup["accuracy"]
        lines += describe(acc["gpu"], acc["adjusted"], acc.get("trainer", "meshloom"),
                          cl["gpus"], float8=best.impl.float8 != "none")
    return "\n".join(lines)
