"""Text generation from a training checkpoint, resharded over tensor-parallel ranks, KV-cached.

A checkpoint stores every parameter whole, in its global shape, under `model/<name>`, whatever
layout wrote it (dp, ZeRO, TP, PP, CP: see checkpoint.whole_state). So loading for inference
ignores how training was laid out: build the model from the run's config, cut it with its own
tensor-parallel plan (`Llama.TP_PLAN`) over `tp` ranks, and let DCP read the global tensors
into each rank's slices (`whole_state` describes them as ShardedTensors over tp). Only the
model entries are requested: the optimizer state is never read.

Decoding (models.generate.generate_cached) prefills the prompt once, then feeds one token per
step; each rank's KV cache holds only its own heads. Under tp a step costs 2 all-reduces per
layer (attention and MLP outputs), 1 for the vocabulary-parallel embedding and 1 all-gather of
the last position's logits. Sampling needs nothing more: every rank draws from the gathered
logits with the same seeded generator, and the all-gather leaves the same bytes on every rank,
so all ranks pick the same token without a broadcast.

`python -m meshloom.inference --request JSON` is the per-rank entry that `meshloom generate`
launches through torchrun; with tp=1 the command runs `run()` in its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from meshloom import checkpoint, comm, launch
from meshloom.comm import CommCounter
from meshloom.config import (
    Config,
    ConfigError,
    ModelConfig,
    RunConfig,
    resolve_backend,
    resolve_device,
)
from meshloom.data import DataError, load_tokenizer
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models import families
from meshloom.models.families import build_model
from meshloom.models.generate import Generation, generate_cached, sample_token
from meshloom.optim import named_trainable
from meshloom.parallel.tensor import AXIS
from meshloom.parallel.tensor_plan import TensorParallel, check_tp_dims
from meshloom.validation import model_config

TIMEOUT_S = 300.0  # a collective that waits longer fails instead of hanging


class GenerateError(ValueError):
    """Bad input for generation; the message is one line naming what is wrong."""


@dataclass
class Request:
    """What `meshloom generate` asks for (JSON-able: it travels to the ranks as one argument)."""

    path: str  # a run folder (its newest intact checkpoint) or a checkpoint folder
    prompt: str
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = 40  # None: sample from the whole vocabulary
    seed: int = 0
    tp: int = 1
    device: str = "auto"  # auto | cpu | cuda
    stop_at_eos: bool = True


@dataclass
class Prepared:
    """Everything checked and resolved before any rank starts."""

    checkpoint: Path
    meta: dict[str, Any]
    model_cfg: Any  # the family's config (models/families.py)
    tokenizer: Any
    prompt_ids: list[int]
    device: str  # cpu | cuda


# ---------------------------------------------------------------- checks (parent process)


def _open_checkpoint(path: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `path` names, checked (format, index, files: meshloom.checkpoint), and its
    meta, which must hold the training config."""
    try:
        ckpt, meta = checkpoint.open_checkpoint(path)
    except checkpoint.CheckpointError as e:
        raise GenerateError(str(e)) from None
    if not isinstance(meta.get("config"), dict):
        raise GenerateError(f"checkpoint {ckpt}: meta.json has no training config")
    return ckpt, meta


def _run_config(raw: dict[str, Any]) -> Config:
    """The parts of the saved training config that generation needs: model and tokenizer."""
    cfg = Config()
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg.model = ModelConfig(**{k: v for k, v in raw.get("model", {}).items() if k in known})
    cfg.data.tokenizer = raw.get("data", {}).get("tokenizer", cfg.data.tokenizer)
    return cfg


