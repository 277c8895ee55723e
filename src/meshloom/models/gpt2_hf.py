"""Hugging Face's GPT-2 format (``GPT2LMHeadModel``) <-> meshloom's ``GPT2`` (models/gpt2.py);
models/hf_checkpoint.py does the file reading and writing.

Two layout differences: HF's projections are ``Conv1D`` modules, whose weight is [in, out] (the
transpose of nn.Linear's), and its attention input projection ``c_attn`` is q, k and v
concatenated along the output features. meshloom keeps q, k and v apart (tensor parallel splits
each by heads), so ``c_attn`` is read as three tensors and written back as one: the folder's
names are not one-to-one with ours, which ``read_tensors`` / ``write_tensors`` handle.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from meshloom.models.gpt2 import GPT2Config

# -------------------------------------------------------------------------------- config

_REQUIRED = ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions")
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh approximation


def config_from_hf(raw: dict) -> GPT2Config:
    """The ``GPT2Config`` of an HF GPT-2 ``config.json``; ValueError (one line) for what
    meshloom cannot run."""
    archs = raw.get("architectures") or ["GPT2LMHeadModel"]
    if archs != ["GPT2LMHeadModel"]:
        raise ValueError(f"architectures={archs} is not supported (only GPT2LMHeadModel)")
    missing = [k for k in _REQUIRED if not isinstance(raw.get(k), int)]
    if missing:
        raise ValueError(f"{missing[0]} is missing or not an integer")
    act = raw.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ValueError(f"activation_function={act!r} is not supported (meshloom's GPT-2 uses "
                         f"the tanh GELU: {', '.join(_ACTIVATIONS)})")
    for key, supported in (("add_cross_attention", False), ("scale_attn_weights", True),
                           ("scale_attn_by_inverse_layer_idx", False),
                           ("reorder_and_upcast_attn", False), ("quantization_config", None)):
        if raw.get(key, supported) != supported:
            raise ValueError(f"{key}={raw[key]!r} is not supported (meshloom's GPT-2 has "
                             f"{key}={supported!r})")
    drops = {raw.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(drops) > 1:
        raise ValueError(f"resid_pdrop, embd_pdrop and attn_pdrop differ ({sorted(drops)}); "
                         "meshloom's GPT-2 has one model.dropout")
    cfg = GPT2Config(
        dim=raw["n_embd"], n_layers=raw["n_layer"], n_heads=raw["n_head"],
        vocab_size=raw["vocab_size"], max_seq_len=raw["n_positions"],
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        init_std=float(raw.get("initializer_range", 0.02)),
        ffn_hidden=raw.get("n_inner"),
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        dropout=float(drops.pop()))
    cfg.validate()
    return cfg


def hf_config(cfg: GPT2Config, dtype: torch.dtype, eos_token_id: int | None = None) -> dict:
    """``config.json`` for ``cfg``, readable by transformers 4.x and 5.x."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_embd": cfg.dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_hidden, "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std,
        "activation_function": "gelu_new", "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "add_cross_attention": False,
        "bos_token_id": None, "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# -------------------------------------------------------------------------------- names

_LAYER = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)$")
_LAYER_NAMES = {  # HF name inside a block -> meshloom name inside a block (one to one)
    "ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
    "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
    "attn.c_proj.weight": "attn.o_proj.weight", "attn.c_proj.bias": "attn.o_proj.bias",
    "mlp.c_fc.weight": "mlp.fc.weight", "mlp.c_fc.bias": "mlp.fc.bias",
    "mlp.c_proj.weight": "mlp.proj.weight", "mlp.c_proj.bias": "mlp.proj.bias",
}
_QKV = ("q_proj", "k_proj", "v_proj")
_TOP_NAMES = {"transformer.wte.weight": "wte.weight", "transformer.wpe.weight": "wpe.weight",
              "transformer.ln_f.weight": "ln_f.weight", "transformer.ln_f.bias": "ln_f.bias",
              "lm_head.weight": "output.weight"}
# Old checkpoints (the original "gpt2" upload) have no "transformer." prefix.
_TOP_NAMES.update({k.removeprefix("transformer."): v for k, v in list(_TOP_NAMES.items())})
_TO_HF = {v: k for k, v in _LAYER_NAMES.items()}
_TOP_TO_HF = {v: k for k, v in _TOP_NAMES.items() if k.startswith(("transformer.", "lm_"))}
# Causal-mask buffers that older transformers saved with the weights.
_BUFFERS = ("attn.bias", "attn.masked_bias")


def hf_name(name: str) -> str:
    """The HF tensor that holds meshloom parameter ``name`` (q, k and v share c_attn)."""
    if name in _TOP_TO_HF:
        return _TOP_TO_HF[name]
    layer, rest = name.removeprefix("layers.").split(".", 1)
    attn = rest.split(".")
    if len(attn) == 3 and attn[0] == "attn" and attn[1] in _QKV:
        return f"transformer.h.{layer}.attn.c_attn.{attn[2]}"
    return f"transformer.h.{layer}.{_TO_HF[rest]}"


def split_hf(hf: str, w: Tensor, cfg: GPT2Config) -> list[tuple[str, Tensor]]:
    """(meshloom name, tensor in meshloom's layout) for one HF tensor: none for a buffer to
    skip, three for c_attn; ValueError for a tensor a plain GPT2LMHeadModel has not."""
    if hf in _TOP_NAMES:
        return [(_TOP_NAMES[hf], w)]
    m = _LAYER.match(hf)
    if not m:
        raise ValueError(f"unexpected tensor {hf!r} (not a plain GPT2LMHeadModel)")
    layer, rest = m.group(1), m.group(2)
    if rest in _BUFFERS:
        return []
    if rest in ("attn.c_attn.weight", "attn.c_attn.bias"):
        kind = rest.rsplit(".", 1)[1]
        # Conv1D weight [dim, 3 * dim]: q | k | v along the output features (dim -1).
        parts = w.chunk(3, dim=-1)
        return [(f"layers.{layer}.attn.{p}.{kind}", (t.t() if kind == "weight" else t)
                 .contiguous()) for p, t in zip(_QKV, parts, strict=True)]
    if rest not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {hf!r} (not a plain GPT2LMHeadModel)")
    ours = f"layers.{layer}.{_LAYER_NAMES[rest]}"
    conv = rest.endswith(".weight") and not rest.startswith("ln_")
    return [(ours, w.t().contiguous() if conv else w)]


def join_hf(named: dict[str, Tensor], cfg: GPT2Config) -> dict[str, Tensor]:
    """HF tensors from meshloom's (name -> tensor, all of them): Conv1D weights transposed,
    q/k/v concatenated into c_attn."""
    out: dict[str, Tensor | None] = {}  # in the order of `named` (a shard holds neighbours)
    pending: dict[str, dict[str, Tensor]] = {}
    for name, w in named.items():
        hf = hf_name(name)
        conv = name.endswith(".weight") and name.startswith("layers.") and ".ln_" not in name
        w = w.t().contiguous() if conv else w
        if ".c_attn." in hf:
            pending.setdefault(hf, {})[name.split(".")[-2]] = w
            out.setdefault(hf, None)
        else:
            out[hf] = w
    for hf, parts in pending.items():
        out[hf] = torch.cat([parts[p] for p in _QKV], dim=-1)
    return out
