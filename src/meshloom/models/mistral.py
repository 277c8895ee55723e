"""Mistral: the Llama decoder (models/llama.py) with a sliding attention window.

Mistral 7B v0.1 has Llama 2's block (RMSNorm, SwiGLU, grouped-query attention, RoPE, no biases)
and lets each query attend to the last ``sliding_window`` keys only, itself included, as
transformers' MistralForCausalLM does. Later Mistral releases set no window (``None``: full
causal attention, then exactly a Llama). Context parallel cannot apply a window shorter than the
sequence (its ring attention is full causal): ``LlamaConfig.layout_problem`` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from meshloom.models.contract import Family
from meshloom.models.llama import LlamaConfig, build_model


@dataclass
class MistralConfig(LlamaConfig):
    family: ClassVar[str] = "mistral"  # models/families.py


PRESETS: dict[str, dict] = {
    # A test-sized model whose window (32) is shorter than configs/tiny.toml's 64 tokens.
    "mistral-tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=257,
                         max_seq_len=256, sliding_window=32),
    # mistralai/Mistral-7B-v0.1's config.json.
    "mistral-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                       vocab_size=32000, max_seq_len=32768, rope_theta=10000.0, norm_eps=1e-5,
                       sliding_window=4096),
}

FAMILY = Family(name="mistral", config=MistralConfig, build=build_model, presets=PRESETS,
                hf="meshloom.models.llama_hf", hf_model_types=("mistral",))
