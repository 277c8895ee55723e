"""Single-GPU training throughput, MFU and peak memory: eager vs torch.compile, with and without
activation checkpointing, for a ~1B Llama and GPT-2 124M, next to the planner's prediction.

Goal: MFU >= 50% on one H100 for the 1B Llama (bf16). Published points of comparison
(../shared/reference/published.md): llm.c reaches about 49% MFU training GPT-2 1.5B on an H100
(about 60% for GPT-2 124M on an A100); torchtitan, Llama-3 8B with FSDP on 8 H100s without
float8, 33-39%.

Models:
- `llama1b`: meshloom's `llama3-1b` preset (dim 2048, 16 layers, 32 heads, 8 kv heads, SwiGLU
  8192, vocab 128256, tied head: 1.236B parameters), built by `build_model`;
- `gpt2`: transformers' `GPT2LMHeadModel` from `GPT2Config()` defaults (124.4M parameters) with
  `attn_implementation="sdpa"`, dropout set to 0 (a throughput benchmark; llm.c has none either)
  and no KV cache. Skipped, with a message, if transformers cannot be imported.

Variants, each a fresh model from the same seed trained on the same batches:
- `eager`: plain PyTorch;
- `compiled`: `torch.compile` per transformer block, and of the cross entropy (what
  `train.compile` does; torchtitan's pattern); `--compile-scope model` compiles the whole loss
  function, embedding, head and cross entropy included, as one graph instead;
- `eager+ac`, `compiled+ac`: the same with full activation checkpointing of every block;
- `eager+sac`, `compiled+sac` (not run by default): selective checkpointing (matmul outputs kept,
  attention core and elementwise ops rerun).
Checkpointing and compile are applied by the library's own code, the same calls as a meshloom run
with `train.activation_checkpointing` and `train.compile`
(meshloom.parallel.activation_checkpointing.apply_block_options: compile inside the checkpoint;
the loss through
meshloom.parallel.compiled_loss).

A step: forward under autocast (bf16 compute, fp32 master weights; `--dtype fp32`: no autocast),
cross entropy in fp32, backward, AdamW (meshloom.optim.build_optimizer: fused on CUDA, foreach on
CPU; lr 3e-4, weight decay 0.1 on matrices), zero_grad. No gradient clipping, no loss scaling.
Synthetic data: uniform random tokens seeded by (seed, step), all on the device before the first
step, so nothing in the loop waits for the host. `--warmup` steps (where compilation happens) are
not timed; the timed steps run back to back between two `torch.cuda.synchronize()`s.

FLOPs (model FLOPs, the same convention for both models, recompute not counted): per token
`6 N + 6 L s h`, N = every matmul weight (block projections and the output head, tied or not;
embeddings, norms and biases excluded), L layers, s sequence length, h hidden width. The attention
term is PaLM's 12 L s h halved for the causal mask (the work flash/SDPA kernels actually do); for
the Llama this is `LlamaConfig.flops_per_token(seq)`. MFU = tokens/s x FLOPs per token / peak
(`meshloom.metrics.PEAK_TFLOPS` for the device's name: H100 989 TFLOP/s dense bf16; a device with
no figure there, the CPU included, is measured against the H100's, and the JSON says so).

Memory: `torch.cuda.max_memory_allocated` / `max_memory_reserved` over the timed steps (peak
statistics reset after the warm-up; the cache is emptied between variants). Not measured on CPU.

Planner: for each variant, `meshloom.plan.search.evaluate` of the same run on one H100
(`Layout(dp=1, micro_batch=batch, recompute="full"|"none")`): step time, tokens/s, memory, and
MFU both as the planner counts it (attention unhalved) and in this script's convention.

    python benchmarks/gpu_mfu.py                                  # H100: both models, all variants
    python benchmarks/gpu_mfu.py --models llama1b --variants compiled,compiled+ac --steps 50
    python benchmarks/gpu_mfu.py --smoke --device cpu --compile-backend eager --dtype fp32

A variant that fails is recorded in the JSON and the others still run. Exit status: 0; 1 if a
variant failed other than by running out of GPU memory; 2 if --device cuda finds no CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from meshloom.config import TrainConfig
from meshloom.metrics import PEAK_TFLOPS, device_peak_flops
from meshloom.models.llama import build_model, config_from_preset
from meshloom.optim import build_optimizer, decay_groups
from meshloom.parallel import compiled_loss, plain_loss
from meshloom.parallel.activation_checkpointing import apply_block_options
from meshloom.plan import PlanError
from meshloom.plan.hardware import make_cluster
from meshloom.plan.layout import Layout
from meshloom.plan.models import PRESETS as PLAN_PRESETS
from meshloom.plan.models import ModelShape, from_dims, from_llama_config
from meshloom.plan.search import evaluate

# benchmarks/ is a folder of scripts, not a package: make its shared modules importable however
# this file was loaded (as a script, or by path from a test).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import batch, git_state, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("llama1b", "gpt2")
VARIANTS = ("eager", "compiled", "eager+ac", "compiled+ac", "eager+sac", "compiled+sac")
DEFAULT_VARIANTS = VARIANTS[:4]
AC_MODES = {"": "none", "+ac": "full", "+sac": "selective"}
# (seq, batch) of a real run per model; --seq / --batch override both models.
REAL_SHAPES = {"llama1b": (2048, 8), "gpt2": (1024, 16)}
SMOKE = dict(seq=32, batch=2, steps=2, warmup=1)
MFU_GOAL = ("llama1b", 0.50)
PRESETS_MAX_SEQ = 8192  # the llama3 presets' max_seq_len (rows of the RoPE table)
LR = 3e-4
FLOPS_NOTE = ("model FLOPs per token 6N + 6Ls h: N = matmul weights (block projections + output "
              "head), attention 12Ls h halved for the causal mask (LlamaConfig.flops_per_token); "
              "recompute not counted")


# ----------------------------------------------------------------------------- models


class Bench(NamedTuple):
    """One model to train: how to build it, where its blocks are, its FLOPs and planner shape."""

    name: str
    build: Callable[[torch.device], nn.Module]  # seeded: the same weights on every call
    blocks: Callable[[nn.Module], nn.ModuleList]
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    vocab: int
    seq: int
    batch: int
    flops_per_token: float
    shape: ModelShape
    config: dict


def matmul_flops_per_token(shape: ModelShape, seq: int) -> float:
    """6N + 6Lsh (module docstring) from a planner shape: the convention of
    LlamaConfig.flops_per_token, applied to any block family."""
    n = shape.layers * shape.layer_matmul_params + shape.vocab * shape.hidden
    return 6.0 * n + 6.0 * shape.layers * seq * shape.hidden


def llama_bench(args: argparse.Namespace, seq: int, b: int) -> Bench:
    if args.smoke:
        name, cfg = "tiny (2 layers)", config_from_preset("tiny", n_layers=2,
                                                           max_seq_len=max(256, seq))
    else:
        name = "llama3-1b"
        cfg = config_from_preset(name, max_seq_len=max(PRESETS_MAX_SEQ, seq))
    shape = from_llama_config(cfg, name)
    fpt = cfg.flops_per_token(seq)
    assert math.isclose(fpt, matmul_flops_per_token(shape, seq)), "FLOPs conventions diverged"
    return Bench(
        name=name,
        build=lambda device: build_model(cfg, args.seed, device),
        blocks=lambda m: m.layers,
        logits=lambda m, x: m(x),
        vocab=cfg.vocab_size, seq=seq, batch=b, flops_per_token=fpt, shape=shape,
        config={k: getattr(cfg, k) for k in ("dim", "n_layers", "n_heads", "kv_heads", "hidden",
                                             "vocab_size", "tie_embeddings", "max_seq_len")})


def gpt2_bench(args: argparse.Namespace, seq: int, b: int) -> Bench:
    from transformers import GPT2Config, GPT2LMHeadModel

    # Dropout 0 (throughput benchmark; llm.c has none) and no KV cache; else GPT2Config defaults.
    common = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                  attn_implementation="sdpa")
    if args.smoke:
        name = "gpt2 tiny (2 layers)"
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=257,
                         n_positions=max(64, seq), bos_token_id=0, eos_token_id=0, **common)
    else:
        name = "gpt2 (124M)"
        cfg = GPT2Config(**common)
        if seq > cfg.n_positions:  # a longer position table than GPT-2's 1024 rows
            cfg.n_positions = seq
    ffn = cfg.n_inner or 4 * cfg.n_embd
    shape = from_dims("gpt", cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size,
                      ffn_hidden=ffn, name="gpt2", positions=cfg.n_positions,
                      tied=cfg.tie_word_embeddings)
    if shape == PLAN_PRESETS["gpt2"]:
        shape = PLAN_PRESETS["gpt2"]

    def build(device: torch.device) -> nn.Module:
        torch.manual_seed(args.seed)  # HF initialises from the global generator
        model = GPT2LMHeadModel(cfg).to(device)
        if model.config._attn_implementation != "sdpa":
            raise RuntimeError(f"GPT-2 got attention {model.config._attn_implementation!r}, "
                               "not sdpa")
        return model

    return Bench(
        name=name, build=build,
        blocks=lambda m: m.transformer.h,
        logits=lambda m, x: m(input_ids=x, use_cache=False).logits,
        vocab=cfg.vocab_size, seq=seq, batch=b,
        flops_per_token=matmul_flops_per_token(shape, seq), shape=shape,
        config={"n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_inner": ffn, "vocab_size": cfg.vocab_size, "n_positions": cfg.n_positions,
                "tie_word_embeddings": cfg.tie_word_embeddings, "dropout": 0.0,
                "attn_implementation": "sdpa"})


# ----------------------------------------------------------------------------- one variant


def free_memory(device: torch.device) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compiled code holds on to modules; each variant compiles afresh
    counters.clear()  # reset() keeps them: each variant's graph counts are its own
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def dynamo_stats() -> dict:
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(breaks.values())),
            "graph_break_reasons": [r.split("\n")[0][:200] for r in list(breaks)[:5]]}


def ac_mode(variant: str) -> str:
    """The activation checkpointing mode a variant's name asks for."""
    return AC_MODES[variant[variant.index("+"):] if "+" in variant else ""]


