"""Hugging Face checkpoints (``config.json`` + safetensors) <-> meshloom models, for every family
that declares an HF format (models/families.py; each family's module maps its config, tensor
names and layouts: models/llama_hf.py, ...).

Reading and writing only; nothing here imports transformers, so a conversion needs no more than
``safetensors``. Only safetensors weights are read: a pickled ``pytorch_model.bin`` can run code
when loaded, so it is refused. A tied output head is not stored on either side: it *is* the
embedding table.

A family's HF module provides: ``config_from_hf(raw) -> config`` (ValueError for what meshloom
cannot run), ``hf_config(cfg, dtype, eos_token_id) -> dict``, ``meshloom_name(hf_name) -> name``
(None for a tensor to skip, ValueError for an unknown one), ``hf_name(name)``, and
``to_meshloom(name, w, cfg)`` / ``to_hf(name, w, cfg)`` for tensors whose layout differs. A format
whose tensors are not one to one with meshloom's (GPT-2's fused c_attn) provides instead
``split_hf(hf_name, w, cfg) -> [(name, w), ...]`` and ``join_hf({name: w}, cfg) -> {hf_name: w}``.
A format that stores one meshloom tensor as several (Mixtral's experts, one HF tensor each, are
meshloom's stacked ``[E, ...]`` weights) provides as well ``stacked_part(hf_name) -> (name, i)``
(None for a tensor that is not a slice: this one is slice ``i`` along dim 0 of ``name``) and
``stacked_hf_names(name, n) -> [hf_name, ...]`` (None for a tensor that is not stacked: the HF
names of its ``n`` slices, in order); ``to_meshloom`` / ``to_hf`` then see the whole stack.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from meshloom.models import families

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"


class HFCheckpointError(ValueError):
    """An HF folder that cannot be read or written; the message is one line naming it."""


def _format(cfg: Any) -> ModuleType:
    family = families.family_of(cfg)
    if family.hf is None:
        raise HFCheckpointError(f"the {family.name} family has no Hugging Face format")
    return families.hf_format(family)


def read_hf_config(folder: str | Path) -> Any:
    """The meshloom model config of an HF folder; refuses what meshloom cannot run."""
    path = Path(folder) / CONFIG
    if not Path(folder).is_dir():
        raise HFCheckpointError(f"{folder}: no such folder")
    if not path.is_file():
        raise HFCheckpointError(f"{folder}: no {CONFIG} (not a Hugging Face model folder)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{path}: not a model config (a JSON object)")
    family = families.family_of_hf_type(raw.get("model_type"))
    if family is None:
        supported = ", ".join(repr(t) for t in families.hf_model_types())
        raise HFCheckpointError(f"{path}: model_type={raw.get('model_type')!r} is not "
                                f"supported (supported: {supported})")
    try:
        return families.hf_format(family).config_from_hf(raw)
    except ValueError as e:
        raise HFCheckpointError(f"{path}: {e}") from None


def hf_config_dict(cfg: Any, dtype: torch.dtype, eos_token_id: int | None = None) -> dict:
    """``config.json`` for ``cfg``, readable by transformers 4.x and 5.x."""
    return _format(cfg).hf_config(cfg, dtype, eos_token_id)


# -------------------------------------------------------------------------------- files


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of an HF folder: ``model.safetensors``, or the shards its index
    names."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise HFCheckpointError(f"{index} names {f.name}, which is missing")
        return files
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise HFCheckpointError(f"{folder}: only safetensors weights are read (pickled .bin/.pt "
                                "files can run code when loaded); re-save the model with "
                                "save_pretrained(..., safe_serialization=True)")
    raise HFCheckpointError(f"{folder}: no {SINGLE} or {INDEX}")


def require_safetensors() -> None:
    """A one-line error instead of an ImportError when the optional package is missing."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise HFCheckpointError("reading or writing Hugging Face weights needs the safetensors "
                                "package: pip install 'meshloom[hf]'") from None


