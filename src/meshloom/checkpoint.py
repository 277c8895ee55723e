"""Checkpoints: sharded save/load with torch.distributed.checkpoint, committed atomically.

A checkpoint is written into `RUN_DIR/checkpoints/.tmp-step_NNNNNNN`, and only when every rank has
finished writing does rank 0 add `manifest.json` (each file's size and SHA-256), then `meta.json`,
and rename the folder to `step_NNNNNNN`. A folder without `meta.json` (a crash mid-write) is never
picked up for a resume; one whose files no longer match their manifest is skipped with a message
naming the damage, and the resume falls back to the previous one. Older complete checkpoints are
pruned only after a newer one is committed, so there is always one to go back to. A state with a
non-finite value is never written.
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

from meshloom import checkpoint_files as files
from meshloom.checkpoint_files import MANIFEST, CheckpointError, SafeReader
from meshloom.mesh import Mesh
from meshloom.placement import checkpoint_entry, checkpoint_name

_STEP_DIR = re.compile(r"^step_(\d+)$")
# 4: manifest.json with sizes and checksums; 3: parameters in their global shape (2: flat)
FORMAT_VERSION = 4

__all__ = ["MANIFEST", "CheckpointError", "complete_checkpoints", "latest_checkpoint",
           "load_checkpoint", "resumable_checkpoint", "save_checkpoint"]


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
    """Collective: every rank calls it. Returns the committed folder. Raises CheckpointError, on
    every rank and before anything is written, if any rank holds a non-finite value."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _materialize_optimizer_state(optimizer)
    state = _training_state(model, optimizer, strategy)
    _refuse_non_finite(state, step)
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp-step_{step:07d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left over from a run that died while writing
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    # RNG streams differ per rank, so they go beside the shared tensors, one small file each.
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    # Each rank hashes its share of the files; rank 0 writes the manifest of them all.
    share = files.describe(tmp, files.my_share(files.data_files(tmp), rank, world))
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, share)
    if rank == 0:
        manifest = {k: v for part in shares for k, v in part.items()}
        files.write_json_atomic(tmp / MANIFEST, {"files": dict(sorted(manifest.items()))})
        full_meta = {"format": FORMAT_VERSION, "step": step, "time": time.time(),
                     "world_size": world, **meta}
        files.write_json_atomic(tmp / "meta.json", full_meta)
        if final.exists():  # the same step saved again (e.g. a resumed run's last step)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _local_tensors(value: Any) -> list[torch.Tensor]:
    if hasattr(value, "local_shards"):  # ShardedTensor: this rank's rectangles
        return [shard.tensor for shard in value.local_shards()]
    return [value] if torch.is_tensor(value) else []


def _refuse_non_finite(state: dict[str, Any], step: int) -> None:
    """Collective. A checkpoint is what a run falls back to: one holding NaN or inf would make
    every restart from it fail again, so it is never written."""
    bad = next((k for k, v in state.items()
                for t in _local_tensors(v)
                if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, bad)
    culprits = [(r, n) for r, n in enumerate(names) if n is not None]
    if culprits:
        r, n = culprits[0]
        raise CheckpointError(f"refusing to write the step-{step} checkpoint: {n} holds "
                              f"non-finite values (rank {r}" +
                              (f" and {len(culprits) - 1} more" if len(culprits) > 1 else "") +
                              "); the previous checkpoint is kept")


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
    dcp.load(state, storage_reader=SafeReader(str(path)))
    strategy.after_step()  # sharded masters -> the working parameters
    step = state["optim/step"].item()
    for st in optimizer.state.values():
        if torch.is_tensor(st.get("step")):
            st["step"].fill_(step)
        elif "step" in st:
            st["step"] = step
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if meta.get("world_size") == dist.get_world_size() and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


def verify_collective(path: Path) -> list[str]:
    """Collective: `path`'s problems ([] if intact), the same list on every rank. The checksums
    are split over the ranks, so a large checkpoint is verified in parallel."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        names = sorted(files.read_manifest(path))
    except CheckpointError as e:
        names, early = [], [str(e)]
    else:
        early = []
    mine = early or files.problems(path, hash_only=files.my_share(names, rank, world))
    found: list[Any] = [None] * world
    dist.all_gather_object(found, mine)
    return sorted({p for part in found for p in part})


def resumable_checkpoint(run_dir: str | Path, log=print) -> Path | None:
    """Collective: the newest intact checkpoint of the run (None if the run has none). Damaged
    ones are skipped, each with one line through `log` naming what is wrong; if every one is
    damaged, CheckpointError (starting over silently would throw the run away)."""
    found = complete_checkpoints(run_dir)
    for path in reversed(found):
        damage = verify_collective(path)
        if not damage:
            return path
        log(f"checkpoint {path} is damaged: {'; '.join(damage[:3])}"
            + (f" (+{len(damage) - 3} more)" if len(damage) > 3 else "")
            + "; falling back to the previous one")
    if found:
        raise CheckpointError(f"no intact checkpoint in {checkpoint_root(run_dir)}: all "
                              f"{len(found)} are damaged (see above); nothing was loaded")
    return None