def _check_model_entries(ckpt: Path, mcfg: Any) -> None:
    """Before any rank starts: the checkpoint's DCP metadata has every parameter of the model the
    config builds, in its global shape, and the files holding them are there and long enough
    (a foreign checkpoint is one line here, not a failure inside every rank; a format without a
    manifest is only checked this far)."""
    try:  # the allow-list reader: a crafted .metadata cannot run code
        md = checkpoint.read_metadata(ckpt)
    except checkpoint.CheckpointError as e:
        raise GenerateError(str(e)) from None
    with torch.device("meta"):
        expected = {f"model/{n}": tuple(p.shape)
                    for n, p in build_model(mcfg, seed=0, device="meta").named_parameters()}
    for key, shape in expected.items():
        entry = md.state_dict_metadata.get(key)
        if entry is None:
            raise GenerateError(f"checkpoint {ckpt} has no {key}: it was not written by the model "
                                "its config describes")
        if tuple(getattr(entry, "size", ())) != shape:
            raise GenerateError(f"checkpoint {ckpt}: {key} has shape "
                                f"{tuple(getattr(entry, 'size', ()))}, the config builds {shape}")
    needed: dict[str, int] = {}  # file -> bytes the model's entries need in it
    for index, info in md.storage_data.items():
        if index.fqn in expected:
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = ckpt / name
        if not path.is_file() or path.stat().st_size < size:
            state = "is missing" if not path.is_file() else "is truncated"
            raise GenerateError(f"checkpoint {ckpt} is damaged: {name} {state}")


def _available(device: str) -> tuple[int, str]:
    if device == "cuda":
        return torch.cuda.device_count(), "CUDA devices"
    return len(os.sched_getaffinity(0)), "CPU cores (one rank per core)"


def prepare(req: Request) -> Prepared:
    """Check the request against the checkpoint; GenerateError (one line) if it cannot run."""
    if req.tp < 1:
        raise GenerateError(f"--tp={req.tp} must be >= 1")
    if req.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens={req.max_new_tokens} must be >= 1")
    if not req.temperature >= 0:  # also refuses NaN
        raise GenerateError(f"--temperature={req.temperature} must be >= 0 (0: greedy)")
    if req.top_k is not None and req.top_k < 1:
        raise GenerateError(f"--top-k={req.top_k} must be >= 1 (or 0: no top-k)")
    if not req.prompt:
        raise GenerateError("--prompt is empty: give at least one character to continue")
    ckpt, meta = _open_checkpoint(req.path)
    cfg = _run_config(meta["config"])
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        # The model the checkpoint holds, as training recorded it; rebuilding it from the run's
        # config would read model.init_from's source again (gone, perhaps, or changed since).
        stored = meta.get("model")
        mcfg = families.config_from_dict(stored) if stored else \
            model_config(cfg, tokenizer.vocab_size)
    except (ConfigError, DataError, TypeError, ValueError) as e:
        raise GenerateError(f"checkpoint {ckpt}: its config does not build a model: {e}") from None
    if tokenizer.vocab_size > mcfg.vocab_size:
        raise GenerateError(f"checkpoint {ckpt}: the tokenizer has {tokenizer.vocab_size} ids, "
                            f"the model's vocabulary only {mcfg.vocab_size}")
    _check_model_entries(ckpt, mcfg)
    problem = check_tp_dims(req.tp, n_heads=mcfg.n_heads, kv_heads=mcfg.kv_heads,
                            ffn_hidden=mcfg.hidden)
    if problem:
        raise GenerateError(problem.replace("parallel.tp", "--tp"))
    if req.device not in ("auto", "cpu", "cuda"):
        raise GenerateError(f"--device={req.device}: one of auto, cpu, cuda")
    device = resolve_device(RunConfig(device=req.device))
    if device == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device=cuda, but no CUDA device is available")
    have, what = _available(device)
    if req.tp > have:
        raise GenerateError(f"--tp={req.tp} is more than the {have} {what} available")
    ids = tokenizer.encode(req.prompt)
    if not ids:
        raise GenerateError("--prompt encodes to no tokens")
    # The last new token is never fed back: prompt + max_new_tokens - 1 positions are used.
    if len(ids) + req.max_new_tokens - 1 > mcfg.max_seq_len:
        raise GenerateError(f"the prompt ({len(ids)} tokens) plus --max-new-tokens="
                            f"{req.max_new_tokens} exceed the model's max_seq_len="
                            f"{mcfg.max_seq_len}")
    return Prepared(ckpt, meta, mcfg, tokenizer, ids, device)


# ---------------------------------------------------------------- loading (every rank)


