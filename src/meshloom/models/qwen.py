"""Qwen2 / Qwen2.5 and Qwen3: the Llama decoder (models/llama.py) with its attention options.

- Qwen2 (and 2.5, the same architecture): a bias on the q, k and v projections
  (``attention_bias``), none on the output projection; RoPE theta 1e6.
- Qwen3: no biases, but an RMSNorm of each head's q and k before RoPE (``qk_norm``, one gain of
  ``head_dim`` entries shared by all heads), and a head width set apart from the hidden width
  (``head_dim``: 128 in every size, so Qwen3-0.6B's q is 2048 wide over a hidden of 1024).

Neither slides a window in the released models (transformers' ``use_sliding_window`` is false);
the HF import refuses a config that turns it on. Two families, two config classes: a stored
config names its family, and the presets of each are their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from meshloom.models.contract import Family
from meshloom.models.llama import LlamaConfig, build_model


@dataclass
class Qwen2Config(LlamaConfig):
    family: ClassVar[str] = "qwen2"  # models/families.py
    attention_bias: bool = True


@dataclass
class Qwen3Config(LlamaConfig):
    family: ClassVar[str] = "qwen3"
    qk_norm: bool = True


_QWEN = dict(rope_theta=1000000.0, norm_eps=1e-6)

QWEN2_PRESETS: dict[str, dict] = {
    "qwen2-tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=257,
                       max_seq_len=256, tie_embeddings=True),
    # Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-7B's config.json.
    "qwen2.5-0.5b": dict(_QWEN, dim=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         ffn_hidden=4864, vocab_size=151936, max_seq_len=32768,
                         tie_embeddings=True),
    "qwen2.5-7b": dict(_QWEN, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                       ffn_hidden=18944, vocab_size=152064, max_seq_len=131072),
}

QWEN3_PRESETS: dict[str, dict] = {
    # head_dim 32 over dim 64 / 4 heads: q is twice the hidden width, as in Qwen3-0.6B.
    "qwen3-tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                       vocab_size=257, max_seq_len=256),
    # Qwen/Qwen3-0.6B and Qwen/Qwen3-8B's config.json.
    "qwen3-0.6b": dict(_QWEN, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                       ffn_hidden=3072, vocab_size=151936, max_seq_len=40960,
                       tie_embeddings=True),
    "qwen3-8b": dict(_QWEN, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                     ffn_hidden=12288, vocab_size=151936, max_seq_len=40960),
}

QWEN2 = Family(name="qwen2", config=Qwen2Config, build=build_model, presets=QWEN2_PRESETS,
               hf="meshloom.models.llama_hf", hf_model_types=("qwen2",))
QWEN3 = Family(name="qwen3", config=Qwen3Config, build=build_model, presets=QWEN3_PRESETS,
               hf="meshloom.models.llama_hf", hf_model_types=("qwen3",))
FAMILIES = (QWEN2, QWEN3)  # models/families.py: a module exports FAMILY, or FAMILIES
