"""Hugging Face's Llama-layout formats <-> meshloom's ``Llama`` decoder: the config mapping, the
tensor names and the one layout difference (models/hf_checkpoint.py does the file reading and
writing for every family).

One module for four architectures that share the decoder and differ only in options of it
(``_ARCHS``): ``LlamaForCausalLM`` (family llama), ``MistralForCausalLM`` (mistral: a sliding
window), ``Qwen2ForCausalLM`` (qwen2: q/k/v biases) and ``Qwen3ForCausalLM`` (qwen3: q/k norms and
a head width of its own). A config is read into the family that ``model_type`` names and written
back as that family's architecture; an option the architecture cannot express is refused.

RoPE pairing: meshloom's ``apply_rope`` rotates dims (2j, 2j+1) of each head together (Meta's
layout); transformers' ``rotate_half`` rotates dim j with dim j + head_dim/2. Meta's own
conversion script therefore permutes the rows of wq and wk within each head; we apply that
permutation (or its inverse) so that both models compute the same q.k products. The q/k biases
(Qwen2) follow their rows; the q/k norm gains (Qwen3) are one head's worth of dims, permuted the
same way within that head (an RMSNorm's mean of squares does not depend on the order of dims).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from meshloom.models.hf_checkpoint import HFCheckpointError
from meshloom.models.llama import ROPE_SCALING_KEYS, LlamaConfig, rope_scaling_problem
from meshloom.models.mistral import MistralConfig
from meshloom.models.qwen import Qwen2Config, Qwen3Config


@dataclass(frozen=True)
class _Arch:
    """What one HF architecture fixes of the decoder's options."""

    config: type  # the meshloom config class (and so the family) it reads into
    name: str  # its ``architectures`` entry
    bias: bool  # q/k/v biases (no architecture here has one on o)
    qk_norm: bool
    window: bool  # reads and writes ``sliding_window`` (applied to every layer)


_ARCHS = {
    "llama": _Arch(LlamaConfig, "LlamaForCausalLM", bias=False, qk_norm=False, window=False),
    "mistral": _Arch(MistralConfig, "MistralForCausalLM", bias=False, qk_norm=False,
                     window=True),
    "qwen2": _Arch(Qwen2Config, "Qwen2ForCausalLM", bias=True, qk_norm=False, window=False),
    "qwen3": _Arch(Qwen3Config, "Qwen3ForCausalLM", bias=False, qk_norm=True, window=False),
}

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


def _arch_of(raw: dict) -> tuple[str, _Arch]:
    model_type = raw.get("model_type") or "llama"
    if model_type not in _ARCHS:
        raise ValueError(f"model_type={model_type!r} is not supported (supported: "
                         f"{', '.join(_ARCHS)})")
    return model_type, _ARCHS[model_type]


def _check_options(raw: dict, model_type: str) -> None:
    """Refuse, in one line, the settings of these architectures that meshloom does not run."""
    family = _ARCHS[model_type].config.family
    fixed = [("hidden_act", "silu"), ("mlp_bias", False), ("quantization_config", None)]
    if model_type in ("llama", "qwen3"):  # a bias on q, k, v and o alike: o has none here
        fixed.append(("attention_bias", False))
    if model_type in ("qwen2", "qwen3"):  # a window on the upper layers only
        fixed.append(("use_sliding_window", False))
    for key, supported in fixed:
        if raw.get(key, supported) != supported:
            raise ValueError(f"{key}={raw[key]!r} is not supported (meshloom's {family} has "
                             f"{key}={supported!r})")
    kinds = set(raw.get("layer_types") or ()) - {"full_attention"}
    if kinds and model_type != "mistral":  # transformers' Mistral ignores layer_types
        raise ValueError(f"layer_types with {sorted(kinds)[0]!r} is not supported (meshloom's "
                         f"{family} gives every layer full attention)")


