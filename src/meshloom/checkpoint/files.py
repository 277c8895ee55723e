"""A checkpoint folder's integrity and safe reading.

Every committed checkpoint carries `manifest.json`: each file's size and SHA-256, written after
all ranks finished writing and before the folder is committed. A resume (and `meshloom
checkpoint info`) checks it, so a truncated or bit-flipped file is named instead of loaded.

DCP keeps its index (`.metadata`) as a pickle, and torch unpickles it with `pickle.load`, which
can run any code a crafted file names. `SafeReader` reads it with an unpickler that only builds
DCP's own metadata records, torch sizes and dtypes; tensors themselves DCP already reads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

MANIFEST = "manifest.json"
META = "meta.json"  # written last: its presence is the commit marker
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder."""


# ---------------------------------------------------------------- manifest


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def data_files(folder: Path) -> list[str]:
    """The files a manifest covers: everything but itself and the commit marker."""
    return sorted(p.name for p in folder.iterdir()
                  if p.is_file() and p.name not in (MANIFEST, META)
                  and not p.name.endswith(".partial"))


def my_share(names: list[str], rank: int, world: int) -> list[str]:
    """The files this rank hashes: the work is spread over all ranks, each file done once."""
    return names[rank::world]


def describe(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": file_digest(folder / n)}
            for n in names}


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is unreadable ({e})") from None
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} lists no files")
    return files


def problems(folder: Path, hash_only: list[str] | None = None) -> list[str]:
    """What is wrong with a committed checkpoint folder ([] if nothing). Sizes are checked for
    every file; checksums only for `hash_only` (None: all), so ranks can split the hashing."""
    folder = Path(folder)
    try:
        json.loads((folder / META).read_text())
        files = read_manifest(folder)
    except (CheckpointError, ValueError, OSError) as e:
        return [str(e) if isinstance(e, CheckpointError) else f"{META} is unreadable ({e})"]
    found = []
    if ".metadata" not in files:
        found.append(f"{MANIFEST} does not list DCP's .metadata")
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            found.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != want.get("bytes"):
            found.append(f"{name} has {size} bytes, the manifest says {want.get('bytes')} "
                         "(truncated or overwritten)")
        elif (hash_only is None or name in hash_only) and file_digest(path) != want.get("sha256"):
            found.append(f"{name} does not match its SHA-256 checksum (corrupted)")
    return found


# ---------------------------------------------------------------- safe metadata reading


def _allowed_torch_attr(name: str) -> bool:
    value = getattr(torch, name, None)
    return name == "Size" or isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,  # any of DCP's metadata records
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get(module, ())
        if (module == "torch" and _allowed_torch_attr(name)) or allowed is None \
                or name in allowed:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def read_metadata(folder: Path) -> Metadata:
    try:
        with open(Path(folder) / ".metadata", "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise CheckpointError(f"checkpoint {folder}: .metadata is not a DCP index ({e})") from None
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"checkpoint {folder}: .metadata is not a DCP index")
    return meta


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, but the index is read by the allow-list unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta = read_metadata(Path(self.path))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


def tensor_entries(folder: Path) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's tensors by key, with their global shapes and dtypes (nothing loaded)."""
    return {k: v for k, v in read_metadata(folder).state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def read_tensors(folder: str | Path, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """Whole tensors whose key starts with `prefix`, assembled on this process from however many
    ranks wrote them (no process group needed): `{key without prefix: tensor}`."""
    folder = Path(folder)
    entries = {k: v for k, v in tensor_entries(folder).items() if k.startswith(prefix)}
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in entries.items()}
    if state:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.load(state, storage_reader=SafeReader(str(folder)), no_dist=True)
    return {k[len(prefix):]: t for k, t in state.items()}
