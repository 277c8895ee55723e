"""Hugging Face's ``MixtralForCausalLM`` <-> meshloom's Mixtral (models/mixtral.py): the config
mapping and the tensor names; models/hf_checkpoint.py reads and writes the files.

The attention, norms, embedding and head are Mistral's, so their names and the RoPE row
permutation of wq/wk are models/llama_hf.py's, imported from there. The feed-forward differs:

- the router ``block_sparse_moe.gate.weight`` [E, dim] is ``feed_forward.router.weight``;
- each expert's ``block_sparse_moe.experts.{e}.w1|w2|w3.weight`` (gate, down, up: nn.Linear's
  [out, in], as meshloom's) is slice e of the stacked ``feed_forward.experts.w1|w2|w3``
  [E, ...]. That is the layout transformers writes to disk, 5.x included: it fuses the experts
  into ``gate_up_proj`` / ``down_proj`` in memory only, converting on load and save.

Routing is the same maths on both sides (softmax over the experts in fp32, top-k, weights
renormalised over the chosen ones), so the logits agree. The load-balancing loss is meshloom's,
per sequence (models/moe.py); only its coefficient, ``router_aux_loss_coef``, is carried over.
"""

from __future__ import annotations

import re

import torch

from meshloom.models import llama_hf
from meshloom.models.hf_checkpoint import HFCheckpointError
from meshloom.models.llama_hf import to_hf, to_meshloom  # noqa: F401 - the format's hooks
from meshloom.models.mixtral import MixtralConfig

ARCH = "MixtralForCausalLM"

# transformers' MixtralConfig defaults, for keys a config.json leaves out.
_DEFAULTS = {"num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
             "router_aux_loss_coef": 0.001, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
             "max_position_embeddings": 4096 * 32, "sliding_window": None}

# Options of transformers' Mixtral that meshloom's does not have, and the one value it runs.
# Jitter and dropout act in training only, but training is what meshloom does with the model.
_FIXED = (("hidden_act", "silu"), ("router_jitter_noise", 0.0), ("attention_dropout", 0.0),
          ("quantization_config", None))

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "vocab_size")

# -------------------------------------------------------------------------------- config


def _int(raw: dict, key: str) -> int:
    value = raw.get(key, _DEFAULTS.get(key))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{key}={value!r} must be a positive integer")
    return value


def config_from_hf(raw: dict) -> MixtralConfig:
    """The meshloom Mixtral config of an HF ``config.json``; ValueError (one line) for what
    meshloom cannot run."""
    archs = raw.get("architectures") or [ARCH]
    if archs != [ARCH]:
        raise ValueError(f"architectures={archs} is not supported (only {ARCH} for "
                         "model_type='mixtral')")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{missing[0]} is missing")
    for key, supported in _FIXED:
        if raw.get(key, supported) != supported:
            raise ValueError(f"{key}={raw[key]!r} is not supported (meshloom's mixtral has "
                             f"{key}={supported!r})")
    dims = {k: _int(raw, k) for k in (*_REQUIRED, "num_local_experts", "num_experts_per_tok")}
    heads, experts, top_k = (dims["num_attention_heads"], dims["num_local_experts"],
                             dims["num_experts_per_tok"])
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be at most "
                         f"num_local_experts={experts}")
    kv = raw.get("num_key_value_heads", _DEFAULTS["num_key_value_heads"])
    kv = heads if kv is None else _int({"num_key_value_heads": kv}, "num_key_value_heads")
    head_dim = raw.get("head_dim")  # null: hidden_size / heads
    if head_dim is not None:
        head_dim = _int(raw, "head_dim")
    window = raw.get("sliding_window", _DEFAULTS["sliding_window"])
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"sliding_window={window!r} must be a positive integer or null")
    coef = raw.get("router_aux_loss_coef", _DEFAULTS["router_aux_loss_coef"])
    if not isinstance(coef, (int, float)) or not coef >= 0:
        raise ValueError(f"router_aux_loss_coef={coef!r} must be a number >= 0")
    # Mixtral's RoPE base defaults to 1e6, not Llama's 1e4.
    theta, scaling = llama_hf._rope({"rope_theta": _DEFAULTS["rope_theta"], **raw})
    cfg = MixtralConfig(
        dim=dims["hidden_size"], n_layers=dims["num_hidden_layers"], n_heads=heads,
        n_kv_heads=kv, vocab_size=dims["vocab_size"],
        max_seq_len=_int(raw, "max_position_embeddings"),
        rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(raw.get("rms_norm_eps", _DEFAULTS["rms_norm_eps"])),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Stored only when it differs from dim / n_heads, as a meshloom config would have it.
        head_dim=None if head_dim is None or head_dim * heads == dims["hidden_size"]
        else head_dim,
        sliding_window=window, n_experts=experts, top_k=top_k,
        moe_hidden=dims["intermediate_size"], aux_loss_coef=float(coef))
    cfg.validate()
    return cfg