def config_from_hf(raw: dict) -> LlamaConfig:
    """The meshloom config (of the family ``model_type`` names: llama, mistral, qwen2, qwen3)
    of an HF ``config.json``; ValueError (one line) for what meshloom cannot run."""
    model_type, arch = _arch_of(raw)
    archs = raw.get("architectures") or [arch.name]
    if archs != [arch.name]:
        raise ValueError(f"architectures={archs} is not supported (only {arch.name} for "
                         f"model_type={model_type!r})")
    missing = [k for k in _REQUIRED if not isinstance(raw.get(k), int)]
    if missing:
        raise ValueError(f"{missing[0]} is missing or not an integer")
    _check_options(raw, model_type)
    heads = raw["num_attention_heads"]
    # transformers' Qwen3Config defaults head_dim to 128; the others to hidden / heads.
    head_dim = raw.get("head_dim") or (128 if model_type == "qwen3" else
                                       raw["hidden_size"] // max(heads, 1))
    if not isinstance(head_dim, int):
        raise ValueError(f"head_dim={head_dim!r} is not an integer")
    window = None
    if arch.window:  # transformers' MistralConfig defaults it to 4096
        window = raw.get("sliding_window", 4096)
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ValueError(f"sliding_window={window!r} must be a positive integer or null")
    theta, scaling = _rope(raw)
    cfg = arch.config(
        dim=raw["hidden_size"], n_layers=raw["num_hidden_layers"], n_heads=heads,
        n_kv_heads=raw.get("num_key_value_heads") or heads, vocab_size=raw["vocab_size"],
        ffn_hidden=raw["intermediate_size"],
        max_seq_len=raw.get("max_position_embeddings", 2048), rope_theta=theta,
        rope_scaling=scaling,
        # transformers' LlamaConfig defaults, not meshloom's, for keys a config leaves out.
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Stored only when it differs from dim / n_heads, as a meshloom config would have it.
        head_dim=None if head_dim * heads == raw["hidden_size"] else head_dim,
        attention_bias=arch.bias, qk_norm=arch.qk_norm, sliding_window=window)
    cfg.validate()
    return cfg


def _model_type(cfg: LlamaConfig) -> str:
    """The HF model_type of ``cfg``'s family; HFCheckpointError if that architecture cannot
    express one of its options."""
    model_type = next(t for t, a in _ARCHS.items() if a.config.family == type(cfg).family)
    arch = _ARCHS[model_type]
    for key, fixed in (("attention_bias", arch.bias), ("qk_norm", arch.qk_norm)):
        if getattr(cfg, key) != fixed:
            raise HFCheckpointError(f"model.{key}={getattr(cfg, key)} has no {arch.name} form "
                                    f"(it has {key}={fixed})")
    if cfg.sliding_window is not None and not arch.window:
        raise HFCheckpointError(f"model.sliding_window={cfg.sliding_window} has no "
                                f"{arch.name} form (only Mistral's applies one to every layer)")
    if cfg.n_experts:
        raise HFCheckpointError(f"model.n_experts={cfg.n_experts} has no {arch.name} form "
                                "(a mixture of experts: use the mixtral family)")
    return model_type


def _option_keys(model_type: str, cfg: LlamaConfig) -> dict:
    """The keys by which each architecture states the decoder options it has."""
    if model_type == "llama":
        return {"attention_bias": False, "mlp_bias": False}
    if model_type == "mistral":
        return {"sliding_window": cfg.sliding_window}
    keys = {"use_sliding_window": False, "sliding_window": None}  # qwen2 and qwen3
    return keys if model_type == "qwen2" else {"attention_bias": False, **keys}


def hf_config(cfg: LlamaConfig, dtype: torch.dtype, eos_token_id: int | None = None) -> dict:
    """``config.json`` for ``cfg``, readable by transformers 4.x and 5.x."""
    model_type = _model_type(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    config = {
        "architectures": [_ARCHS[model_type].name], "model_type": model_type,
        "hidden_size": cfg.dim, "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", **_option_keys(model_type, cfg),
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
    "self_attn.q_proj.bias": "attention.wq.bias",  # qwen2
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",  # qwen3
    "self_attn.k_norm.weight": "attention.k_norm.weight",
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
    raise ValueError(f"unexpected tensor {hf_name!r} (not a plain "
                     f"{', '.join(a.name for a in _ARCHS.values())})")


def hf_name(name: str) -> str:
    if name in _TOP_TO_HF:
        return _TOP_TO_HF[name]
    layer, rest = name.removeprefix("layers.").split(".", 1)
    return f"model.layers.{layer}.{_TO_HF[rest]}"


# -------------------------------------------------------------------------------- RoPE rows


def _heads_of(name: str, cfg: LlamaConfig) -> int | None:
    """How many heads' rows ``name`` holds, if RoPE's pairing orders them (else None)."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return cfg.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return cfg.kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1  # one gain per dim of a head, shared by all of them
    return None


def hf_to_meshloom_rows(w: Tensor, heads: int) -> Tensor:
    """HF q/k rows (per head: all first halves, then all second halves) -> Meta's interleaved
    pairs: row c*hd/2 + j of a head moves to row 2j + c. ``w`` is a weight [rows, d_in] or a
    vector [rows] (a bias, a norm gain)."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, out // heads // 2, *rest).transpose(1, 2).reshape(out, *rest)


def meshloom_to_hf_rows(w: Tensor, heads: int) -> Tensor:
    """The inverse of ``hf_to_meshloom_rows`` (the permutation of Meta's conversion script)."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, out // heads // 2, 2, *rest).transpose(1, 2).reshape(out, *rest)


def to_meshloom(name: str, w: Tensor, cfg: LlamaConfig) -> Tensor:
    """``w``, stored under meshloom ``name`` in an HF checkpoint, in meshloom's layout."""
    heads = _heads_of(name, cfg)
    return w if heads is None else hf_to_meshloom_rows(w, heads)


def to_hf(name: str, w: Tensor, cfg: LlamaConfig) -> Tensor:
    heads = _heads_of(name, cfg)
    return w if heads is None else meshloom_to_hf_rows(w, heads)
