"""Whole model weights outside a training run: read any meshloom source, write a weights folder,
and start a run from existing weights (``model.init_from``).

A meshloom *weights folder* is what ``meshloom convert hf-to-meshloom`` writes:
    model.safetensors   every parameter under its meshloom name, in its global shape, in the
                        layout meshloom's model computes with (a tied head is not stored)
    meshloom.json       {"format": "meshloom-weights", "version": 1, "model": {"family": ...,
                        the family's config}} (models/families.py)
    tokenizer.json      copied from the source, when it had one
A checkpoint folder (``RUN_DIR/checkpoints/step_N``) or a run folder (its newest intact
checkpoint) serves as a source too: meshloom.checkpoint resolves and checks it. Checkpoints are
read on one process, without a process group, through the checkpoint package's allow-list
reader (nothing but DCP's metadata is unpickled).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from meshloom import checkpoint
from meshloom.checkpoint import CheckpointError
from meshloom.models import families
from meshloom.models.hf_checkpoint import (
    TOKENIZER_FILE,
    HFCheckpointError,
    iter_hf_weights,
    open_safetensors,
    read_hf_config,
)

WEIGHTS_META = "meshloom.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "meshloom-weights"


class WeightsError(ValueError):
    """A weights source that cannot be used; the message is one line naming it."""


@dataclasses.dataclass
class Source:
    """What a meshloom source holds: the model config, where its weights are, and the tokenizer
    it was trained with, where known and still there ("byte" or a tokenizer.json path)."""

    kind: str  # "weights" (a weights folder) or "checkpoint" (a DCP checkpoint folder)
    path: Path
    cfg: Any  # the family's config (models/families.py)
    tokenizer: str | None


# -------------------------------------------------------------------------------- reading


def open_source(path: str | Path) -> Source:
    """A weights folder, a checkpoint folder, or a run folder (its newest intact checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        raise WeightsError(f"{path}: no such folder")
    if (path / WEIGHTS_META).is_file():
        return _weights_folder(path)
    is_checkpoint = checkpoint.format.is_checkpoint_folder(path)
    if not is_checkpoint and checkpoint.find.run_folder_of(path) is None:
        raise WeightsError(f"{path}: neither a meshloom weights folder ({WEIGHTS_META}), a "
                           "checkpoint (meta.json) nor a run folder (checkpoints/)")
    try:
        return _checkpoint_source(*checkpoint.open_checkpoint(path))
    except CheckpointError as e:
        raise WeightsError(str(e)) from None


def _weights_folder(path: Path) -> Source:
    try:
        meta = json.loads((path / WEIGHTS_META).read_text())
        if meta.get("format") != FORMAT:
            raise WeightsError(f"{path / WEIGHTS_META}: format is not {FORMAT!r}")
        cfg = families.config_from_dict(meta["model"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise WeightsError(f"{path / WEIGHTS_META}: not a meshloom weights config: {e}") from None
    if not (path / WEIGHTS_FILE).is_file():
        raise WeightsError(f"{path}: no {WEIGHTS_FILE}")
    tok = path / TOKENIZER_FILE
    return Source("weights", path, cfg, str(tok) if tok.is_file() else None)


def _checkpoint_source(path: Path, meta: dict) -> Source:
    """A checkpoint folder that open_checkpoint has checked (format, index, manifest)."""
    entries = checkpoint.tensor_entries(path)
    if "model" in meta:  # the resolved model config, written since model.init_from exists
        cfg = families.config_from_dict(meta["model"])
    else:  # older checkpoints: the preset and overrides, with the vocabulary the table has
        model = dict(meta["config"]["model"])
        overrides = {k: v for k, v in model.items()
                     if k not in ("preset", "init_from") and v is not None}
        overrides["vocab_size"] = entries["model/tok_embeddings.weight"].size[0]
        cfg = families.config_from_preset(model["preset"], **overrides)
    tok = meta.get("config", {}).get("data", {}).get("tokenizer", "byte")
    if tok != "byte":
        file = Path(tok.removeprefix("hf:")).expanduser()
        file = file / TOKENIZER_FILE if file.is_dir() else file
        tok = str(file) if file.is_file() else None
    return Source("checkpoint", path, cfg, tok)


def _read_checkpoint(path: Path) -> dict[str, Tensor]:
    """The ``model/<name>`` entries of a DCP checkpoint as whole CPU tensors, assembled on this
    process alone from however many ranks' pieces were saved."""
    try:
        return checkpoint.read_tensors(path, "model/")
    except CheckpointError as e:
        raise WeightsError(str(e)) from None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        raise WeightsError(f"checkpoint {path}: cannot read: {type(e).__name__}: {first}") \
            from None


def iter_weights(src: Source) -> Iterator[tuple[str, Tensor]]:
    """(meshloom name, tensor) of every parameter of ``src``, checked against its config."""
    expected = families.parameter_shapes(src.cfg)
    if src.kind == "weights":
        try:
            f = open_safetensors(src.path / WEIGHTS_FILE)
        except HFCheckpointError as e:
            raise WeightsError(str(e)) from None
        with f:
            names = set(f.keys())
            _check_names(src.path, names, expected)
            for name in expected:
                yield name, _checked(src.path, name, f.get_tensor(name), expected)
        return
    state = _read_checkpoint(src.path)
    _check_names(src.path, set(state), expected)
    for name in expected:
        yield name, _checked(src.path, name, state[name], expected)


def _check_names(path: Path, names: set[str], expected: dict) -> None:
    missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or extra:
        what = f"{missing[0]!r} missing" if missing else f"unexpected {extra[0]!r}"
        raise WeightsError(f"{path}: weights do not fit the model config ({what})")


def _checked(path: Path, name: str, t: Tensor, expected: dict) -> Tensor:
    if tuple(t.shape) != expected[name]:
        raise WeightsError(f"{path}: {name} has shape {tuple(t.shape)}, the model config "
                           f"implies {expected[name]}")
    return t


# -------------------------------------------------------------------------------- writing


def write_weights_folder(folder: str | Path, cfg: Any,
                         weights: Iterator[tuple[str, Tensor]], *, source: str = "",
                         dtype: torch.dtype | None = None,
                         tokenizer: str | Path | None = None) -> None:
    """Write a weights folder into the existing, empty ``folder``."""
    from meshloom.models.hf_checkpoint import require_safetensors

    require_safetensors()
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {name: (t if dtype is None else t.to(dtype)).contiguous() for name, t in weights}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {"format": FORMAT, "version": 1, "model": families.config_to_dict(cfg),
            "source": source}
    (folder / WEIGHTS_META).write_text(json.dumps(meta, indent=2) + "\n")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / TOKENIZER_FILE)


# -------------------------------------------------------------------------------- init_from


def _parse_init_from(spec: str) -> tuple[str, Path]:
    kind, sep, path = spec.partition(":")
    if not sep or kind not in ("hf", "meshloom") or not path:
        raise WeightsError(f"'{spec}' must be 'hf:PATH' (a Hugging Face model folder) or "
                           "'meshloom:PATH' (a weights, checkpoint or run folder)")
    return kind, Path(path).expanduser()


# Model keys that may be set beside init_from: they change no weight.
_FREE_KEYS = ("preset", "family", "init_from", "max_seq_len", "init_std")
# Training settings of a mixture of experts, not its shape: a run may set them over the source's.
_TRAINING_KEYS = ("aux_loss_coef", "capacity_factor")


def init_from_config(model_cfg, vocab_size: int | None) -> Any:
    """The model config of a run with ``model.init_from`` set (``model_cfg`` is config.py's
    ModelConfig): the source decides the shape; the tokenizer must fit its vocabulary.

    Raises WeightsError (config.py adds the key name)."""
    kind, path = _parse_init_from(model_cfg.init_from)
    try:
        cfg = read_hf_config(path) if kind == "hf" else open_source(path).cfg
    except HFCheckpointError as e:
        raise WeightsError(str(e)) from None
    fixed = [f.name for f in dataclasses.fields(model_cfg)
             if f.name not in _FREE_KEYS + _TRAINING_KEYS
             and getattr(model_cfg, f.name) is not None]
    if fixed:
        raise WeightsError(f"model.{fixed[0]} cannot be set beside it: the checkpoint decides "
                           "the model's shape")
    family = families.family_of(cfg).name
    if model_cfg.family is not None and model_cfg.family != family:
        raise WeightsError(f"model.family={model_cfg.family!r}, but the weights are a {family} "
                           "model")
    if vocab_size is not None and vocab_size > cfg.vocab_size:
        raise WeightsError(f"the tokenizer's vocabulary ({vocab_size}) exceeds the checkpoint's "
                           f"vocab_size={cfg.vocab_size}; point data.tokenizer at the model's "
                           "tokenizer.json")
    if model_cfg.max_seq_len is not None:
        cfg.max_seq_len = model_cfg.max_seq_len
    for key in _TRAINING_KEYS:
        value = getattr(model_cfg, key)
        if value is not None and not getattr(cfg, "n_experts", 0):
            raise WeightsError(f"model.{key} is a mixture-of-experts setting, but the weights "
                               f"are a dense {family} model")
        if value is not None:
            setattr(cfg, key, value)
    try:
        cfg.validate()
    except ValueError as e:
        raise WeightsError(str(e)) from None
    return cfg


@torch.no_grad()
def load_init_weights(model: torch.nn.Module, spec: str) -> None:
    """Copy the weights ``model.init_from`` names into the freshly built, whole ``model``
    (before parallelize, which then slices and shards them like any initial weights)."""
    kind, path = _parse_init_from(spec)
    if kind == "hf":
        weights = iter_hf_weights(path, read_hf_config(path))
    else:
        weights = iter_weights(open_source(path))
    params = dict(model.named_parameters())  # a tied head is listed once, as the embedding
    for name, t in weights:
        p = params.pop(name, None)
        if p is None or p.shape != t.shape:
            raise WeightsError(f"{spec}: {name} {tuple(t.shape)} does not fit the model")
        p.copy_(t)
    if params:
        raise WeightsError(f"{spec}: no weight for {sorted(params)[0]}")

