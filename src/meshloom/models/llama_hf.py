"""Hugging Face's Llama format (``LlamaForCausalLM``) <-> meshloom's ``Llama``: the config
mapping, the tensor names and the one layout difference (models/hf_checkpoint.py does the file
reading and writing for every family).

RoPE pairing: meshloom's ``apply_rope`` rotates dims (2j, 2j+1) of each head together (Meta's
layout); transformers' ``rotate_half`` rotates dim j with dim j + head_dim/2. Meta's own
conversion script therefore permutes the rows of wq and wk within each head; we apply that
permutation (or its inverse) so that both models compute the same q.k products.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from meshloom.models.llama import ROPE_SCALING_KEYS, LlamaConfig, rope_scaling_problem

# -------------------------------------------------------------------------------- config


def _rope_tables(raw: dict) -> tuple[dict, dict]:
    """(rope_parameters, rope_scaling) of a config, each {} when absent or null."""
    tables = []
    for key in ("rope_parameters", "rope_scaling"):
        table = raw.get(key) or {}
        if not isinstance(table, dict):
            raise ValueError(f"{key}={table!r} is not a table")
        if table.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{key}.partial_rotary_factor is not supported")
        tables.append(table)
    return tables[0], tables[1]


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, meshloom's ``rope_scaling``) from either config style.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling``; 5.x writes ``rope_parameters``
    (theta and scaling in one table). When both tables are there, ``rope_scaling`` decides the
    scaling, as it does in transformers 4.x (which knows no other) and 5.x (which prefers it).
    """
    params, scaling = _rope_tables(raw)
    table, key = (scaling, "rope_scaling") if scaling else (params, "rope_parameters")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    # Older configs spell the type "type".
    kind = table.get("rope_type", table.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"{key}.rope_type={kind!r} is not supported (meshloom "
                                f"implements default, {', '.join(ROPE_SCALING_KEYS)})")
    # Only the keys the type uses: transformers ignores any others too (with a warning).
    ours = {"rope_type": kind, **{k: table.get(k) for k in ROPE_SCALING_KEYS[kind]}}
    problem = rope_scaling_problem(ours)
    if problem:
        raise ValueError(f"{key}: {problem}")
    return theta, ours


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "vocab_size")


def config_from_hf(raw: dict) -> LlamaConfig:
    """The ``LlamaConfig`` of an HF Llama ``config.json``; ValueError (one line) for what
    meshloom cannot run."""
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if archs != ["LlamaForCausalLM"]:
        raise ValueError(f"architectures={archs} is not supported (only LlamaForCausalLM)")
    missing = [k for k in _REQUIRED if not isinstance(raw.get(k), int)]
    if missing:
        raise ValueError(f"{missing[0]} is missing or not an integer")
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False),
                           ("mlp_bias", False), ("quantization_config", None)):
        if raw.get(key, supported) != supported:
            raise ValueError(f"{key}={raw[key]!r} is not supported (meshloom's Llama has "
                         f"{key}={supported!r})")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // max(heads, 1)
    if head_dim * heads != raw["hidden_size"]:
        raise ValueError(f"head_dim={head_dim} x num_attention_heads={heads} != hidden_size="
                     f"{raw['hidden_size']} is not supported")
    theta, scaling = _rope(raw)
    cfg = LlamaConfig(
        dim=raw["hidden_size"], n_layers=raw["num_hidden_layers"], n_heads=heads,
        n_kv_heads=raw.get("num_key_value_heads") or heads, vocab_size=raw["vocab_size"],
        ffn_hidden=raw["intermediate_size"],
        max_seq_len=raw.get("max_position_embeddings", 2048), rope_theta=theta,
        rope_scaling=scaling,
        # transformers' LlamaConfig defaults, not meshloom's, for keys a config leaves out.
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)))
    cfg.validate()
    return cfg


def hf_config(cfg: LlamaConfig, dtype: torch.dtype, eos_token_id: int | None = None) -> dict:
    """``config.json`` for ``cfg``, readable by transformers 4.x and 5.x."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        # Both RoPE spellings: 4.x reads rope_theta, 5.x rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "bos_token_id": None, "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.rope_scaling is not None:  # 4.x reads the scaling from here (and 5.x prefers it)
        config["rope_scaling"] = dict(cfg.rope_scaling)
    return config


# -------------------------------------------------------------------------------- names


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {  # HF name inside a block -> meshloom name inside a block
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight",
              "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
_TO_HF = {v: k for k, v in _LAYER_NAMES.items()}
_TOP_TO_HF = {v: k for k, v in _TOP_NAMES.items()}


def meshloom_name(hf_name: str) -> str | None:
    """The meshloom parameter an HF tensor is, or None for a buffer to skip (old checkpoints
    stored each layer's RoPE ``inv_freq``)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = _LAYER.match(hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    if m and m.group(2).endswith("rotary_emb.inv_freq"):
        return None
    raise ValueError(f"unexpected tensor {hf_name!r} (not a plain LlamaForCausalLM)")


def hf_name(name: str) -> str:
    if name in _TOP_TO_HF:
        return _TOP_TO_HF[name]
    layer, rest = name.removeprefix("layers.").split(".", 1)
    return f"model.layers.{layer}.{_TO_HF[rest]}"


# -------------------------------------------------------------------------------- RoPE rows


def _heads_of(name: str, cfg: LlamaConfig) -> int | None:
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.kv_heads
    return None


def hf_to_meshloom_rows(w: Tensor, heads: int) -> Tensor:
    """HF q/k rows (per head: all first halves, then all second halves) -> Meta's interleaved
    pairs: row c*hd/2 + j of a head moves to row 2j + c."""
    out, d_in = w.shape
    return w.reshape(heads, 2, out // heads // 2, d_in).transpose(1, 2).reshape(out, d_in)


def meshloom_to_hf_rows(w: Tensor, heads: int) -> Tensor:
    """The inverse of ``hf_to_meshloom_rows`` (the permutation of Meta's conversion script)."""
    out, d_in = w.shape
    return w.reshape(heads, out // heads // 2, 2, d_in).transpose(1, 2).reshape(out, d_in)


def to_meshloom(name: str, w: Tensor, cfg: LlamaConfig) -> Tensor:
    """``w``, stored under meshloom ``name`` in an HF checkpoint, in meshloom's layout."""
    heads = _heads_of(name, cfg)
    return w if heads is None else hf_to_meshloom_rows(w, heads)


def to_hf(name: str, w: Tensor, cfg: LlamaConfig) -> Tensor:
    heads = _heads_of(name, cfg)
    return w if heads is None else meshloom_to_hf_rows(w, heads)
