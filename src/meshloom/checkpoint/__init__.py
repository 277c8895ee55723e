"""Checkpoints: sharded save and load with torch.distributed.checkpoint (DCP), committed
atomically, verified by a manifest, read back under any layout.

Which file holds what:
  format.py  format versions; what a checkpoint folder must hold; `checked_meta`, the one check
             every reader runs before it reads a tensor
  find.py    run folder or checkpoint folder -> the checkpoint to use (newest intact one)
  files.py   manifest (sizes, SHA-256), integrity problems, the allow-list DCP index reader,
             whole tensors read on one process
  state.py   what a checkpoint holds: layout-independent model/optimizer entries, RNG state
  save.py    save_checkpoint: write, hash, commit, prune (collective)
  load.py    load_checkpoint and the choice of the checkpoint to resume from (collective)

The names below are what the rest of meshloom imports (`from meshloom.checkpoint import ...`).
"""

from meshloom.checkpoint.files import (
    MANIFEST,
    META,
    CheckpointError,
    SafeReader,
    read_metadata,
    read_tensors,
    tensor_entries,
)
from meshloom.checkpoint.find import (
    checkpoint_root,
    checkpoints_in,
    complete_checkpoints,
    latest_checkpoint,
    open_checkpoint,
)
from meshloom.checkpoint.format import FORMAT_VERSION, checked_meta, read_meta
from meshloom.checkpoint.load import load_checkpoint, resumable_checkpoint, verify_collective
from meshloom.checkpoint.save import save_checkpoint
from meshloom.checkpoint.state import ADAM_STATS, whole_state

__all__ = ["ADAM_STATS", "FORMAT_VERSION", "MANIFEST", "META", "CheckpointError", "SafeReader",
           "checked_meta", "checkpoint_root", "checkpoints_in", "complete_checkpoints",
           "latest_checkpoint", "load_checkpoint", "open_checkpoint", "read_meta",
           "read_metadata", "read_tensors", "resumable_checkpoint", "save_checkpoint",
           "tensor_entries", "verify_collective", "whole_state"]
