"""Reference models and sampling."""

from meshloom.models.generate import generate
from meshloom.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    build_model,
    config_from_preset,
    init_tensor,
    init_weights,
)

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "build_model",
    "config_from_preset",
    "generate",
    "init_tensor",
    "init_weights",
]