def _export_problem(cfg: MixtralConfig) -> str | None:
    """The first option of ``cfg`` that transformers' Mixtral cannot express, as one line."""
    if not cfg.n_experts:
        return (f"model.n_experts=0 has no {ARCH} form (a dense model: export it as the "
                "mistral family)")
    for key, fixed in (("attention_bias", False), ("qk_norm", False), ("shared_hidden", 0),
                       ("shared_gate", False), ("router_score", "softmax"),
                       ("router_norm", True), ("capacity_factor", None)):
        if getattr(cfg, key) != fixed:
            return (f"model.{key}={getattr(cfg, key)!r} has no {ARCH} form (it has "
                    f"{key}={fixed!r}{': it drops no token' if key == 'capacity_factor' else ''})")
    return None


def hf_config(cfg: MixtralConfig, dtype: torch.dtype, eos_token_id: int | None = None) -> dict:
    """``config.json`` for ``cfg``, readable by transformers 4.x and 5.x."""
    problem = _export_problem(cfg)
    if problem:
        raise HFCheckpointError(problem)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    config = {
        "architectures": [ARCH], "model_type": "mixtral",
        "hidden_size": cfg.dim, "intermediate_size": cfg.moe().hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "sliding_window": cfg.sliding_window,
        "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.aux_loss_coef, "router_jitter_noise": 0.0,
        "attention_dropout": 0.0,
        # Both RoPE spellings: 4.x reads rope_theta, 5.x rope_parameters.
        "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "bos_token_id": None, "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.rope_scaling is not None:  # 4.x reads the scaling from here (and 5.x prefers it)
        config["rope_scaling"] = dict(cfg.rope_scaling)
    return config


# -------------------------------------------------------------------------------- names

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# What a Mixtral block shares with a Mistral one (llama_hf maps these names).
_SHARED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
           "self_attn.o_proj.weight", "input_layernorm.weight",
           "post_attention_layernorm.weight")
_ROUTER = ("block_sparse_moe.gate.weight", "feed_forward.router.weight")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_STACKED = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")


def meshloom_name(hf_name: str) -> str | None:
    """The meshloom parameter an HF tensor is (an expert's matrix: ``stacked_part``), or None
    for a buffer to skip (old checkpoints stored each layer's RoPE ``inv_freq``)."""
    m = _LAYER.match(hf_name)
    rest = m.group(2) if m else None
    if rest == _ROUTER[0]:
        return f"layers.{m.group(1)}.{_ROUTER[1]}"
    if not m or rest in _SHARED or rest.endswith("rotary_emb.inv_freq"):
        try:
            return llama_hf.meshloom_name(hf_name)
        except ValueError:
            pass
    raise ValueError(f"unexpected tensor {hf_name!r} (not a plain {ARCH})")


def stacked_part(hf_name: str) -> tuple[str, int] | None:
    """(meshloom name, expert) for one expert's matrix: slice e of the stacked weight."""
    m = _EXPERT.match(hf_name)
    if m is None:
        return None
    layer, expert, w = m.groups()
    return f"layers.{layer}.feed_forward.experts.{w}", int(expert)


def stacked_hf_names(name: str, n: int) -> list[str] | None:
    """The HF names of the ``n`` experts' slices of a stacked meshloom weight (else None)."""
    m = _STACKED.match(name)
    if m is None:
        return None
    layer, w = m.groups()
    return [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" for e in range(n)]


def hf_name(name: str) -> str:
    if name.endswith(_ROUTER[1]):
        layer = name.removeprefix("layers.").split(".", 1)[0]
        return f"model.layers.{layer}.{_ROUTER[0]}"
    return llama_hf.hf_name(name)