def run_variant(bench: Bench, variant: str, args: argparse.Namespace,
                device: torch.device) -> dict:
    compiled, ac = variant.startswith("compiled"), ac_mode(variant)
    free_memory(device)
    model = bench.build(device)
    model.train()
    # What train.activation_checkpointing and train.compile do in a meshloom run.
    apply_block_options(model, ac, compiled and args.compile_scope == "block",
                        args.compile_backend, block_list=list(bench.blocks(model)))
    cross_entropy = (compiled_loss(args.compile_backend)
                     if compiled and args.compile_scope == "block" else plain_loss)
    optimizer = build_optimizer(*decay_groups(model.parameters()), TrainConfig(lr=LR))
    params = sum(p.numel() for p in model.parameters())

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
               else contextlib.nullcontext())
        with ctx:
            logits = bench.logits(model, x)
        return cross_entropy(logits, y)

    if compiled and args.compile_scope == "model":
        loss_fn = torch.compile(loss_fn, backend=args.compile_backend)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    shape_args = argparse.Namespace(batch=bench.batch, seq=bench.seq, seed=args.seed)
    data = [batch(shape_args, bench.vocab, 0, i, device) for i in range(args.warmup + args.steps)]
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    losses = []
    sync()
    t0 = time.perf_counter()
    for i in range(args.warmup):
        losses.append(step(*data[i]))
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    marks = []
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        if cuda:
            events[i - args.warmup].record()
        else:
            marks.append(time.perf_counter())
        losses.append(step(*data[i]))
    if cuda:
        events[-1].record()
    sync()
    elapsed = time.perf_counter() - t0
    if cuda:
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(events[:-1], events[1:], strict=True)]
    else:
        times = [b - a for a, b in zip(marks, [*marks[1:], t0 + elapsed], strict=True)]

    tokens = bench.batch * bench.seq
    tokens_per_s = args.steps * tokens / elapsed
    out = {
        "compiled": compiled, "activation_checkpointing": ac,
        "params": params,
        "tokens_per_s": tokens_per_s,
        "step_s": elapsed / args.steps, "median_step_s": statistics.median(times),
        "times_s": times, "warmup_s": warmup_s,
        "tflops": tokens_per_s * bench.flops_per_token / 1e12,
        "mfu": tokens_per_s * bench.flops_per_token / args.peak_flops,
        "max_memory_allocated": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        "max_memory_reserved": int(torch.cuda.max_memory_reserved(device)) if cuda else None,
        "losses": torch.stack(losses).double().tolist(),
    }
    if compiled:
        out["dynamo"] = dynamo_stats()
    return out  # the model and optimizer go with this frame (and dynamo's cache, next reset)


