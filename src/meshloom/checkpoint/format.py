"""What a checkpoint folder must hold, and which format versions this meshloom reads.

The one place that knows it: training's resume, `meshloom generate`, `meshloom convert` and
`model.init_from` all check a folder through `checked_meta` before they read a tensor of it.

Format history (the `format` key of meta.json):
  2  flat per-rank shards: unreadable now
  3  every parameter and moment in its global shape, keyed by name
  4  as 3, plus manifest.json (each file's size and SHA-256)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshloom.checkpoint.files import MANIFEST, META, CheckpointError, problems

FORMAT_VERSION = 4  # what save_checkpoint writes
# Model weights read the same way from both; the rest of a checkpoint is training state.
WEIGHTS_FORMATS = (3, 4)
# A resume verifies the manifest before it loads, so it needs a format that has one.
RESUME_FORMATS = (4,)
FIRST_MANIFEST_FORMAT = 4
DCP_INDEX = ".metadata"


def is_checkpoint_folder(path: Path) -> bool:
    """Whether `path` is one checkpoint folder (committed, or damaged since) rather than a run
    folder: it holds the commit marker or the manifest."""
    return (path / META).is_file() or (path / MANIFEST).is_file()


def read_meta(path: str | Path) -> dict[str, Any]:
    """meta.json as written, unchecked (OSError or ValueError if it cannot be read)."""
    return json.loads((Path(path) / META).read_text())


def _versions(formats: tuple[int, ...]) -> str:
    if len(formats) == 1:
        return f"format {formats[0]}"
    return f"formats {formats[0]}..{formats[-1]}"


def checked_meta(path: str | Path, *, resume: bool = False, verify: bool = True) -> dict[str, Any]:
    """The meta.json of checkpoint folder `path` once the folder is fit to read: the meta is
    readable, its format is one this meshloom reads (`resume`: a run can continue from it;
    otherwise: its model weights can be read), DCP's index is there, and (`verify`, where the
    format has a manifest) every file matches its size and checksum. CheckpointError, one line
    naming the folder and what is wrong, otherwise."""
    path = Path(path)
    if not (path / META).is_file():
        raise CheckpointError(f"checkpoint {path} has no {META}: it was never committed")
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {META} ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: {META} is not a JSON object")
    fmt = meta.get("format")
    readable = RESUME_FORMATS if resume else WEIGHTS_FORMATS
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt not in readable:
        if resume:
            reads = f"a run resumes only from {_versions(RESUME_FORMATS)} " \
                f"({_versions(WEIGHTS_FORMATS)} serve as weights: generate, convert, init_from)"
        else:
            reads = f"this meshloom reads {_versions(WEIGHTS_FORMATS)}"
        raise CheckpointError(f"checkpoint {path} has format {fmt}; {reads}")
    if not (path / DCP_INDEX).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no DCP {DCP_INDEX} file")
    if verify and fmt >= FIRST_MANIFEST_FORMAT:
        damage = problems(path)
        if damage:
            more = f" (+{len(damage) - 1} more)" if len(damage) > 1 else ""
            raise CheckpointError(f"checkpoint {path} is damaged: {damage[0]}{more}")
    return meta