def open_safetensors(path: Path):
    """``safe_open`` with a one-line error for a file that is not safetensors."""
    require_safetensors()
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - the Rust side raises its own error types
        raise HFCheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def iter_hf_weights(folder: str | Path, cfg: Any) -> Iterator[tuple[str, Tensor]]:
    """(meshloom name, tensor in meshloom's layout) for every weight of an HF folder, one tensor
    in memory at a time (the slices of a stacked one until it is whole). Checks names and shapes
    against ``cfg``; a tied head found in the file is skipped (it is the embedding)."""
    fmt = _format(cfg)
    expected = families.parameter_shapes(cfg)
    tied = families.tied_head(cfg)
    seen = set()
    stacks: dict[str, dict[int, Tensor]] = {}  # stacked tensors whose slices are being read
    for path in weight_files(folder):
        with open_safetensors(path) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                split = hasattr(fmt, "split_hf")  # several meshloom tensors in one HF tensor
                try:
                    part = fmt.stacked_part(key) if hasattr(fmt, "stacked_part") else None
                    if part is not None:
                        pairs = _add_slice(stacks, *part, key, f.get_tensor(key), expected)
                    elif split:
                        pairs = fmt.split_hf(key, f.get_tensor(key), cfg)
                    else:
                        name = fmt.meshloom_name(key)
                        pairs = [] if name is None else [(name, None)]
                except ValueError as e:
                    raise HFCheckpointError(f"{path.name}: {e}") from None
                for name, w in pairs:
                    if name == tied:
                        continue
                    if name not in expected:
                        raise HFCheckpointError(f"{path.name}: tensor {key!r} does not fit the "
                                                f"config ({cfg.n_layers} layers)")
                    w = f.get_tensor(key) if w is None else w
                    if tuple(w.shape) != expected[name]:
                        raise HFCheckpointError(f"{path.name}: {key} has shape "
                                                f"{tuple(w.shape)}, the config implies "
                                                f"{expected[name]}")
                    seen.add(name)
                    yield name, w if split and part is None else fmt.to_meshloom(name, w, cfg)
    missing = sorted(set(expected) - seen)
    if missing:
        name = missing[0]
        names = (fmt.stacked_hf_names(name, expected[name][0])
                 if hasattr(fmt, "stacked_hf_names") else None)
        if names is not None:  # the first slice not read
            name = names[min(set(range(len(names))) - set(stacks.get(name, {})))]
        else:
            name = fmt.hf_name(name)
        raise HFCheckpointError(f"{folder}: {len(missing)} weight(s) missing, e.g. {name!r}")


def _add_slice(stacks: dict[str, dict[int, Tensor]], name: str, i: int, key: str, w: Tensor,
               expected: dict[str, tuple[int, ...]]) -> list[tuple[str, Tensor]]:
    """Keep ``w`` (HF tensor ``key``) as slice ``i`` of the stacked meshloom tensor ``name``;
    returns [(name, whole tensor)] once every slice is in, else []."""
    shape = expected.get(name)
    if shape is None or not 0 <= i < shape[0]:
        raise ValueError(f"tensor {key!r} does not fit the config")
    if tuple(w.shape) != shape[1:]:
        raise ValueError(f"{key} has shape {tuple(w.shape)}, the config implies {shape[1:]}")
    parts = stacks.setdefault(name, {})
    if i in parts:
        raise ValueError(f"tensor {key!r} is stored twice")
    parts[i] = w
    if len(parts) < shape[0]:
        return []
    del stacks[name]
    return [(name, torch.stack([parts[j] for j in range(shape[0])]))]


def write_hf_folder(folder: str | Path, cfg: Any, weights: dict[str, Tensor], *,
                    max_shard_bytes: int, eos_token_id: int | None = None) -> list[Path]:
    """Write ``config.json`` and safetensors of meshloom ``weights`` (meshloom names and layout)
    into an existing ``folder``: one ``model.safetensors`` if it fits ``max_shard_bytes``, else
    ``model-0000i-of-0000n.safetensors`` shards and their index. Returns the weight files."""
    require_safetensors()
    from safetensors.torch import save_file

    folder = Path(folder)
    fmt, tied = _format(cfg), families.tied_head(cfg)
    # The model's own order (input part, blocks, output part): a shard holds neighbouring layers.
    order = {n: i for i, n in enumerate(families.parameter_shapes(cfg))}
    ordered = [n for n in sorted(weights, key=lambda n: (order.get(n, len(order)), n))
               if n != tied]
    # First, so that a model the format cannot express is refused before any tensor is named.
    config = hf_config_dict(cfg, weights[ordered[0]].dtype, eos_token_id)
    if hasattr(fmt, "join_hf"):
        joined = fmt.join_hf({n: weights[n] for n in ordered}, cfg)
        tensors = {k: t.contiguous() for k, t in joined.items()}
    else:
        tensors = {}
        stacked = getattr(fmt, "stacked_hf_names", lambda name, n: None)
        for n in ordered:
            w = fmt.to_hf(n, weights[n], cfg)
            names = stacked(n, w.shape[0]) if w.dim() else None
            if names is None:
                tensors[fmt.hf_name(n)] = w.contiguous()
            else:  # disjoint views of one tensor, which safetensors writes apart
                tensors.update(zip(names, w.unbind(0), strict=True))
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:  # a too-big tensor gets its own shard
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    meta = {"format": "pt"}  # transformers checks this key
    if len(shards) == 1:
        files = [folder / SINGLE]
        save_file(shards[0], str(files[0]), metadata=meta)
    else:
        files = [folder / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
        for f, shard in zip(files, shards, strict=True):
            save_file(shard, str(f), metadata=meta)
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in tensors.values())},
                 "weight_map": {k: f.name for f, s in zip(files, shards, strict=True) for k in s}}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return files