def predict(bench: Bench, ac: str, args: argparse.Namespace) -> dict:
    """The planner's prediction for the same run on one H100 (it does not model compile)."""
    lay = Layout(dp=1, micro_batch=bench.batch, recompute=ac)
    try:
        c = evaluate(bench.shape, lay, make_cluster("h100", 1), bench.seq, bench.batch,
                     dtype=args.dtype)
    except PlanError as e:
        return {"error": str(e)}
    return {
        "layout": lay.short(), "step_time_s": c.timing.step_time_s,
        "tokens_per_s": c.tokens_per_s_per_gpu,
        "mfu": c.tokens_per_s_per_gpu * bench.flops_per_token / c.peak_flops,
        "planner_mfu": c.mfu,  # attention FLOPs unhalved: the planner's own convention
        "memory_bytes": c.memory.total, "memory_breakdown": c.memory.to_dict(),
        "fits": c.fits, "gpu": "h100",
    }


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None,
                   help="default cuda (--smoke: auto)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length for every model (default llama1b 2048, gpt2 1024)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per step for every model (default llama1b 8, gpt2 16)")
    p.add_argument("--models", default=",".join(MODELS), help=f"from {','.join(MODELS)}")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"from {','.join(VARIANTS)}")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: autocast, fp32 master weights; fp32: no autocast (MFU still vs the "
                        "bf16 peak)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (eager / aot_eager need no C++ toolchain)")
    p.add_argument("--compile-scope", choices=["block", "model"], default="block",
                   help="compile each transformer block, or the whole loss function")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak for MFU (default: meshloom.metrics.PEAK_TFLOPS by device name)")
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny models (2 layers, width 64), seq {SMOKE['seq']}, batch "
                        f"{SMOKE['batch']}, {SMOKE['steps']} steps, {SMOKE['warmup']} warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON (default benchmarks/results/gpu_mfu.json, gpu_mfu_smoke.json)")
    args = p.parse_args(argv)
    defaults = SMOKE if args.smoke else dict(steps=20, warmup=5)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        args.device = "auto" if args.smoke else "cuda"
    if args.out is None:
        args.out = RESULTS / ("gpu_mfu_smoke.json" if args.smoke else "gpu_mfu.json")
    if args.steps < 1 or args.warmup < 0:
        p.error("need --steps >= 1 and --warmup >= 0")
    if (args.seq is not None and args.seq < 1) or (args.batch is not None and args.batch < 1):
        p.error("--seq and --batch must be positive")
    for name, allowed in (("models", MODELS), ("variants", VARIANTS)):
        chosen = [v for v in getattr(args, name).split(",") if v]
        if not chosen or set(chosen) - set(allowed) or len(set(chosen)) != len(chosen):
            p.error(f"--{name}: give distinct names from {','.join(allowed)}")
        setattr(args, name, chosen)
    return args


