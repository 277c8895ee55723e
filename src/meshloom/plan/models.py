"""Architecture numbers of a transformer, the input every planner cost formula starts from.

A layout's memory and speed depend only on a handful of shape numbers (hidden width, depth, head
counts, MLP width, vocabulary, whether the head is tied), not on the weights. This module turns a
preset name, a Hugging Face ``config.json`` or explicit dimensions into one ``ModelShape`` and
counts its parameters exactly, so the planner never builds a model to size it.

Two block families are modelled:

* ``"gpt"``: the GPT-2 / Megatron-LM block. LayerNorm with bias, biases in every linear, a 4h
  GeLU MLP (two matrices), learned position embeddings, output head tied to the token table.
  Its options cover the GPT-style blocks built like it (a two-matrix MLP, LayerNorm): grouped-
  query attention (``kv_heads`` < ``heads``; Starcoder2, Nemotron-4), no linear biases
  (``linear_bias`` false; Nemotron-4), RoPE in place of the position table (``positions`` 0),
  a head width set apart from hidden / heads (``explicit_head_dim``; Minitron 8B), a sliding
  window on every layer (``sliding_window``; Starcoder2) and any width of MLP. The MLP's
  activation (GeLU, squared ReLU) changes no count here. meshloom builds only the GPT-2 form
  (``is_gpt2_block``: every head its own k and v, biases, a position table, no window); the
  others are planned with Korthikanti et al.'s per-tensor activation count.
* ``"llama"``: the Llama block as in ``meshloom.models.llama``. RMSNorm, no biases, SwiGLU MLP of
  width ``ffn_hidden`` (three matrices), grouped-query attention with ``kv_heads``, RoPE (so no
  position table), head tied or not. Its options cover the families built on it
  (models/mistral.py, models/qwen.py): q/k/v biases (``qkv_bias``, Qwen2), per-head q/k norms
  (``qk_norm``, Qwen3), a head width set apart from hidden / heads (``explicit_head_dim``,
  Qwen3) and a sliding window (Mistral; no parameters, but context parallel refuses it).

Either block may be a mixture of experts (``n_experts`` > 0, models/moe.py, models/mixtral.py):
the feed-forward is a router (h x E) over ``n_experts`` SwiGLU experts of width ``moe_hidden``,
``top_k`` of them per token, plus an optional shared expert (``shared_hidden``, its gate
``shared_gate``); the router's scores are softmax or sigmoid (``router_score``) and its top-k
weights renormalised or not (``router_norm``), which changes only what it keeps for backward.
``params`` then counts every expert, ``active_params`` what one token uses;
``layer_matmul_params`` (what FLOPs scale with) counts the active experts only.
``moe_imbalance`` is the planner's allowance for routing imbalance: the busiest expert rank gets
that many times the mean number of tokens (plan/moe.py).

The parameter counts are exact for every option; the activation and time formulas (memory.py,
compute.py) take q and the attention output at their own width, ``q_dim`` (wider than
``hidden`` in Qwen3 and Minitron 8B).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, astuple, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from meshloom.models import families as _families
from meshloom.models import llama as _llama
from meshloom.plan import PlanError

ARCHS = ("gpt", "llama")
DEFAULT_IMBALANCE = 1.25  # the busiest expert rank's tokens over the mean (docs/plan.md)
# HF model types whose parameter layout is exactly one of ours (with the llama options).
_HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")
_HF_GPT_TYPES = ("gpt2", "nemotron", "starcoder2")


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder-only transformer; every count below is exact for its ``arch``."""

    name: str
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    tied: bool
    positions: int  # rows of the learned position table (0 for llama: RoPE has none)
    # The llama options (qkv_bias and qk_norm off for gpt): see the module's docstring.
    explicit_head_dim: int | None = None  # None: hidden // heads
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Mixture of experts (0 experts: a dense feed-forward of width ffn_hidden).
    n_experts: int = 0
    top_k: int = 0
    moe_hidden: int = 0
    shared_hidden: int = 0
    shared_gate: bool = False
    # Router (models/moe.py): softmax or sigmoid scores; top-k weights renormalised or not.
    router_score: str = "softmax"
    router_norm: bool = True
    moe_imbalance: float = DEFAULT_IMBALANCE
    # Routing options the layout rules read (parallel/expert.py: per-sequence terms refuse cp).
    aux_loss_coef: float = 0.0
    capacity_factor: float | None = None
    # Dropout in training (GPT's embedding, attention and residual dropout keep 1-byte masks).
    # None: the arch's usual recipe (GPT-2 and Megatron's GPT use 0.1; Llama none).
    dropout: bool | None = None
    # Biases on a gpt block's four linears (None: the arch's own, gpt's on). Llama's q/k/v
    # biases are ``qkv_bias``.
    linear_bias: bool | None = None
    # A gpt block without a position table rotates q and k (RoPE) unless it biases its
    # attention scores instead (ALiBi: ``rotary`` false; BLOOM). None: RoPE exactly when there
    # is no position table (llama: always).
    rotary: bool | None = None

    # Shapes key the planner's caches (stage splits, layer costs) hundreds of thousands of times
    # in one search: the field tuple is built once, and a shape is equal to itself at once. The
    # hash itself is not kept: string hashes differ between processes, and a pickled shape would
    # carry its maker's.
    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields == other._fields

    def __hash__(self) -> int:
        return hash(self._fields)

    @cached_property
    def _fields(self) -> tuple:
        return astuple(self)

    def __post_init__(self) -> None:
        # Checked here so that every way of building a shape (preset, HF file, flags) is covered.
        if self.arch not in ARCHS:
            raise PlanError(f"model {self.name!r}: unknown arch {self.arch!r}; "
                            f"choose one of: {', '.join(ARCHS)}")
        for field in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab"):
            value = getattr(self, field)
            if not _is_int(value) or value <= 0:
                raise PlanError(f"model {self.name!r}: {field}={value!r} must be a positive "
                                "integer")
        if not _is_int(self.positions) or self.positions < 0:
            raise PlanError(f"model {self.name!r}: positions={self.positions!r} must be a "
                            "non-negative integer")
        if not isinstance(self.tied, bool):
            raise PlanError(f"model {self.name!r}: tied={self.tied!r} must be true or false")
        for field in ("explicit_head_dim", "sliding_window"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or value <= 0):
                raise PlanError(f"model {self.name!r}: {field}={value!r} must be a positive "
                                "integer (or unset)")
        for field in ("qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, field), bool):
                raise PlanError(f"model {self.name!r}: {field}={getattr(self, field)!r} must be "
                                "true or false")
        if self.explicit_head_dim is None and self.hidden % self.heads:
            raise PlanError(f"model {self.name!r}: hidden={self.hidden} is not divisible by "
                            f"heads={self.heads}")
        if self.heads % self.kv_heads:
            raise PlanError(f"model {self.name!r}: heads={self.heads} is not divisible by "
                            f"kv_heads={self.kv_heads}")
        if self.linear_bias is not None and not isinstance(self.linear_bias, bool):
            raise PlanError(f"model {self.name!r}: linear_bias={self.linear_bias!r} must be true "
                            "or false (or unset)")
        if self.rotary is not None and not isinstance(self.rotary, bool):
            raise PlanError(f"model {self.name!r}: rotary={self.rotary!r} must be true or false "
                            "(or unset)")
        if self.rotary is not None and self.rotary != (not self.positions) \
                and (self.arch == "llama" or self.rotary):
            raise PlanError(f"model {self.name!r}: rotary={self.rotary} does not fit "
                            f"positions={self.positions} (RoPE replaces the position table; "
                            "only a gpt block without one may leave it out, for ALiBi)")
        if self.arch == "llama" and self.linear_bias:
            raise PlanError(f"model {self.name!r}: llama blocks take qkv_bias, not linear_bias")
        if self.arch == "gpt" and (self.qkv_bias or self.qk_norm):
            raise PlanError(f"model {self.name!r}: gpt blocks take linear_bias, not the llama "
                            "options qkv_bias and qk_norm")
        self._check_moe()
        if self.arch == "llama" and self.positions:
            raise PlanError(f"model {self.name!r}: llama uses RoPE and has no position table; "
                            f"positions={self.positions} must be 0")

    def _check_moe(self) -> None:
        for field in ("n_experts", "top_k", "moe_hidden", "shared_hidden"):
            value = getattr(self, field)
            if not _is_int(value) or value < 0:
                raise PlanError(f"model {self.name!r}: {field}={value!r} must be a non-negative "
                                "integer")
        if not self.n_experts:
            if self.top_k or self.moe_hidden or self.shared_hidden or self.shared_gate \
                    or self.aux_loss_coef or self.capacity_factor is not None \
                    or (self.router_score, self.router_norm) != ("softmax", True):
                raise PlanError(f"model {self.name!r}: top_k, moe_hidden, shared_hidden, "
                                "shared_gate, router_score, router_norm, aux_loss_coef and "
                                "capacity_factor need n_experts > 0")
            return
        if self.arch != "llama":
            raise PlanError(f"model {self.name!r}: experts are modelled on llama blocks only")
        if not 1 <= self.top_k <= self.n_experts:
            raise PlanError(f"model {self.name!r}: top_k={self.top_k} must be between 1 and "
                            f"n_experts={self.n_experts}")
        if self.moe_hidden < 1:
            raise PlanError(f"model {self.name!r}: moe_hidden={self.moe_hidden} must be "
                            "positive")
        for flag in ("shared_gate", "router_norm"):
            if not isinstance(getattr(self, flag), bool):
                raise PlanError(f"model {self.name!r}: {flag}={getattr(self, flag)!r} must be "
                                "true or false")
        if self.router_score not in ("softmax", "sigmoid"):
            raise PlanError(f"model {self.name!r}: router_score={self.router_score!r} must be "
                            "'softmax' or 'sigmoid'")
        if isinstance(self.moe_imbalance, bool) or not isinstance(
                self.moe_imbalance, (int, float)) or not self.moe_imbalance >= 1.0:
            raise PlanError(f"model {self.name!r}: moe_imbalance={self.moe_imbalance!r} must be "
                            "a number >= 1 (the busiest expert rank's load over the mean)")

    @cached_property
    def has_dropout(self) -> bool:
        return self.arch == "gpt" if self.dropout is None else self.dropout

    @cached_property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @cached_property
    def has_rope(self) -> bool:
        return not self.positions if self.rotary is None else self.rotary

    @cached_property
    def has_linear_bias(self) -> bool:
        return self.arch == "gpt" if self.linear_bias is None else self.linear_bias

    @cached_property
    def is_gpt2_block(self) -> bool:
        """A gpt shape meshloom's GPT-2 (models/gpt2.py) builds: every head with its own k and
        v of width hidden / heads, biased linears, a learned position table, full attention."""
        return self.arch == "gpt" and self.kv_heads == self.heads and self.has_linear_bias \
            and self.positions > 0 and self.explicit_head_dim is None \
            and self.sliding_window is None

    @cached_property
    def expert_layer_params(self) -> int:
        """The routed experts' weights of one block (all of them; expert parallel splits these
        over ep). 0 for a dense block."""
        return 3 * self.hidden * self.moe_hidden * self.n_experts

    @cached_property
    def moe_dense_ffn_params(self) -> int:
        """An MoE block's feed-forward weights other than the routed experts: the router, the
        shared expert and its gate (every token uses them)."""
        if not self.is_moe:
            return 0
        h = self.hidden
        return h * self.n_experts + 3 * h * self.shared_hidden + (h if self.shared_gate else 0)

    @cached_property
    def attention_matmul_params(self) -> int:
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim

    @cached_property
    def tp_split_params(self) -> int:
        """The block's weights tensor parallel splits over tp: all matrices of a dense block;
        of an MoE block only attention's (the router, shared expert and experts stay whole on
        each tp rank in meshloom's first expert-parallel version)."""
        return self.attention_matmul_params if self.is_moe else self.layer_matmul_params

    @cached_property
    def head_dim(self) -> int:
        return self.hidden // self.heads if self.explicit_head_dim is None else \
            self.explicit_head_dim

    @cached_property
    def q_dim(self) -> int:
        """Width of q and of the attention output (hidden unless the head width is its own)."""
        return self.heads * self.head_dim

    @cached_property
    def kv_dim(self) -> int:
        """Width of the k and v projections (smaller than hidden under grouped-query attention)."""
        return self.kv_heads * self.head_dim

    @cached_property
    def layer_matmul_params(self) -> int:
        """Weight-matrix entries of one block (q, k, v, o and the MLP): what FLOPs scale with.
        With experts: the router, the shared expert and top_k routed experts (the active ones)."""
        h, f = self.hidden, self.ffn_hidden
        if self.arch == "gpt":
            return 2 * h * self.q_dim + 2 * h * self.kv_dim + 2 * h * f
        if self.is_moe:
            return (self.attention_matmul_params + self.moe_dense_ffn_params
                    + 3 * h * self.moe_hidden * self.top_k)
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * f

    @cached_property
    def layer_params(self) -> int:
        """Every parameter of one block, norms and biases included: what memory scales with."""
        h, f = self.hidden, self.ffn_hidden
        if self.arch == "gpt":
            # qkv, proj, fc1, fc2
            biases = self.q_dim + 2 * self.kv_dim + h + f + h if self.has_linear_bias else 0
            norms = 2 * 2 * h  # two LayerNorms, weight and bias each
            return self.layer_matmul_params + biases + norms
        n = self.layer_matmul_params + 2 * h  # two RMSNorm weights
        if self.is_moe:  # the routed experts no token of this block's average uses
            n += self.expert_layer_params - 3 * h * self.moe_hidden * self.top_k
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:  # one gain per dim of a head, for q and for k
            n += 2 * self.head_dim
        return n

    @cached_property
    def embedding_params(self) -> int:
        """Token table plus learned position table."""
        return (self.vocab + self.positions) * self.hidden

    @cached_property
    def head_params(self) -> int:
        """Output-head weights held separately; a tied head is the token table, counted there."""
        return 0 if self.tied else self.vocab * self.hidden

    @cached_property
    def final_norm_params(self) -> int:
        return 2 * self.hidden if self.arch == "gpt" else self.hidden

    @cached_property
    def params(self) -> int:
        """Total parameter count (a tied head counted once), as ``model.num_parameters()``."""
        return (self.layers * self.layer_params + self.embedding_params + self.head_params
                + self.final_norm_params)

    @cached_property
    def active_params(self) -> int:
        """Parameters one token's forward uses: ``params`` with top_k routed experts per block
        instead of all of them (``LlamaConfig.active_params``)."""
        idle = 3 * self.hidden * self.moe_hidden * (self.n_experts - self.top_k)
        return self.params - self.layers * idle

    def to_dict(self) -> dict[str, Any]:
        """Fields plus the derived counts, for reports and JSON output."""
        out = asdict(self)
        for key in ("head_dim", "q_dim", "kv_dim", "layer_params", "layer_matmul_params",
                    "embedding_params", "head_params", "final_norm_params", "params"):
            out[key] = getattr(self, key)
        moe_keys = ("n_experts", "top_k", "moe_hidden", "shared_hidden", "shared_gate",
                    "router_score", "router_norm", "moe_imbalance", "aux_loss_coef",
                    "capacity_factor")
        if self.is_moe:  # a dense shape's record stays as it was before experts existed
            for key in ("active_params", "expert_layer_params", "moe_dense_ffn_params"):
                out[key] = getattr(self, key)
        else:
            for key in moe_keys:
                del out[key]
        if self.linear_bias is None:  # the arch's own: records stay as they were
            del out["linear_bias"]
        return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def from_dims(
    arch: str,
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    name: str = "custom",
    *,
    positions: int | None = None,
    tied: bool | None = None,
    dropout: bool | None = None,
    linear_bias: bool | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    rotary: bool | None = None,
) -> ModelShape:
    """Shape from explicit dimensions, filling the rest with each family's usual defaults.

    gpt: ffn_hidden 4h, tied head, 2048 learned positions. llama: ffn_hidden by meshloom's
    ``LlamaConfig.hidden`` rule (so plans match the model meshloom would build), untied head.
    ``head_dim`` equal to hidden / heads is the default width and is not kept as an option.
    """
    if arch not in ARCHS:
        raise PlanError(f"unknown arch {arch!r}; choose one of: {', '.join(ARCHS)}")
    if kv_heads is None:
        kv_heads = heads
    if arch == "gpt":
        if ffn_hidden is None and _is_int(hidden):
            ffn_hidden = 4 * hidden
        positions = 2048 if positions is None else positions
        tied = True if tied is None else tied
    else:
        if ffn_hidden is None and _is_int(hidden) and hidden > 0:
            ffn_hidden = _llama.LlamaConfig(dim=hidden).hidden
        positions = 0 if positions is None else positions
        tied = False if tied is None else tied
    if head_dim is not None and _is_int(heads) and head_dim * heads == hidden:
        head_dim = None
    return ModelShape(name=name, arch=arch, hidden=hidden, layers=layers, heads=heads,
                      kv_heads=kv_heads, ffn_hidden=ffn_hidden, vocab=vocab, tied=tied,
                      positions=positions, dropout=dropout, linear_bias=linear_bias,
                      explicit_head_dim=head_dim, sliding_window=sliding_window,
                      qkv_bias=qkv_bias, qk_norm=qk_norm, rotary=rotary)


def from_llama_config(cfg: _llama.LlamaConfig, name: str = "custom") -> ModelShape:
    """The shape of the model meshloom builds from `cfg` (e.g. a run's resolved config): a
    config of the llama family or of one built on its decoder (mistral, qwen2, qwen3)."""
    head_dim = cfg.head_dim if cfg.head_dim * cfg.n_heads != cfg.dim else None
    moe = cfg.moe() if hasattr(cfg, "moe") else None
    experts = {}
    if moe is not None:  # a capacity factor bounds the busiest expert's load exactly
        experts = dict(n_experts=moe.n_experts, top_k=moe.top_k, moe_hidden=moe.hidden,
                       shared_hidden=moe.shared_hidden, shared_gate=moe.shared_gate,
                       router_score=moe.score, router_norm=moe.normalize,
                       moe_imbalance=max(1.0, moe.capacity_factor or DEFAULT_IMBALANCE),
                       aux_loss_coef=moe.aux_loss_coef, capacity_factor=moe.capacity_factor)
    return ModelShape(name=name, arch="llama", hidden=cfg.dim, layers=cfg.n_layers,
                      heads=cfg.n_heads, kv_heads=cfg.kv_heads, ffn_hidden=cfg.hidden,
                      vocab=cfg.vocab_size, tied=cfg.tie_embeddings, positions=0,
                      explicit_head_dim=head_dim, qkv_bias=cfg.attention_bias,
                      qk_norm=cfg.qk_norm, sliding_window=cfg.sliding_window, **experts)


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC'21 (arXiv 2104.04473), Table 1: A100 80GB, vocab 51,200, sequence 2,048.
_TABLE1_ROWS = (
    # name, params_b, heads, hidden, layers, tp, pp, gpus, batch, tflops, pct_peak
    ("megatron-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    ("megatron-3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    ("megatron-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    ("megatron-18.4b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    ("megatron-39.1b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    ("megatron-76.1b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    ("megatron-145.6b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    ("megatron-310.1b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    ("megatron-529.6b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    ("megatron-1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)
_TABLE1_KEYS = ("name", "params_b", "heads", "hidden", "layers", "tp", "pp", "gpus", "batch",
                "tflops", "pct_peak")
MEGATRON_TABLE1: list[dict] = [dict(zip(_TABLE1_KEYS, row, strict=True)) for row in _TABLE1_ROWS]
MEGATRON_VOCAB = 51200
MEGATRON_SEQ = 2048

_GPT2_VOCAB = 50257


def _build_presets() -> dict[str, ModelShape]:
    presets: dict[str, ModelShape] = {}
    for name, hidden, layers, heads in (("gpt2", 768, 12, 12), ("gpt2-medium", 1024, 24, 16),
                                        ("gpt2-large", 1280, 36, 20), ("gpt2-xl", 1600, 48, 25)):
        # meshloom's GPT-2 presets train without dropout (models/gpt2.py); an HF config.json
        # with its *_pdrop at 0.1 plans GPT-2's own recipe.
        presets[name] = from_dims("gpt", hidden, layers, heads, _GPT2_VOCAB, name=name,
                                  positions=1024, dropout=False)
    for name, family in _families.presets().items():  # llama and the families on its decoder
        if issubclass(family.config, _llama.LlamaConfig):
            presets[name] = from_llama_config(_families.config_from_preset(name), name)
    for row in MEGATRON_TABLE1:
        presets[row["name"]] = from_dims("gpt", row["hidden"], row["layers"], row["heads"],
                                         MEGATRON_VOCAB, name=row["name"],
                                         positions=MEGATRON_SEQ)
    return presets


PRESETS: dict[str, ModelShape] = _build_presets()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"cannot read model config {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"invalid JSON in model config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise PlanError(f"model config {path} must hold a JSON object, not "
                        f"{type(data).__name__}")
    return data


def _require(data: dict[str, Any], key: str, path: Path) -> Any:
    if key not in data or data[key] is None:
        raise PlanError(f"model config {path} is missing key {key!r}")
    return data[key]


def from_hf_config(path: str | Path) -> ModelShape:
    """Shape from a Hugging Face ``config.json`` (or a directory holding one).

    Accepts the model types whose parameters we count exactly (llama, mistral, qwen2, qwen3,
    mixtral, gpt2, nemotron, starcoder2) and refuses anything that would be miscounted or that
    meshloom cannot run (e.g. a llama head_dim that does not tile hidden, biased llama
    projections, Qwen's layer-dependent sliding window) rather than guess. Nemotron and
    Starcoder2 are planned, not run: meshloom has no GPT block with grouped-query attention.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise PlanError(f"model config not found: {file}")
    data = _read_json(file)
    name = file.resolve().parent.name or "custom"
    model_type = _require(data, "model_type", file)
    if model_type in _HF_LLAMA_TYPES:
        return _llama_shape(data, file, name, model_type)
    if model_type == "nemotron":
        return _nemotron_shape(data, file, name)
    if model_type == "starcoder2":
        return _starcoder2_shape(data, file, name)
    if model_type in _HF_GPT_TYPES:
        if data.get("add_cross_attention"):
            raise PlanError(f"model config {file}: add_cross_attention=true is not supported")
        hidden = _require(data, "n_embd", file)
        heads = _require(data, "n_head", file)
        inner = data.get("n_inner")
        return ModelShape(
            name=name, arch="gpt", hidden=hidden, layers=_require(data, "n_layer", file),
            heads=heads, kv_heads=heads,
            ffn_hidden=4 * hidden if inner is None and _is_int(hidden) else inner,
            vocab=_require(data, "vocab_size", file),
            tied=bool(data.get("tie_word_embeddings", True)),
            positions=_require(data, "n_positions", file),
            dropout=any(data.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
        )
    supported = ", ".join(_HF_LLAMA_TYPES + _HF_GPT_TYPES)
    raise PlanError(f"unsupported model_type {model_type!r} in {file}; supported: {supported}")


def _nemotron_shape(data: dict[str, Any], file: Path, name: str) -> ModelShape:
    """Nemotron-4 and Minitron (transformers' NemotronConfig): a gpt block with grouped-query
    attention, squared-ReLU two-matrix MLP, LayerNorm (``layernorm1p``, weight and bias), RoPE
    on part of each head, untied head by default, linear biases only if asked for, and a head
    width of its own where ``head_dim`` x heads is not hidden (Minitron 8B: 48 x 128 on 4096)."""
    hidden = _require(data, "hidden_size", file)
    heads = _require(data, "num_attention_heads", file)
    head_dim = data.get("head_dim")
    tiles = head_dim is None or (_is_int(heads) and head_dim * heads == hidden)
    attention_bias, mlp_bias = bool(data.get("attention_bias")), bool(data.get("mlp_bias"))
    if attention_bias != mlp_bias:
        raise PlanError(f"model config {file}: attention_bias={str(attention_bias).lower()} "
                        f"with mlp_bias={str(mlp_bias).lower()} is not supported (biases on "
                        "every linear or on none)")
    kv_heads = data.get("num_key_value_heads")
    return ModelShape(
        name=name, arch="gpt", hidden=hidden, layers=_require(data, "num_hidden_layers", file),
        heads=heads, kv_heads=heads if kv_heads is None else kv_heads,
        ffn_hidden=_require(data, "intermediate_size", file),
        vocab=_require(data, "vocab_size", file),
        tied=bool(data.get("tie_word_embeddings", False)), positions=0,
        dropout=bool(data.get("attention_dropout", 0.0)), linear_bias=attention_bias,
        explicit_head_dim=None if tiles else head_dim,
    )


def _starcoder2_shape(data: dict[str, Any], file: Path, name: str) -> ModelShape:
    """Starcoder2 (transformers' Starcoder2Config): a gpt block with grouped-query attention,
    a two-matrix GeLU MLP, LayerNorm with bias, biases on every linear (``use_bias``), RoPE,
    the head tied by default, and a sliding window on every layer."""
    heads = _require(data, "num_attention_heads", file)
    kv_heads = data.get("num_key_value_heads")
    dropout = any(data.get(k, 0.0) for k in ("attention_dropout", "residual_dropout",
                                               "embedding_dropout"))
    return ModelShape(
        name=name, arch="gpt", hidden=_require(data, "hidden_size", file),
        layers=_require(data, "num_hidden_layers", file), heads=heads,
        kv_heads=heads if kv_heads is None else kv_heads,
        ffn_hidden=_require(data, "intermediate_size", file),
        vocab=_require(data, "vocab_size", file),
        tied=bool(data.get("tie_word_embeddings", True)), positions=0, dropout=dropout,
        linear_bias=bool(data.get("use_bias", True)), sliding_window=data.get("sliding_window"),
    )


def _llama_shape(data: dict[str, Any], file: Path, name: str, model_type: str) -> ModelShape:
    """The shape of a llama, mistral, qwen2, qwen3 or mixtral config.json (transformers' defaults
    for the keys it leaves out)."""
    hidden = _require(data, "hidden_size", file)
    heads = _require(data, "num_attention_heads", file)
    # Qwen3's head width is its own (transformers' default 128); Mistral's may be (Nemo).
    head_dim = data.get("head_dim", 128 if model_type == "qwen3" else None)
    tiles = _is_int(head_dim) and (not _is_int(heads) or head_dim * heads == hidden)
    if head_dim is not None and not tiles and model_type == "llama":
        raise PlanError(f"model config {file}: head_dim={head_dim} x num_attention_heads="
                        f"{heads} != hidden_size={hidden} is not supported")
    refused = ["mlp_bias"]
    if model_type in ("llama", "qwen3"):  # a bias there would sit on o too
        refused.append("attention_bias")
    if model_type in ("qwen2", "qwen3"):  # a window on the upper layers only
        refused.append("use_sliding_window")
    for key in refused:
        if data.get(key):
            raise PlanError(f"model config {file}: {key}=true is not supported (meshloom's "
                            f"{model_type} has none)")
    window = data.get("sliding_window", 4096) if model_type == "mistral" else \
        data.get("sliding_window") if model_type == "mixtral" else None
    kv_heads = data.get("num_key_value_heads")
    experts = {}
    if model_type == "mixtral":  # intermediate_size is each expert's width; no shared expert
        experts = dict(n_experts=data.get("num_local_experts", 8),
                       top_k=data.get("num_experts_per_tok", 2),
                       moe_hidden=_require(data, "intermediate_size", file),
                       aux_loss_coef=data.get("router_aux_loss_coef", 0.001))
    return ModelShape(
        name=name, arch="llama", hidden=hidden,
        layers=_require(data, "num_hidden_layers", file), heads=heads,
        kv_heads=heads if kv_heads is None else kv_heads,
        ffn_hidden=_require(data, "intermediate_size", file),
        vocab=_require(data, "vocab_size", file),
        tied=bool(data.get("tie_word_embeddings", False)), positions=0,
        explicit_head_dim=None if head_dim is None or tiles else head_dim,
        qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3", sliding_window=window,
        **experts,
    )


def resolve_model(spec: str) -> ModelShape:
    """``--model`` value: a preset name, else a path to a config.json or a directory with one."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.exists():
        return from_hf_config(path)
    if path.suffix == ".json" or "/" in spec or "\\" in spec:
        raise PlanError(f"model config not found: {spec}")
    close = difflib.get_close_matches(spec, PRESETS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise PlanError(f"unknown model {spec!r}{hint}; presets: {', '.join(PRESETS)}; "
                    "or give a path to a Hugging Face config.json")
