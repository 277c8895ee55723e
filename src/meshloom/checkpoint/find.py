"""From a folder a user names to a checkpoint folder.

A user may name a checkpoint folder (`RUN/checkpoints/step_NNNNNNN`), a run folder, or a run's
`checkpoints/` folder; every command that reads checkpoints (generate, convert, checkpoint info,
model.init_from) resolves it here. In a run folder the newest *intact* checkpoint is the one
used: a damaged one is skipped with a line naming the damage, as a resume does. A checkpoint
folder named directly is used as it is, damaged or not (the check then names what is wrong).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshloom.checkpoint.files import META, CheckpointError
from meshloom.checkpoint.format import checked_meta, is_checkpoint_folder

_STEP_DIR = re.compile(r"^step_(\d+)$")
ROOT = "checkpoints"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / ROOT


def step_folder(run_dir: str | Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:07d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """A run's committed checkpoints (those with the commit marker), oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / META).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def run_folder_of(path: Path) -> Path | None:
    """The run folder `path` is (it has checkpoints/), or whose checkpoints/ folder it is."""
    if checkpoint_root(path).is_dir():
        return path
    if path.name == ROOT and path.is_dir():
        return path.parent
    return None


def checkpoints_in(path: str | Path) -> list[Path]:
    """`path` itself if it is a checkpoint folder, else the committed checkpoints of the run it
    names, oldest first. CheckpointError (one line) if it is no folder or holds none."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such folder")
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a folder")
    if is_checkpoint_folder(p):
        return [p]
    run = run_folder_of(p)
    found = complete_checkpoints(run) if run is not None else []
    if not found:
        raise CheckpointError(f"{p} holds no complete checkpoint (neither a checkpoint folder "
                              f"with {META} nor a run folder with {ROOT}/step_*/{META})")
    return found


def newest_usable(found: list[Path], problem: Callable[[Path], str | None],
                  log: Callable[[str], Any]) -> Path:
    """The newest of `found` (oldest first, not empty) that `problem` finds nothing wrong with;
    each one skipped is one line through `log`. CheckpointError if none is usable: going on
    without one (a fresh start, an older run's weights) would silently be another run."""
    for path in reversed(found):
        why = problem(path)
        if why is None:
            return path
        log(f"{why}; falling back to the previous one")
    raise CheckpointError(f"no intact checkpoint in {found[-1].parent}: all {len(found)} are "
                          "damaged (see above); nothing was loaded")


def warn(line: str) -> None:
    sys.stderr.write(f"meshloom: warning: {line}\n")
    sys.stderr.flush()


def open_checkpoint(path: str | Path, *,
                    log: Callable[[str], Any] = warn) -> tuple[Path, dict[str, Any]]:
    """The checkpoint folder `path` names and its checked meta (format.checked_meta): the
    folder itself, or the newest intact checkpoint of a run. CheckpointError, one line, if
    there is none fit to read. One process, no process group."""
    found = checkpoints_in(path)
    if is_checkpoint_folder(Path(path)):
        return found[0], checked_meta(found[0])
    checked: dict[Path, dict[str, Any]] = {}

    def problem(folder: Path) -> str | None:
        try:
            checked[folder] = checked_meta(folder)
        except CheckpointError as e:
            return str(e)
        return None

    use = newest_usable(found, problem, log)
    return use, checked[use]