def resolve_device(args: argparse.Namespace) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available (use --device cpu or auto)",
              file=sys.stderr)
        raise SystemExit(2)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")


def main(argv: list[str] | None = None) -> dict:
    """Run every model x variant, print the table, write the JSON and return the same dict."""
    args = parse_args(argv)
    device = resolve_device(args)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = device_peak_flops(device, args.peak_tflops)
    if peak is not None:
        peak_source = ("--peak-tflops" if args.peak_tflops > 0
                       else f"meshloom.metrics.PEAK_TFLOPS for {device_name!r}")
    else:
        peak = PEAK_TFLOPS["H100"] * 1e12
        peak_source = (f"no figure for {device_name!r}: H100 SXM dense bf16 "
                       "(meshloom.metrics.PEAK_TFLOPS['H100'])")
    args.peak_flops = peak

    models: dict[str, dict] = {}
    failed = False
    for key in args.models:
        seq0, b0 = (SMOKE["seq"], SMOKE["batch"]) if args.smoke else REAL_SHAPES[key]
        seq, b = args.seq or seq0, args.batch or b0
        if key == "gpt2":
            try:
                import transformers  # noqa: F401
            except ImportError as e:
                print(f"skipping gpt2: transformers is not importable ({e})")
                models[key] = {"skipped": f"transformers is not importable: {e}"}
                continue
            bench = gpt2_bench(args, seq, b)
        else:
            bench = llama_bench(args, seq, b)
        entry = {"model": bench.name, "config": bench.config, "seq": seq, "batch": b,
                 "tokens_per_step": seq * b, "flops_per_token": bench.flops_per_token,
                 "planner_shape": bench.shape.name, "planner_params": bench.shape.params,
                 "variants": {}}
        models[key] = entry
        for variant in args.variants:
            ac = ac_mode(variant)
            try:
                r = run_variant(bench, variant, args, device)
            except RuntimeError as e:  # out of memory, a compiler failure: report, go on
                oom = isinstance(e, torch.OutOfMemoryError)
                failed = failed or not oom  # running out of memory is a result, not a bug
                r = {"error": "out of memory" if oom else f"{type(e).__name__}: {e}"[:2000]}
            if "error" in r:  # outside the except block: its traceback no longer pins tensors
                free_memory(device)
            r["predicted"] = predict(bench, ac, args)
            entry["variants"][variant] = r
            entry.setdefault("params", r.get("params"))
            print(f"done {key} {variant}: " + (
                r["error"].split("\n")[0] if "error" in r else
                f"{r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.1f}%"), flush=True)
        entry["ac_loss_max_abs_diff"] = ac_loss_diffs(entry["variants"])

    result = {
        "config": {
            "device": device.type, "device_name": device_name, "torch": torch.__version__,
            "git": git_state(), "dtype": args.dtype,
            "autocast": "bf16" if args.dtype == "bf16" else None,
            "master_weights": "fp32", "optimizer": "AdamW (meshloom.optim.build_optimizer, "
            f"{'fused' if device.type == 'cuda' else 'foreach'}), lr {LR}",
            "compile_backend": args.compile_backend, "compile_scope": args.compile_scope,
            "steps": args.steps, "warmup": args.warmup, "seed": args.seed, "smoke": args.smoke,
            "cpu_threads": torch.get_num_threads(),
            "peak_flops": peak, "peak_source": peak_source, "flops_convention": FLOPS_NOTE,
            "memory_note": "torch.cuda peak allocated/reserved over the timed steps; None on CPU",
        },
        "models": models,
        "goal": goal(models),
        "ok": not failed,
    }
    return write_result(result, args.out, print_table)


