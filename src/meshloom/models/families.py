"""The model families meshloom trains, and the look-ups everything else does through them.

A family is a module that defines its config dataclass, its model (honouring the model contract,
models/contract.py), its presets and, optionally, its Hugging Face format, and exports them as
`FAMILY` (a contract.Family; closely related families may share a module, which then exports
them as `FAMILIES`). Adding one is a new module and one line in `_MODULES`; nothing in
`parallel/` changes. Preset names are unique across families, so `model.preset` alone names the
family; a stored config carries its family's name (`config_to_dict`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from types import ModuleType
from typing import Any

import torch
from torch import nn

from meshloom.models.contract import Family

# Family modules, in the order `meshloom plan` and the docs list them.
_MODULES = ("meshloom.models.llama", "meshloom.models.gpt2", "meshloom.models.mistral",
            "meshloom.models.qwen", "meshloom.models.mixtral")

FAMILIES: dict[str, Family] = {}
for _module in _MODULES:
    _mod = importlib.import_module(_module)
    for _family in getattr(_mod, "FAMILIES", None) or (_mod.FAMILY,):  # one module, several
        FAMILIES[_family.name] = _family

DEFAULT = "llama"  # what a stored config without a family name was written by


def presets() -> dict[str, Family]:
    """Every preset name -> its family."""
    out: dict[str, Family] = {}
    for family in FAMILIES.values():
        for name in family.presets:
            if name in out:
                raise RuntimeError(f"preset {name!r} is defined by {out[name].name} and "
                                   f"{family.name}")
            out[name] = family
    return out


def _closest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}{_closest(name, list(FAMILIES))}; "
                         f"families: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(cfg: Any) -> Family:
    """The family of a model config object (its class names it)."""
    return get(type(cfg).family)


def config_from_preset(preset: str, family: str | None = None, **overrides: Any) -> Any:
    """The validated config of `preset` with `overrides` (config field -> value) applied.
    `family`, when given, must be the preset's own."""
    by_preset = presets()
    if preset not in by_preset:
        raise ValueError(f"unknown model preset {preset!r}{_closest(preset, list(by_preset))}; "
                         f"presets: {', '.join(by_preset)}")
    fam = by_preset[preset]
    if family is not None and family != fam.name:
        get(family)  # an unknown family is named as such
        raise ValueError(f"model.family={family!r}, but preset {preset!r} is a {fam.name} "
                         f"preset; {family} presets: {', '.join(get(family).presets)}")
    known = {f.name for f in dataclasses.fields(fam.config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"model.{unknown[0]} is not a setting of the {fam.name} family "
                         f"(its settings: {', '.join(sorted(known))})")
    cfg = fam.config(**{**fam.presets[preset], **overrides})
    cfg.validate()
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain JSON of a model config, with its family's name (what checkpoints store)."""
    return {"family": family_of(cfg).name, **dataclasses.asdict(cfg)}


def config_from_dict(data: dict[str, Any]) -> Any:
    """The inverse of config_to_dict; a dict without `family` is a Llama config (written before
    families existed). ValueError for unknown keys or invalid values."""
    data = dict(data)
    fam = get(data.pop("family", DEFAULT))
    known = {f.name for f in dataclasses.fields(fam.config)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a setting of the {fam.name} family")
    cfg = fam.config(**data)
    cfg.validate()
    return cfg


def build_model(cfg: Any, seed: int, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """Validate, construct without allocating, materialise on `device` and initialise."""
    return family_of(cfg).build(cfg, seed, device=device, dtype=dtype)


def parameter_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in the model's order (built on the meta device); a
    tied head is listed once, under the embedding's name."""
    model = build_model(cfg, seed=0, device="meta")
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def tied_head(cfg: Any) -> str | None:
    """The name of the output weight when it *is* the embedding table (not stored apart)."""
    tied = build_model(cfg, seed=0, device="meta").pieces().tied
    return tied[1] if tied else None


def hf_format(family: Family) -> ModuleType:
    if family.hf is None:
        raise ValueError(f"the {family.name} family has no Hugging Face format")
    return importlib.import_module(family.hf)


def hf_model_types() -> list[str]:
    return [t for f in FAMILIES.values() for t in f.hf_model_types]


def family_of_hf_type(model_type: Any) -> Family | None:
    """The family that reads Hugging Face configs of `model_type`, if any."""
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    return None