def init_mesh(tp: int, device: str) -> Mesh:
    """The tp ranks' mesh, joining the process group if there is none yet: torchrun's
    environment (RANK, WORLD_SIZE, MASTER_*) for tp > 1; tp = 1 forms a group of its own in
    memory (no port, whatever the environment says)."""
    if not dist.is_initialized():
        # NCCL bound to the rank's GPU (rank_device has selected it), as in training.
        bind = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
        launch.join_group(resolve_backend(RunConfig(device=device)),
                          datetime.timedelta(seconds=TIMEOUT_S), bind, alone=tp == 1)
    if dist.get_world_size() != tp:
        raise GenerateError(f"--tp={tp}, but {dist.get_world_size()} ranks were launched")
    return Mesh(ParallelDims(tp=tp), dist.get_rank(), device, CommCounter())


def rank_device(device: str) -> torch.device:
    if device != "cuda":
        return torch.device("cpu")
    local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(local)
    return local


def load_model(ckpt: Path, mcfg: Any, mesh: Mesh,
               device: torch.device) -> tuple[nn.Module, TensorParallel | None]:
    """Collective over tp: the model with this rank's slices filled from the checkpoint."""
    # The seed is irrelevant: every parameter is overwritten by the load.
    model = build_model(mcfg, seed=0, device=device).eval()
    tp = TensorParallel(model, model.TP_PLAN, mesh) if mesh.size(AXIS) > 1 else None
    # The same `model/<name>` entries training saves, in global shape: DCP reshards into them.
    state = checkpoint.whole_state(named_trainable(model), mesh)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ShardedTensor's deprecation notices
            dcp.load(state, storage_reader=checkpoint.SafeReader(str(ckpt)))
    except CheckpointException as e:  # a BaseException: name what failed underneath it
        cause = next(iter(e.failures.values()))[0] if e.failures else e
        raise checkpoint.CheckpointError(f"checkpoint {ckpt}: cannot load the model's parameters "
                                         f"({type(cause).__name__}: {cause})") from e
    return model, tp


Pick = Callable[[torch.Tensor], torch.Tensor]


def make_pick(tp: TensorParallel | None, temperature: float, top_k: int | None,
              generator: torch.Generator | None) -> Pick:
    """The next-token rule for `generate_cached`: gather the vocabulary-split logits of the last
    position (tp), then sample from them with this rank's generator (seeded alike on all)."""
    def pick(logits: torch.Tensor) -> torch.Tensor:
        if tp is not None:
            logits = comm.gather_from_group(logits.contiguous(), tp.mesh, AXIS, dim=-1)
            logits = logits[..., :tp.vocab_size]  # drop the padding of a split vocabulary
        return sample_token(logits.float(), temperature, top_k, generator)
    return pick


@torch.no_grad()
def warm_up(model: nn.Module, pick: Pick, prompt: torch.Tensor) -> None:
    """Two untimed steps of what a generation runs (kernels, thread pools, the collectives'
    first use), so that tokens/s measure decoding, not one-time start-up. Collective over tp;
    give it a ``pick`` with a generator of its own, so the real one's draws stay unchanged."""
    cache = model.new_cache(2)
    for _ in range(2):
        pick(model(prompt[:, :1], cache=cache)[:, -1])


