"""Saving a checkpoint, committed atomically.

A checkpoint is written into `RUN_DIR/checkpoints/.tmp-step_NNNNNNN`, and only when every rank has
finished writing does rank 0 add `manifest.json` (each file's size and SHA-256), then `meta.json`,
and rename the folder to `step_NNNNNNN`. A folder without `meta.json` (a crash mid-write) is never
picked up. Older complete checkpoints are pruned only after a newer one is committed, so there is
always one to go back to. A state with a non-finite value is never written.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from meshloom.checkpoint import files
from meshloom.checkpoint.files import MANIFEST, META, CheckpointError
from meshloom.checkpoint.find import checkpoint_root, complete_checkpoints, step_folder
from meshloom.checkpoint.format import FORMAT_VERSION
from meshloom.checkpoint.state import materialize_optimizer_state, rng_state, training_state


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, strategy, meta: dict[str, Any], *,
                    keep: int = 2) -> Path:
    """Collective: every rank calls it. Returns the committed folder. Raises CheckpointError, on
    every rank and before anything is written, if any rank holds a non-finite value."""
    rank, world = dist.get_rank(), dist.get_world_size()
    materialize_optimizer_state(optimizer)
    state = training_state(model, optimizer, strategy)
    _refuse_non_finite(state, step)
    root = checkpoint_root(run_dir)
    final = step_folder(run_dir, step)
    tmp = root / f".tmp-step_{step:07d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left over from a run that died while writing
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    # RNG streams differ per rank, so they go beside the shared tensors, one small file each.
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
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
        files.write_json_atomic(tmp / META, full_meta)
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
