"""Mixtral: the Mistral decoder (models/mistral.py) with a mixture-of-experts feed-forward.

Every block's SwiGLU becomes a router over `n_experts` SwiGLU experts, `top_k` of them per token
with softmax scores renormalised over the chosen ones, as transformers' MixtralForCausalLM does
(models/moe.py). The load-balancing loss and an optional capacity factor are meshloom's, computed
per sequence (docs/moe.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from meshloom.models.contract import Family
from meshloom.models.llama import build_model
from meshloom.models.mistral import MistralConfig


@dataclass
class MixtralConfig(MistralConfig):
    family: ClassVar[str] = "mixtral"  # models/families.py

    n_experts: int = 8
    top_k: int = 2


PRESETS: dict[str, dict] = {
    # Test-sized: 8 experts of width 64, top 2, no window (configs/moe_tiny.toml).
    "mixtral-tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=257,
                         max_seq_len=256, n_experts=8, top_k=2, moe_hidden=64),
    # mistralai/Mixtral-8x7B-v0.1's config.json (46.7B parameters, 12.9B active per token).
    "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, moe_hidden=14336,
                         vocab_size=32000, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5,
                         n_experts=8, top_k=2, aux_loss_coef=0.02),
    # mistralai/Mixtral-8x22B-v0.1 (141B parameters, 39B active).
    "mixtral-8x22b": dict(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, moe_hidden=16384,
                          vocab_size=32000, max_seq_len=65536, rope_theta=1e6, norm_eps=1e-5,
                          n_experts=8, top_k=2, aux_loss_coef=0.001),
}

FAMILY = Family(name="mixtral", config=MixtralConfig, build=build_model, presets=PRESETS,
                hf="meshloom.models.mixtral_hf", hf_model_types=("mixtral",))