def generate_on_rank(req: Request, prep: Prepared, mesh: Mesh,
                     device: torch.device) -> dict[str, Any]:
    """Collective over tp: load, generate, and return the result (the same on every rank)."""
    t0 = time.perf_counter()
    model, tp = load_model(prep.checkpoint, prep.model_cfg, mesh, device)
    load_s = time.perf_counter() - t0
    generator = torch.Generator(device).manual_seed(req.seed)
    prompt = torch.tensor([prep.prompt_ids], dtype=torch.long, device=device)
    eos = prep.tokenizer.eos_id if req.stop_at_eos else None
    warm_up(model, make_pick(tp, req.temperature, req.top_k, torch.Generator(device)), prompt)
    gen: Generation = generate_cached(
        model, prompt, req.max_new_tokens, temperature=req.temperature, top_k=req.top_k,
        generator=generator, eos_id=eos, pick=make_pick(tp, req.temperature, req.top_k,
                                                        generator))
    new = gen.tokens[0, len(prep.prompt_ids):].tolist()
    if eos is not None and eos in new:
        new = new[:new.index(eos)]
    text = prep.tokenizer.decode(prep.prompt_ids + new)
    n_prompt = len(prep.prompt_ids)
    return {
        "text": text, "completion": prep.tokenizer.decode(new), "prompt": req.prompt,
        "prompt_tokens": n_prompt, "new_tokens": len(new), "new_ids": new,
        "checkpoint": str(prep.checkpoint), "step": prep.meta.get("step"),
        "trained_layout": prep.meta.get("layout"), "tp": mesh.size(AXIS),
        "device": device.type, "load_s": load_s,
        "prefill_s": gen.prefill_s, "prefill_tokens_per_s": n_prompt / gen.prefill_s,
        "decode_s": gen.decode_s, "decode_steps": gen.decode_steps,
        "decode_tokens_per_s": gen.decode_steps / gen.decode_s if gen.decode_steps else None,
        "temperature": req.temperature, "top_k": req.top_k, "seed": req.seed,
        "params": prep.model_cfg.num_params(),
    }


# ---------------------------------------------------------------- reporting and entry points


def _layout(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "unknown layout"
    parts = [f"{k}={v}" for k, v in layout.items() if k != "zero_stage" and v != 1]
    if layout.get("zero_stage"):
        parts.append(f"zero_stage={layout['zero_stage']}")
    return " ".join(parts) or "1 process"


def report(result: dict[str, Any], as_json: bool) -> None:
    """The text (or the JSON) on stdout; what happened on stderr."""
    err = sys.stderr
    print(f"generate: {result['checkpoint']} (step {result['step']}, trained as "
          f"{_layout(result['trained_layout'])}) on tp={result['tp']} {result['device']} "
          f"rank(s), {result['params'] / 1e6:.2f}M params, loaded in {result['load_s']:.2f}s",
          file=err)
    print(f"prefill: {result['prompt_tokens']} tokens in {result['prefill_s'] * 1e3:.1f} ms = "
          f"{result['prefill_tokens_per_s']:.1f} tokens/s", file=err)
    if result["decode_steps"]:
        ms = result["decode_s"] * 1e3 / result["decode_steps"]
        print(f"decode: {result['decode_steps']} tokens in {result['decode_s'] * 1e3:.1f} ms = "
              f"{result['decode_tokens_per_s']:.1f} tokens/s ({ms:.2f} ms/token)", file=err)
    else:
        print("decode: 0 tokens (the first new token ended the generation)", file=err)
    err.flush()
    if as_json:
        print(json.dumps(result))
    else:
        print(result["text"])
    sys.stdout.flush()


def run(req: Request, as_json: bool = False) -> dict[str, Any]:
    """This rank's part of a generation; rank 0 reports. The process group is this call's to
    end if it started it (tp=1 inside the `meshloom` process itself)."""
    owned = not dist.is_initialized()
    prep = prepare(req)
    try:
        device = rank_device(prep.device)  # before the group: NCCL binds to this GPU
        mesh = init_mesh(req.tp, prep.device)
        result = generate_on_rank(req, prep, mesh, device)
        if dist.get_rank() == 0:
            report(result, as_json)
        return result
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Per-rank entry (`python -m meshloom.inference --request JSON [--json]`)."""
    ap = argparse.ArgumentParser(prog="python -m meshloom.inference")
    ap.add_argument("--request", required=True, help="a Request as JSON")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    req = Request(**json.loads(args.request))
    rank = os.environ.get("RANK", "0")
    try:
        run(req, args.json)
    except (GenerateError, checkpoint.CheckpointError) as e:
        # Every rank says it (the launcher may stop the others before they can): name which.
        where = f" (rank {rank})" if req.tp > 1 else ""
        launch.say(f"meshloom: error: {e}{where}")
        return launch.EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - one line naming the rank, then the details
        launch.rank_failed(f"rank {rank} failed: {type(e).__name__}: {e}", traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    launch.rank_entry()
    launch.exit_rank(main())
