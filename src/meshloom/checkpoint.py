"""Checkpoints: sharded save/load with torch.distributed.checkpoint, committed atomically.

A checkpoint is written into `RUN_DIR/checkpoints/.tmp-step_NNNNNNN`, and only when every rank has
finished writing does rank 0 add `meta.json` and rename the folder to `step_NNNNNNN`. A folder
without `meta.json` (a crash mid-write) is never picked up for a resume, and older complete
checkpoints are pruned only after a newer one is committed, so there is always one to go back to.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from meshloom.mesh import Mesh
from meshloom.placement import checkpoint_entry, checkpoint_name

_STEP_DIR = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 3  # 3: parameters in their global shape (2: flat)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Committed checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / "meta.json").is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


ADAM_STATS = ("exp_avg", "exp_avg_sq")


def whole_state(named_params: list[tuple[str, nn.Parameter]], mesh: Mesh,
                optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Entries for parameters each rank holds whole, or as a tensor-parallel slice:
    `model/<name>`, or `optim/<name>/<stat>` when `optimizer` is given, in the parameter's global
    shape (a slice becomes a ShardedTensor over tp). The values are views of the live tensors, so
    a load fills them in place."""
    out = {}
    for name, p in named_params:
        name = checkpoint_name(name, p)
        if optimizer is None:
            out[f"model/{name}"] = checkpoint_entry(p, p.detach().view(-1), 0, mesh)
            continue
        for k in ADAM_STATS:
            out[f"optim/{name}/{k}"] = checkpoint_entry(p, optimizer.state[p][k].view(-1), 0,
                                                        mesh)
    return out


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    strategy) -> dict[str, Any]:
    """What a checkpoint holds, keyed by parameter name so that it does not depend on the
    layout: `model/<name>` and `optim/<name>/<stat>`, each in the parameter's global shape —
    whole, or this rank's rectangles of it as a ShardedTensor where the layout splits it — plus
    the AdamW step count."""
    state: dict[str, Any] = strategy.model_state()
    state.update(strategy.optimizer_state(optimizer))
    steps = [st["step"] for st in optimizer.state.values() if "step" in st]
    state["optim/step"] = torch.tensor(float(steps[0]) if steps else 0.0)
    return state


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, strategy, meta: dict[str, Any], *,
                    keep: int = 2) -> Path:
    """Collective: every rank calls it. Returns the committed folder."""
    rank = dist.get_rank()
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp-step_{step:07d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left over from a run that died while writing
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    _materialize_optimizer_state(optimizer)
    dcp.save(_training_state(model, optimizer, strategy), checkpoint_id=str(tmp))
    # RNG streams differ per rank, so they go beside the shared tensors, one small file each.
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        full_meta = {"format": FORMAT_VERSION, "step": step, "time": time.time(),
                     "world_size": dist.get_world_size(), **meta}
        meta_tmp = tmp / "meta.json.partial"
        with open(meta_tmp, "w") as f:
            json.dump(full_meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, tmp / "meta.json")
        if final.exists():  # the same step saved again (e.g. a resumed run's last step)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily made state, so that a load has tensors to fill.

    A step with zero gradients at lr 0 creates every state tensor and leaves the parameters
    untouched; the load then overwrites it. (torch's own state-dict helper skips this whenever
    `.grad` exists, as it does under our DDP, after which DCP would silently load nothing.)
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    strategy) -> dict[str, Any]:
    """Collective: restore model and optimizer in place; returns the checkpoint's meta."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')}; this meshloom "
                              f"reads format {FORMAT_VERSION}")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no DCP .metadata file")
    _materialize_optimizer_state(optimizer)
    state = _training_state(model, optimizer, strategy)
    dcp.load(state, checkpoint_id=str(path))
    strategy.after_step()  # sharded masters -> the working parameters
    step = state["optim/step"].item()
    for st in optimizer.state.values():
        if torch.is_tensor(st.get("step")):
            st["step"].fill_(step)
        elif "step" in st:
            st["step"] = step
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if meta.get("world_size") == dist.get_world_size() and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta
