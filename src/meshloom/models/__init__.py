"""Model families (models/families.py), the contract they honour (models/contract.py), sampling.

`build_model` and `config_from_preset` work for every family: the preset names it."""

from meshloom.models.families import FAMILIES, build_model, config_from_preset, presets
from meshloom.models.generate import generate
from meshloom.models.llama import PRESETS, Llama, LlamaConfig, init_tensor, init_weights

__all__ = [
    "FAMILIES",
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "build_model",
    "config_from_preset",
    "generate",
    "init_tensor",
    "init_weights",
    "presets",
]