def ac_loss_diffs(variants: dict) -> dict:
    """Per compile mode, the largest |loss difference| between checkpointed and plain runs (same
    seed, same data: activation checkpointing must not change the maths)."""
    out = {}
    for base in ("eager", "compiled"):
        for suffix in ("+ac", "+sac"):
            a, b = variants.get(base, {}), variants.get(base + suffix, {})
            if "losses" in a and "losses" in b:
                out[base + suffix] = max(abs(x - y) for x, y in
                                         zip(a["losses"], b["losses"], strict=True))
    return out


def goal(models: dict) -> dict:
    key, target = MFU_GOAL
    runs = {v: r["mfu"] for v, r in models.get(key, {}).get("variants", {}).items()
            if "mfu" in r}
    best = max(runs, key=runs.get) if runs else None
    return {"model": key, "mfu_target": target, "best_variant": best,
            "best_mfu": runs.get(best), "met": bool(best and runs[best] >= target)}


def print_table(r: dict) -> None:
    c, gib = r["config"], 2**30
    print(f"\n{c['device_name']} ({c['device']}), torch {c['torch']}, {c['dtype']}, compile "
          f"{c['compile_backend']} per {c['compile_scope']}, {c['steps']} timed steps after "
          f"{c['warmup']} warm-up; MFU vs {c['peak_flops'] / 1e12:.0f} TFLOP/s "
          f"({c['peak_source']})")
    for key, m in r["models"].items():
        if "skipped" in m:
            print(f"\n{key}: skipped ({m['skipped']})")
            continue
        print(f"\n{key}: {m['model']}, {(m.get('params') or 0) / 1e6:.1f}M params, "
              f"{m['batch']}x{m['seq']} tokens/step, {m['flops_per_token'] / 1e9:.2f} GFLOP/token")
        print(f"{'variant':<13}{'tok/s':>11}{'step ms':>9}{'TFLOP/s':>9}{'MFU':>7}{'alloc':>8}"
              f"{'resv':>7}{'loss first->last':>20}  |{'pred tok/s':>11}{'pred MFU':>9}"
              f"{'pred mem':>9}")
        for v, x in m["variants"].items():
            p = x["predicted"]
            pred = (f"{p['tokens_per_s']:>11,.0f}{100 * p['mfu']:>8.1f}%"
                    f"{p['memory_bytes'] / gib:>8.1f}G" if "error" not in p else "  planner: "
                    + p["error"][:40])
            if "error" in x:
                print(f"{v:<13}{'error: ' + x['error'].splitlines()[0][:60]:<67}  |{pred}")
                continue
            mem = ("".join(f"{x[k] / gib:>7.1f}G" for k in ("max_memory_allocated",
                                                            "max_memory_reserved"))
                   if x["max_memory_allocated"] is not None else f"{'-':>8}{'-':>7}")
            loss = f"{x['losses'][0]:.4f}->{x['losses'][-1]:.4f}"
            print(f"{v:<13}{x['tokens_per_s']:>11,.0f}{x['median_step_s'] * 1e3:>9.1f}"
                  f"{x['tflops']:>9.1f}{100 * x['mfu']:>6.1f}%{mem}{loss:>20}  |{pred}")
        if m.get("ac_loss_max_abs_diff"):
            diffs = ", ".join(f"{k} {d:.2g}" for k, d in m["ac_loss_max_abs_diff"].items())
            print(f"checkpointed vs plain, max |loss diff|: {diffs}")
    g = r["goal"]
    if g["best_variant"]:
        print(f"\ngoal: {g['model']} MFU >= {100 * g['mfu_target']:.0f}%: best "
              f"{g['best_variant']} {100 * g['best_mfu']:.1f}% -> "
              f"{'met' if g['met'] else 'not met'}")


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["ok"] else 1)
