"""Hugging Face Llama checkpoints (``config.json`` + safetensors) <-> meshloom's ``Llama``.

Reading and writing only; nothing here imports transformers, so a conversion needs no more than
``safetensors``. Only safetensors weights are read: a pickled ``pytorch_model.bin`` can run code
when loaded, so it is refused.

Two things differ between the layouts besides the names:
- RoPE pairing. meshloom's ``apply_rope`` rotates dims (2j, 2j+1) of each head together (Meta's
  layout); transformers' ``rotate_half`` rotates dim j with dim j + head_dim/2. Meta's own
  conversion script therefore permutes the rows of wq and wk within each head; we apply that
  permutation (or its inverse) so that both models compute the same q.k products.
- A tied output head is not stored on either side: it *is* the embedding table.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from meshloom.models.llama import ROPE_SCALING_KEYS, LlamaConfig, rope_scaling_problem

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"


class HFCheckpointError(ValueError):
    """An HF folder that cannot be read or written; the message is one line naming it."""


# -------------------------------------------------------------------------------- config


def _rope_tables(raw: dict) -> tuple[dict, dict]:
    """(rope_parameters, rope_scaling) of a config, each {} when absent or null."""
    tables = []
    for key in ("rope_parameters", "rope_scaling"):
        table = raw.get(key) or {}
        if not isinstance(table, dict):
            raise HFCheckpointError(f"{key}={table!r} is not a table")
        if table.get("partial_rotary_factor", 1.0) != 1.0:
            raise HFCheckpointError(f"{key}.partial_rotary_factor is not supported")
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
        raise HFCheckpointError(f"{key}.rope_type={kind!r} is not supported (meshloom "
                                f"implements default, {', '.join(ROPE_SCALING_KEYS)})")
    # Only the keys the type uses: transformers ignores any others too (with a warning).
    ours = {"rope_type": kind, **{k: table.get(k) for k in ROPE_SCALING_KEYS[kind]}}
    problem = rope_scaling_problem(ours)
    if problem:
        raise HFCheckpointError(f"{key}: {problem}")
    return theta, ours


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "vocab_size")


def read_hf_config(folder: str | Path) -> LlamaConfig:
    """The meshloom ``LlamaConfig`` of an HF Llama folder; refuses what meshloom cannot run."""
    path = Path(folder) / CONFIG
    if not Path(folder).is_dir():
        raise HFCheckpointError(f"{folder}: no such folder")
    if not path.is_file():
        raise HFCheckpointError(f"{folder}: no {CONFIG} (not a Hugging Face model folder)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{path}: not a model config (a JSON object)")

    def refuse(what: str) -> HFCheckpointError:
        return HFCheckpointError(f"{path}: {what}")

    if raw.get("model_type") != "llama":
        raise refuse(f"model_type={raw.get('model_type')!r} is not supported (only 'llama')")
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if archs != ["LlamaForCausalLM"]:
        raise refuse(f"architectures={archs} is not supported (only LlamaForCausalLM)")
    missing = [k for k in _REQUIRED if not isinstance(raw.get(k), int)]
    if missing:
        raise refuse(f"{missing[0]} is missing or not an integer")
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False),
                           ("mlp_bias", False), ("quantization_config", None)):
        if raw.get(key, supported) != supported:
            raise refuse(f"{key}={raw[key]!r} is not supported (meshloom's Llama has "
                         f"{key}={supported!r})")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // max(heads, 1)
    if head_dim * heads != raw["hidden_size"]:
        raise refuse(f"head_dim={head_dim} x num_attention_heads={heads} != hidden_size="
                     f"{raw['hidden_size']} is not supported")
    try:
        theta, scaling = _rope(raw)
    except HFCheckpointError as e:
        raise refuse(str(e)) from None
    cfg = LlamaConfig(
        dim=raw["hidden_size"], n_layers=raw["num_hidden_layers"], n_heads=heads,
        n_kv_heads=raw.get("num_key_value_heads") or heads, vocab_size=raw["vocab_size"],
        ffn_hidden=raw["intermediate_size"],
        max_seq_len=raw.get("max_position_embeddings", 2048), rope_theta=theta,
        rope_scaling=scaling,
        # transformers' LlamaConfig defaults, not meshloom's, for keys a config leaves out.
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)))
    try:
        cfg.validate()
    except ValueError as e:
        raise refuse(str(e)) from None
    return cfg


def hf_config_dict(cfg: LlamaConfig, dtype: torch.dtype, eos_token_id: int | None = None) -> dict:
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
    raise HFCheckpointError(f"unexpected tensor {hf_name!r} (not a plain LlamaForCausalLM)")


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


# -------------------------------------------------------------------------------- files


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of an HF folder: ``model.safetensors``, or the shards its index
    names."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise HFCheckpointError(f"{index} names {f.name}, which is missing")
        return files
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise HFCheckpointError(f"{folder}: only safetensors weights are read (pickled .bin/.pt "
                                "files can run code when loaded); re-save the model with "
                                "save_pretrained(..., safe_serialization=True)")
    raise HFCheckpointError(f"{folder}: no {SINGLE} or {INDEX}")


def require_safetensors() -> None:
    """A one-line error instead of an ImportError when the optional package is missing."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise HFCheckpointError("reading or writing Hugging Face weights needs the safetensors "
                                "package: pip install 'meshloom[hf]'") from None


