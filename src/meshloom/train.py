"""The training loop, one for every layout; and the per-rank entry point.

`python -m meshloom.train CONFIG.toml [--set k=v ...] [--resume]` is what `meshloom train` launches
on every rank through torchrun (and what a user may launch with torchrun directly).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshloom import checkpoint, comm, faults, launch
from meshloom.comm import CommCounter
from meshloom.config import (
    Config,
    ConfigError,
    load_config,
    resolve_backend,
    resolve_device,
)
from meshloom.data import BatchLoader, TokenDataset, build_token_cache, eval_batches, load_tokenizer
from meshloom.mesh import Mesh, draw_layout
from meshloom.metrics import (
    MetricsLogger,
    device_peak_flops,
    live_state_bytes,
    peak_memory_bytes,
    peak_reserved_bytes,
)
from meshloom.models import families
from meshloom.models.families import build_model
from meshloom.models.generate import generate
from meshloom.optim import (
    LossScaler,
    build_optimizer,
    clip_grads,
    grad_norm_tensor,
    guarded_step,
    guards_in_kernel,
    lr_at,
    set_lr,
)
from meshloom.parallel import TORCH_DTYPES, PipelineSpec, parallelize, rank_devices
from meshloom.parallel.expert import routing_metrics
from meshloom.parallel.step import micro_batch_split
from meshloom.plan.memory import predict_run_memory
from meshloom.profiling import StepProfiler
from meshloom.validation import model_config, validate


@dataclass
class TrainResult:
    summary: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    model: nn.Module | None = None
    strategy: Any = None
    optimizer: torch.optim.Optimizer | None = None
    counter: CommCounter | None = None
    grad_bytes: int = 0
    moe: list[dict] = field(default_factory=list)  # per step, of a mixture-of-experts model


def default_run_dir(cfg: Config) -> Path:
    return Path("runs") / cfg.name


def prepare_data(cfg: Config) -> Path:
    """Tokenise the corpus into the shared cache (once; later calls return at once)."""
    tok = load_tokenizer(cfg.data.tokenizer)
    cache = cfg.data.cache_dir or str(Path.home() / ".cache" / "meshloom" / "tokens")
    return build_token_cache(cfg.data.source, tok, cache, max_bytes=cfg.data.max_bytes or None,
                             jsonl_field=cfg.data.jsonl_field)


def _init_distributed(cfg: Config, local_rank: int) -> torch.device:
    device_type = resolve_device(cfg.run)
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    device = rank_devices.home_device(cfg.parallel, device_type, local_rank) or device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    launch.join_group(resolve_backend(cfg.run), faults.process_group_timeout(cfg.run.timeout_s),
                      device)
    return device


class NonFiniteError(RuntimeError):
    """Training stopped on a NaN/inf loss or gradient norm (train.on_nonfinite)."""


def _non_finite(cfg: Config, done: int, loss: float, norm: float, in_a_row: int, run_dir: Path,
                logger: MetricsLogger) -> None:
    """A step whose loss or gradient norm is NaN/inf: skip it (the optimizer is not stepped),
    or stop. Stopping raises on every rank alike; no checkpoint of the bad state is written."""
    what = (f"step {done}: the loss or gradients are not finite (here: loss {loss:g}, "
            f"gradient norm {norm:g})")
    allowed = cfg.train.nonfinite_max_skips
    if cfg.train.on_nonfinite == "skip" and in_a_row <= allowed:
        logger.message(f"{what}: step skipped ({in_a_row} in a row, "
                       f"train.nonfinite_max_skips={allowed})")
        return
    last = checkpoint.latest_checkpoint(run_dir)
    why = (f"{in_a_row} such steps in a row" if cfg.train.on_nonfinite == "skip"
           else "train.on_nonfinite=stop")
    raise NonFiniteError(f"{what}: {why}; training stopped, no checkpoint of this state is "
                         f"written (last checkpoint: {last.name if last else 'none'}; "
                         "train.on_nonfinite=skip skips such steps)")


def _agree(mesh: Mesh, finite: bool, preempted: bool) -> tuple[bool, bool]:
    """(all ranks' step finite, any rank got SIGTERM), the same on every rank: one tiny
    all-reduce, so that no rank steps or stops alone (which would hang the others)."""
    if mesh.size("world") == 1:
        return finite, preempted
    bad, stop = comm.all_reduce_scalars([float(not finite), float(preempted)], mesh, "world",
                                        op=dist.ReduceOp.MAX)
    return bad == 0, stop > 0


def train(cfg: Config, *, resume: bool = False, keep_model: bool = False) -> TrainResult:
    """Run training on this rank. Expects RANK/WORLD_SIZE (and a rendezvous) in the environment."""
    rank, world, local_rank, local_world = launch.rank_env()
    threads = cfg.run.threads or max(1, len(os.sched_getaffinity(0)) // local_world)
    torch.set_num_threads(threads)
    dims = validate(cfg, world, check_data=False)
    device = _init_distributed(cfg, local_rank)
    counter = CommCounter()
    mesh = Mesh(dims, rank, device.type, counter)
    main = rank == 0
    run_dir = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)

    # Data: one process per node tokenises, the others then find the cache ready.
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if local_rank == 0:
        prepare_data(cfg)
    dist.barrier()
    token_file = prepare_data(cfg)
    train_ds = TokenDataset(token_file, cfg.data.seq_len, "train", cfg.data.val_fraction)
    val_ds = TokenDataset(token_file, cfg.data.seq_len, "val", cfg.data.val_fraction)
    dp_rank, dp_size = mesh.coord("dp"), mesh.size("dp")
    micro, n_micro = micro_batch_split(cfg, dims)
    loader = BatchLoader(train_ds, global_batch=cfg.train.global_batch, micro_batch=micro,
                         dp_rank=dp_rank, dp_size=dp_size, seed=cfg.train.seed)
    evals = eval_batches(val_ds, n_sequences=cfg.train.eval_sequences, micro_batch=micro,
                         dp_rank=dp_rank, dp_size=dp_size)

    mcfg = model_config(cfg, tokenizer.vocab_size)
    model = build_model(mcfg, cfg.train.seed, device=device)
    if cfg.model.init_from and not (resume and checkpoint.complete_checkpoints(run_dir)):
        from meshloom.weights import load_init_weights  # a resumed run has its own weights

        load_init_weights(model, cfg.model.init_from)  # whole: parallelize slices it as usual
    spec = PipelineSpec(n_micro, cfg.data.seq_len, cfg.parallel.pp_timeout_s)  # used under pp
    par = parallelize(model, mesh, cfg.parallel, cfg.train.dtype, pipeline=spec,
                      activation_checkpointing=cfg.train.activation_checkpointing,
                      compile_blocks=cfg.train.compile, compile_backend=cfg.train.compile_backend,
                      seq_len=cfg.data.seq_len)
    # Unsharded layouts keep fp32 parameters (they are the master weights) and compute in the
    # low-precision dtype under autocast; the sharded stages hold low-precision working copies.
    autocast = (torch.autocast(device.type, dtype=TORCH_DTYPES[cfg.train.dtype])
                if cfg.train.dtype != "fp32" and not cfg.parallel.zero_stage
                else contextlib.nullcontext())
    model = par.model
    decay, no_decay = par.grads.optim_param_groups()
    params = decay + no_decay
    optimizer = build_optimizer(decay, no_decay, cfg.train)

    scaler = LossScaler(cfg.train.dtype == "fp16")
    in_kernel_ok = guards_in_kernel(optimizer) and not scaler.enabled

    def agree_skip(flag: torch.Tensor) -> None:  # every rank skips if any rank must
        comm.all_reduce(flag, mesh, "world", op=dist.ReduceOp.MAX, label="all_reduce_scalars")
    start = 0
    if resume:
        ckpt = checkpoint.resumable_checkpoint(
            run_dir, log=lambda m: print(m, flush=True) if main else None)
        if ckpt is not None:
            meta = checkpoint.load_checkpoint(ckpt, model, optimizer, par.grads)
            start = meta["step"]
            scaler.load(meta.get("loss_scaler"))
            if main:
                print(f"resumed from {ckpt} (step {start})", flush=True)
        elif main:
            print(f"no checkpoint in {run_dir}: starting from step 0", flush=True)
    par.grads.zero_grad()

    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    flops_per_token = mcfg.flops_per_token(cfg.data.seq_len)
    peak = device_peak_flops(device, cfg.run.peak_tflops)
    logger = MetricsLogger(run_dir, main=main, total_steps=cfg.train.steps, start_step=start,
                           tensorboard=cfg.run.tensorboard, rank=rank)
    if main:
        n_params = mcfg.num_params()
        name = cfg.model.init_from or cfg.model.preset
        print(f"model: {families.family_of(mcfg).name} {name} ({n_params / 1e6:.2f}M parameters), "
              f"{len(train_ds)} train / {len(val_ds)} val sequences of {cfg.data.seq_len} tokens, "
              f"global batch {cfg.train.global_batch} = {dp_size} x {loader.accum_steps} x {micro}",
              flush=True)

    result = TrainResult(summary={}, counter=counter)
    result.grad_bytes = getattr(par.grads, "grad_bytes", 0)
    ckpt_meta = {"layout": vars(dims) | {"zero_stage": cfg.parallel.zero_stage},
                 "config": cfg.to_dict(), "model": families.config_to_dict(mcfg)}
    t_start, train_time, eval_loss = time.perf_counter(), 0.0, None
    skipped_in_a_row = 0
    preempt = faults.Preemption()
    watchdog = faults.Watchdog(counter, rank, faults.axis_groups(dims), cfg.run.timeout_s,
                               run_dir)
    profiler = None
    if cfg.run.profile_start and cfg.run.profile_start > start:
        profiler = StepProfiler(run_dir, rank, device, cfg.run.profile_start,
                                min(cfg.run.profile_steps,
                                    cfg.train.steps - cfg.run.profile_start + 1),
                                first_step=start + 1)
    with preempt, watchdog:
        for step in range(start, cfg.train.steps):
            watchdog.beat(step)
            faults.step_started(rank, step)
            t0 = time.perf_counter()
            before = counter.snapshot()
            lr = lr_at(step, cfg.train)
            set_lr(optimizer, lr)
            step_loss = par.step.forward_backward(loader.micro_batches(step), device, autocast,
                                                  scaler.scale)
            faults.gradients_ready(rank, step, params)
            norm_t = grad_norm_tensor(params, mesh, par.grads.norm_axes,
                                      getattr(par.grads, "expert_norm_axes", None))
            # A fused AdamW clips and skips a non-finite step inside its kernel: the step is
            # queued behind the norm, and the host waits for the norm alone (docs/gpu.md).
            in_kernel = in_kernel_ok and norm_t is not None
            if in_kernel:
                norm, skipped = guarded_step(optimizer, norm_t, cfg.train.grad_clip,
                                             math.isfinite(step_loss), agree_skip)()
            else:
                norm = 0.0 if norm_t is None else float(norm_t)
            done = step + 1
            local_finite = math.isfinite(step_loss) and (math.isfinite(norm) or scaler.enabled)
            # Every rank takes the same branch below and stops at the same step.
            finite, stop = _agree(mesh, local_finite, preempt.requested)
            if in_kernel and finite == skipped:
                # agree_skip took the same maximum on the device before the step ran.
                raise RuntimeError(f"step {done}: the optimizer kernel "
                                   f"{'skipped' if skipped else 'took'} a step the ranks "
                                   f"agreed was {'finite' if finite else 'not finite'}")
            if not finite:
                skipped_in_a_row += 1
                _non_finite(cfg, done, step_loss, norm, skipped_in_a_row, run_dir, logger)
            elif in_kernel or scaler.update(norm):
                skipped_in_a_row = 0
                if not in_kernel:
                    if scaler.enabled:
                        norm /= scaler.scale
                        torch._foreach_mul_([p.grad for p in params], 1.0 / scaler.scale)
                    clip_grads(params, cfg.train.grad_clip, norm)
                    optimizer.step()
                par.grads.after_step()
                scaler.grow()
                if step == cfg.train.steps - 1:  # what the layout holds per rank, with grads
                    result.summary["model_state_bytes"] = live_state_bytes(model, optimizer,
                                                                           params)
            else:
                logger.message(f"step {done}: fp16 gradients overflowed; step skipped, "
                               f"loss scale -> {scaler.scale:g}")
            par.grads.zero_grad()
            dt = time.perf_counter() - t0
            train_time += dt
            result.losses.append(step_loss)
            tps = tokens_per_step / dt
            record = {"step": done, "loss": step_loss, "lr": lr, "grad_norm": norm,
                      "tokens_per_s": tps,
                      "mfu": (flops_per_token * tps / (peak * world * par.devices)
                              if peak else None),
                      "peak_mem_bytes": peak_memory_bytes(device),
                      "peak_mem_reserved_bytes": peak_reserved_bytes(device),
                      "comm_bytes": counter.by_axis(since=before), "step_time_s": dt}
            if not finite:
                record["skipped"] = "non-finite"
            if getattr(mcfg, "n_experts", 0):
                record["moe"] = routing_metrics(model, mesh, mcfg.n_layers, mcfg.n_experts,
                                                cfg.parallel.sequence_parallel)
                result.moe.append(record["moe"])
            last = done == cfg.train.steps
            if (cfg.train.eval_every and done % cfg.train.eval_every == 0) or last:
                eval_loss = par.step.eval_loss(evals, device)
                if eval_loss is not None:
                    record["eval_loss"] = eval_loss
                    result.eval_losses[done] = eval_loss
                    logger.message(f"step {done}: eval loss {eval_loss:.4f}")
            if done % cfg.train.log_every == 0 or last:
                logger.log(record)
            logger.progress(done, step_loss, tps)
            if profiler is not None:
                profiler.step_done()
            stop = stop and not last
            if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or last \
                    or stop:
                watchdog.beat(step)
                path = checkpoint.save_checkpoint(run_dir, done, model, optimizer, par.grads,
                                                  {**ckpt_meta, "loss_scaler": scaler.state()},
                                                  keep=cfg.run.keep_checkpoints)
                if last or stop:
                    result.summary["checkpoint"] = str(path)
            if stop:
                logger.message(f"step {done}: SIGTERM received: checkpoint {path.name} saved; "
                               "stopping (continue with --resume)")
                result.summary["preempted_at_step"] = done
                break

    if profiler is not None:
        profiler.stop()
    par.step.write_timeline(run_dir)
    sample = None
    if cfg.train.sample_tokens:
        # Every rank generates (same seed, same tokens): a sharded model's forward is collective.
        text = _sample(par.inference_model, tokenizer, cfg, device)
        sample = text if main else None
    peaks = [0.0] * world
    peaks[rank] = float(peak_memory_bytes(device))
    peaks = comm.all_reduce_scalars(peaks, mesh, "world")
    reserved = [0.0] * world
    reserved[rank] = float(peak_reserved_bytes(device) or 0)
    reserved = comm.all_reduce_scalars(reserved, mesh, "world")
    try:  # the planner's prediction for this very run, to hold the measured peaks against
        predicted = predict_run_memory(mcfg, cfg, dims, micro).to_dict()
    except (ValueError, KeyError) as e:
        predicted = {"error": str(e)}
    if device.type == "cuda":
        measured = (f"memory per GPU: peak allocated {max(peaks) / 1e9:.2f} GB, reserved "
                    f"{max(reserved) / 1e9:.2f} GB; ")
        # A layout the planner cannot price (parallel.rank_devices) still gets its peaks.
        logger.message(measured + (f"planner predicted {predicted['total'] / 1e9:.2f} GB "
                                   "(allocated peak plus the CUDA context)"
                                   if "total" in predicted else
                                   f"no planner prediction ({predicted['error']})"))
    total_steps = cfg.train.steps - start
    result.summary.update({
        "run_dir": str(run_dir), "steps": cfg.train.steps, "start_step": start,
        "final_loss": result.losses[-1] if result.losses else None,
        "first_loss": result.losses[0] if result.losses else None,
        "final_eval_loss": eval_loss,
        "tokens_per_s": tokens_per_step * total_steps / train_time if train_time else None,
        "wall_time_s": time.perf_counter() - t_start,
        "params": mcfg.num_params(), "layout": vars(dims), "world_size": world,
        "peak_mem_bytes_per_rank": [int(p) for p in peaks],
        "peak_mem_reserved_bytes_per_rank": ([int(r) for r in reserved]
                                             if device.type == "cuda" else None),
        "predicted_memory_per_gpu": predicted,
        "comm_bytes": {f"{a}/{o}": n for (a, o), n in counter.bytes.items()},
        "sample": sample,
    })
    if main:
        (run_dir / "summary.json").write_text(json.dumps(result.summary, indent=2))
    logger.close()
    if keep_model:
        result.model, result.strategy, result.optimizer = model, par.grads, optimizer
    return result


def _sample(model: nn.Module, tokenizer, cfg: Config, device: torch.device) -> str:
    t = cfg.train
    prompt = torch.tensor([tokenizer.encode(t.sample_prompt)], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(t.seed)
    out = generate(model, prompt, t.sample_tokens, temperature=t.sample_temperature,
                   top_k=t.sample_top_k or None, generator=gen, eos_id=tokenizer.eos_id,
                   max_seq_len=cfg.data.seq_len)
    return tokenizer.decode(out[0].tolist())


# ---------------------------------------------------------------- per-rank entry point


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m meshloom.train")
    ap.add_argument("config", nargs="?")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rank, world, _, _ = launch.rank_env()
    # Restarted by the elastic agent (--max-restarts): continue from the last good checkpoint.
    args.resume = args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    try:
        cfg = load_config(args.config or launch.builtin_config("demo"), args.overrides)
        validate(cfg, world)
        run_dir = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg)
        if not args.resume and checkpoint.latest_checkpoint(run_dir) is not None:
            raise ConfigError(f"run.dir={run_dir} already holds checkpoints: pass --resume to "
                              "continue that run, or --set run.dir=NEW_FOLDER")
    except ConfigError as e:
        if rank == 0:
            print(f"meshloom: error: {e}", file=sys.stderr)
        return 2
    try:
        result = train(cfg, resume=args.resume)
    except (NonFiniteError, checkpoint.CheckpointError) as e:
        if rank == 0:  # every rank stops alike; one line says why
            print(f"meshloom: error: {e}", file=sys.stderr, flush=True)
        return 1
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        launch.rank_failed(f"rank {rank} failed: {type(e).__name__}: {e} "
                           f"(traceback in {run_dir / f'error_rank{rank}.txt'})")
        return 1
    finally:
        if dist.is_initialized():
            gc.collect()  # cycles holding process groups: freed before teardown (launch.py)
            dist.destroy_process_group()
    if rank == 0:
        _print_ending(result.summary)
    return 0


def _print_ending(summary: dict[str, Any]) -> None:
    if summary.get("preempted_at_step"):
        print(f"stopped by SIGTERM after step {summary['preempted_at_step']}; checkpoint "
              f"{summary['checkpoint']} saved: continue with --resume", flush=True)
    if summary.get("sample"):
        print("\n--- sample ---\n" + summary["sample"] + "\n--------------")
    first, last = summary.get("first_loss"), summary.get("final_loss")
    if first is not None:
        ev = summary.get("final_eval_loss")
        print(f"loss {first:.3f} -> {last:.3f}" + (f", eval loss {ev:.3f}" if ev else "")
              + f", {summary['tokens_per_s']:.0f} tokens/s")
    print(f"run directory: {summary['run_dir']}", flush=True)


def print_layout(cfg: Config, dims, ranks_per_node: int | None = None) -> None:
    mcfg = model_config(cfg, None)
    print(draw_layout(dims, ranks_per_node, backend=resolve_backend(cfg.run),
                      device=resolve_device(cfg.run), zero_stage=cfg.parallel.zero_stage,
                      model=mcfg, sequence_parallel=cfg.parallel.sequence_parallel,
                      stages=_stage_names(cfg, dims, mcfg),
                      devices=rank_devices.layout_lines(cfg, dims, mcfg, resolve_device(cfg.run),
                                                        ranks_per_node)), flush=True)


def _stage_names(cfg: Config, dims, mcfg) -> dict[int, str] | None:
    """For the drawing: the layers each pipeline rank runs, stage by stage."""
    if dims.pp == 1:
        return None
    from meshloom.parallel.pipeline_stage import split_layers

    v = cfg.parallel.pp_virtual_stages
    costs, head = mcfg.layer_costs(cfg.data.seq_len)
    bounds = split_layers(mcfg.n_layers, dims.pp * v, costs, head, cfg.parallel.pp_layers or None)
    out = {}
    for r in range(dims.pp):
        parts = []
        for c in range(v):
            s = c * dims.pp + r
            lo, hi = bounds[s]
            extra = (" + embedding" if s == 0 else "") + \
                (" + norm, head, loss" if s == dims.pp * v - 1 else "")
            parts.append(f"stage {s}: layers {lo}-{hi - 1}{extra}")
        out[r] = "; ".join(parts)
    return out


if __name__ == "__main__":
    launch.rank_entry()
    launch.exit_rank(main())
