"""Loading a checkpoint into a live training run (collective), and choosing the one to resume
from: the newest intact one, damaged ones skipped with a line each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from meshloom.checkpoint import files
from meshloom.checkpoint.files import CheckpointError, SafeReader
from meshloom.checkpoint.find import complete_checkpoints, newest_usable
from meshloom.checkpoint.format import checked_meta
from meshloom.checkpoint.state import materialize_optimizer_state, training_state


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    strategy) -> dict[str, Any]:
    """Collective: restore model and optimizer in place; returns the checkpoint's meta."""
    path = Path(path)
    # The files were verified (collectively) when the checkpoint was chosen.
    meta = checked_meta(path, resume=True, verify=False)
    materialize_optimizer_state(optimizer)
    state = training_state(model, optimizer, strategy)
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
    if not found:
        return None

    def problem(path: Path) -> str | None:
        damage = verify_collective(path)
        if not damage:
            return None
        more = f" (+{len(damage) - 3} more)" if len(damage) > 3 else ""
        return f"checkpoint {path} is damaged: {'; '.join(damage[:3])}{more}"

    return newest_usable(found, problem, log)