def open_safetensors(path: Path):
    """``safe_open`` with a one-line error for a file that is not safetensors."""
    require_safetensors()
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - the Rust side raises its own error types
        raise HFCheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def iter_hf_weights(folder: str | Path, cfg: LlamaConfig) -> Iterator[tuple[str, Tensor]]:
    """(meshloom name, tensor in meshloom's layout) for every weight of an HF folder, one tensor
    in memory at a time. Checks names and shapes against ``cfg``; a tied head found in the file
    is skipped (it is the embedding)."""
    from meshloom.models.llama import Llama

    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters()}
    seen = set()
    for path in weight_files(folder):
        with open_safetensors(path) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                name = meshloom_name(key)
                if name is None or (name == "output.weight" and cfg.tie_embeddings):
                    continue
                if name not in expected:
                    raise HFCheckpointError(f"{path.name}: tensor {key!r} does not fit the "
                                            f"config ({cfg.n_layers} layers)")
                w = f.get_tensor(key)
                if tuple(w.shape) != expected[name]:
                    raise HFCheckpointError(f"{path.name}: {key} has shape {tuple(w.shape)}, "
                                            f"the config implies {expected[name]}")
                seen.add(name)
                yield name, to_meshloom(name, w, cfg)
    missing = sorted(set(expected) - seen)
    if missing:
        raise HFCheckpointError(f"{folder}: {len(missing)} weight(s) missing, e.g. "
                                f"{hf_name(missing[0])!r}")


def write_hf_folder(folder: str | Path, cfg: LlamaConfig, weights: dict[str, Tensor], *,
                    max_shard_bytes: int, eos_token_id: int | None = None) -> list[Path]:
    """Write ``config.json`` and safetensors of meshloom ``weights`` (meshloom names and layout)
    into an existing ``folder``: one ``model.safetensors`` if it fits ``max_shard_bytes``, else
    ``model-0000i-of-0000n.safetensors`` shards and their index. Returns the weight files."""
    require_safetensors()
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {}
    for name in sorted(weights, key=_hf_order):
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        tensors[hf_name(name)] = to_hf(name, weights[name], cfg).contiguous()
    dtype = next(iter(tensors.values())).dtype
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:  # a too-big tensor gets its own shard
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    meta = {"format": "pt"}  # transformers checks this key
    if len(shards) == 1:
        files = [folder / SINGLE]
        save_file(shards[0], str(files[0]), metadata=meta)
    else:
        files = [folder / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
        for f, shard in zip(files, shards, strict=True):
            save_file(shard, str(f), metadata=meta)
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in tensors.values())},
                 "weight_map": {k: f.name for f, s in zip(files, shards, strict=True) for k in s}}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = hf_config_dict(cfg, dtype, eos_token_id)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return files


def _hf_order(name: str) -> tuple[int, int, str]:
    """Embedding, blocks in order, then norm and head: a shard then holds neighbouring layers."""
    if name.startswith("layers."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("tok_") else 2, 0, name)
