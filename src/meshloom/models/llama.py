"""Reference Llama-3-style decoder, a family of the model contract (models/contract.py).

The model is plain PyTorch on purpose. Strategies never branch inside it; they read the data it
declares (``Llama.TP_PLAN``, ``pieces()``, ``pipeline_cut_points()``, ``fsdp_units()``) and swap
or slice its submodules. That is why every projection is a plain ``nn.Linear`` attribute and the
blocks live in a plain ``nn.ModuleList``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshloom.models.contract import Family, Pieces
from meshloom.models.moe import FeedForward, MoE, MoESettings, moe_problem


class _HeadDim:
    """``LlamaConfig.head_dim``: the width of one attention head. Unset (None) it follows
    ``dim // n_heads``; set, q and k have ``n_heads * head_dim`` features whatever ``dim`` is
    (Qwen3). Reading it always gives the resolved width, so a stored config (dataclasses.asdict)
    holds it explicitly: change it with ``dim`` or ``n_heads`` when replacing those."""

    # A data descriptor wins over the instance's __dict__, so the value as set can live there
    # under the field's own name (vars(cfg) then lists the fields as given).
    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the dataclass field's default
        explicit = obj.__dict__.get("head_dim")
        return obj.dim // obj.n_heads if explicit is None else explicit

    def __set__(self, obj, value) -> None:
        obj.__dict__["head_dim"] = value


@dataclass
class LlamaConfig:
    family: ClassVar[str] = "llama"  # models/families.py

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = 257
    ffn_hidden: int | None = None
    multiple_of: int = 32
    ffn_dim_multiplier: float | None = None
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Long-context RoPE frequency scaling, as in a Hugging Face config's ``rope_scaling``
    # (plain JSON, so checkpoints and weights folders store it as is): None for plain RoPE,
    # {"rope_type": "linear", "factor": F}, or {"rope_type": "llama3", "factor": F,
    # "low_freq_factor": L, "high_freq_factor": H, "original_max_position_embeddings": N}.
    rope_scaling: dict | None = None
    # Options of the variants built on this decoder (models/mistral.py, models/qwen.py); their
    # defaults are Llama's, which they leave unchanged.
    head_dim: int | None = _HeadDim()  # None: dim // n_heads
    attention_bias: bool = False  # a bias on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE, one gain per dim (Qwen3)
    sliding_window: int | None = None  # each query sees the last N keys, itself included (Mistral)
    # Mixture of experts (models/moe.py): n_experts > 0 makes every block's feed-forward a
    # router over n_experts SwiGLU experts of width moe_hidden (default: hidden), top_k per token.
    n_experts: int = 0
    top_k: int = 2
    moe_hidden: int | None = None
    shared_hidden: int = 0  # a shared expert every token goes through (0: none)
    shared_gate: bool = False  # its output times sigmoid(linear(x)) (Qwen2-MoE)
    router_score: str = "softmax"  # "softmax" or "sigmoid"
    router_norm: bool = True  # the top-k weights renormalised to sum to 1
    aux_loss_coef: float = 0.01  # load-balancing loss coefficient (0: none)
    capacity_factor: float | None = None  # None: dropless; else tokens over capacity dropped

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden(self) -> int:
        """SwiGLU width: ``ffn_hidden`` if set, else Meta's rule (2/3 of 4*dim, rounded up)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return -(-hidden // self.multiple_of) * self.multiple_of

    @property
    def explicit_head_dim(self) -> int | None:
        """``head_dim`` as set, None when it follows dim // n_heads."""
        return self.__dict__.get("head_dim")

    @property
    def q_dim(self) -> int:
        """Width of q and of the attention output (equals dim unless head_dim is set apart)."""
        return self.n_heads * self.head_dim

    def moe(self) -> MoESettings | None:
        """The mixture-of-experts settings, None for a dense feed-forward."""
        if not self.n_experts:
            return None
        return MoESettings(n_experts=self.n_experts, top_k=self.top_k,
                           hidden=self.moe_hidden or self.hidden,
                           shared_hidden=self.shared_hidden, shared_gate=self.shared_gate,
                           score=self.router_score, normalize=self.router_norm,
                           aux_loss_coef=self.aux_loss_coef,
                           capacity_factor=self.capacity_factor)

    def _ffn_matmul_params(self, active: bool) -> int:
        """The feed-forward's matmul weights: all of them, or (`active`) those one token uses
        (its top_k experts, the router and the shared expert)."""
        m = self.moe()
        if m is None:
            return 3 * self.dim * self.hidden
        routed = 3 * self.dim * m.hidden * (m.top_k if active else m.n_experts)
        return routed + self.dim * m.n_experts + 3 * self.dim * m.shared_hidden \
            + (self.dim if m.shared_gate else 0)

    def _layer_matmul_params(self, active: bool = True) -> int:
        kv_dim = self.kv_heads * self.head_dim
        return (2 * self.dim * self.q_dim + 2 * self.dim * kv_dim
                + self._ffn_matmul_params(active))

    def _layer_params(self) -> int:
        """Every parameter of one block: matmuls, the two norms, q/k/v biases, q/k norms."""
        n = self._layer_matmul_params(active=False) + 2 * self.dim
        if self.attention_bias:
            n += self.q_dim + 2 * self.kv_heads * self.head_dim
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def attended_keys(self, seq_len: int) -> float:
        """Twice the mean number of keys a query attends to over a sequence of ``seq_len``: the
        whole length under the plain causal mask (the convention below), less under a window
        shorter than it (W keys each, but the first W queries see 1..W)."""
        w = self.sliding_window
        if w is None or w >= seq_len:
            return float(seq_len)
        return 2.0 * w - w * w / seq_len

    def num_params(self, include_embeddings: bool = True) -> int:
        """Exact parameter count of ``Llama(self)``; a tied head is counted once.

        ``include_embeddings=False`` drops the token-embedding table only. An untied output head
        is a real matmul, so it stays counted; a tied one *is* the table, so it goes with it.
        With experts, every expert counts (``active_params`` counts what one token uses).
        """
        n = self.n_layers * self._layer_params() + self.dim
        table = self.vocab_size * self.dim
        if include_embeddings:
            n += table
        if not self.tie_embeddings:
            n += table
        return n

    def active_params(self) -> int:
        """Parameters one token's forward uses: as num_params, but top_k routed experts per
        block instead of all of them (equal to num_params for a dense model)."""
        routed_idle = 0
        m = self.moe()
        if m is not None:
            routed_idle = 3 * self.dim * m.hidden * (m.n_experts - m.top_k) * self.n_layers
        return self.num_params() - routed_idle

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward = 3x forward) per token at context ``seq_len``.

        ``6 * N + 6 * n_layers * seq_len * dim`` where N counts every matmul weight: all block
        projections plus the output head (tied or not: the head matmul runs either way). Norms and
        the embedding lookup are not matmuls and are ignored. The second term is attention: QK^T
        and AV cost 2*s*d multiply-adds per token per layer = 4*s*d forward FLOPs, 12*L*s*d for
        training without a mask (PaLM's convention); we halve it to 6*L*s*d for the causal mask.
        With head_dim set apart, d there is the width of q (n_heads * head_dim); with a sliding
        window shorter than the sequence, s is ``attended_keys(s)`` (the pairs really attended).
        """
        # Halved because causal kernels (flash/SDPA) skip the masked upper triangle, so this is
        # the work actually done; MFU from PaLM's unhalved 12*L*s*d would flatter long contexts.
        matmul = self.n_layers * self._layer_matmul_params() + self.vocab_size * self.dim
        return 6.0 * matmul + 6.0 * self.n_layers * self.attended_keys(seq_len) * self.q_dim

    def layer_costs(self, seq_len: int) -> tuple[list[float], float]:
        """Training FLOPs per token of each block, and of the head (its matmul over the
        vocabulary); they add up to ``flops_per_token(seq_len)``."""
        block = 6.0 * self._layer_matmul_params() + 6.0 * self.attended_keys(seq_len) * self.q_dim
        return [block] * self.n_layers, 6.0 * self.vocab_size * self.dim

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        for name in ("n_kv_heads", "ffn_hidden", "ffn_dim_multiplier", "head_dim",
                     "sliding_window"):
            value = self.explicit_head_dim if name == "head_dim" else getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"model.{name}={value} must be positive (or unset)")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        problem = moe_problem(self.n_experts, self.top_k, self.router_score,
                              self.capacity_factor, self.aux_loss_coef)
        if problem:
            raise ValueError(problem)
        for name in ("moe_hidden",):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive (or unset)")
        if self.shared_hidden < 0:
            raise ValueError(f"model.shared_hidden={self.shared_hidden} must be >= 0")
        for name in ("attention_bias", "qk_norm", "shared_gate", "router_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be true or false")
        if self.explicit_head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be divisible by "
                             f"model.n_kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            source = ("model.head_dim" if self.explicit_head_dim is not None else
                      f"model.dim={self.dim} / model.n_heads={self.n_heads} gives head_dim")
            raise ValueError(f"{source}={self.head_dim}, which must be even for RoPE")
        problem = rope_scaling_problem(self.rope_scaling)
        if problem:
            raise ValueError(f"model.rope_scaling: {problem}")

    def layout_problem(self, dims, seq_len: int) -> str | None:
        """Why this model cannot train exactly in the layout ``dims`` (a mesh.ParallelDims) at
        ``seq_len`` tokens, as one line; or None. validation.layout_problem asks it."""
        w = self.sliding_window
        if dims.cp > 1 and w is not None and w < seq_len:
            return (f"model.sliding_window={w} is shorter than data.seq_len={seq_len}: context "
                    f"parallel (parallel.cp={dims.cp}) runs full causal ring attention and "
                    "cannot apply the window; use parallel.cp=1 or a window >= data.seq_len")
        return None


# The keys each supported RoPE scaling type needs besides "rope_type"; all are positive numbers.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def rope_scaling_problem(scaling: dict | None) -> str | None:
    """Why ``scaling`` is not a RoPE scaling meshloom implements (None if it is, or is None)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        return f"{scaling!r} is not a table"
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        return (f"rope_type={kind!r} is not supported (supported: "
                f"{', '.join(ROPE_SCALING_KEYS)})")
    keys = ROPE_SCALING_KEYS[kind]
    for key in keys:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            return f"{kind} needs {key} > 0, got {value!r}"
    extra = sorted(set(scaling) - {"rope_type", *keys})
    if extra:
        return f"unknown key {extra[0]!r} for rope_type={kind!r}"
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        return "llama3 needs high_freq_factor > low_freq_factor"
    return None


_LLAMA3 = dict(n_kv_heads=8, vocab_size=128256, rope_theta=500000.0, max_seq_len=8192)

PRESETS: dict[str, dict] = {
    "tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=257, max_seq_len=256),
    "demo": dict(dim=128, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=257, max_seq_len=512),
    "small": dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, vocab_size=257, max_seq_len=1024),
    "llama3-1b": dict(_LLAMA3, dim=2048, n_layers=16, n_heads=32, ffn_hidden=8192,
                      tie_embeddings=True),
    "llama3-8b": dict(_LLAMA3, dim=4096, n_layers=32, n_heads=32, ffn_hidden=14336),
    "llama3-70b": dict(_LLAMA3, dim=8192, n_layers=80, n_heads=64, ffn_hidden=28672),
    "llama3-405b": dict(_LLAMA3, dim=16384, n_layers=126, n_heads=128, ffn_hidden=53248),
}


def config_from_preset(name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    known = {f.name for f in fields(LlamaConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown model config field(s) {unknown}; known: {sorted(known)}")
    cfg = LlamaConfig(**{**PRESETS[name], **overrides})
    cfg.validate()
    return cfg


def llama3_frequencies(freqs: Tensor, factor: float, low_freq_factor: float,
                       high_freq_factor: float, original_max_position_embeddings: int) -> Tensor:
    """Llama 3.1's long-context adjustment of RoPE inverse frequencies ``freqs``.

    With wavelength w = 2*pi/f and N = original_max_position_embeddings: a pair whose
    wavelength is shorter than N / high_freq_factor turns many times within the original
    context and keeps f; one longer than N / low_freq_factor gets f / factor (it is stretched,
    as by linear scaling); in between, f blends from one to the other as N / w falls from
    high_freq_factor to low_freq_factor: s = (N / w - low) / (high - low),
    f' = (1 - s) * f / factor + s * f.
    """
    old = original_max_position_embeddings
    wavelength = 2 * math.pi / freqs
    s = (old / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - s) * freqs / factor + s * freqs
    out = torch.where(wavelength > old / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelength < old / high_freq_factor, freqs, out)


def rope_frequencies(cfg: LlamaConfig) -> Tensor:
    """float64 [head_dim // 2]: the inverse frequency of each rotating pair,
    theta^(-2j/head_dim), adjusted by ``cfg.rope_scaling`` when set."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
    freqs = cfg.rope_theta ** -exponents
    scaling = cfg.rope_scaling
    if scaling is None:
        return freqs
    if scaling["rope_type"] == "linear":  # positions divided by factor: so is every frequency
        return freqs / scaling["factor"]
    # The llama3 keys are llama3_frequencies' parameter names.
    return llama3_frequencies(freqs, **{k: scaling[k] for k in ROPE_SCALING_KEYS["llama3"]})


def _rope_table(cfg: LlamaConfig, device: torch.device) -> Tensor:
    """complex64 [max_seq_len, head_dim // 2]: e^{i * pos * f_j}, f_j from ``rope_frequencies``
    (theta^(-2j/head_dim) without scaling)."""
    shape = (cfg.max_seq_len, cfg.head_dim // 2)
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.complex64, device=device)
    # float64 on CPU: angles reach max_seq_len radians, where fp32 phase error is visible.
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64),
                         rope_frequencies(cfg))
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate ``x`` [b, s, heads, head_dim] by ``rope`` (from ``Llama.rope``), in fp32.

    Interleaved form: dims (2j, 2j+1) are one rotating pair, the layout of Meta's reference
    code, so its checkpoints load without permuting wq/wk.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = rope[..., 0], rope[..., 1]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim, self.sliding_window = cfg.head_dim, cfg.sliding_window
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, q_dim, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=cfg.attention_bias)
        self.wo = nn.Linear(q_dim, cfg.dim, bias=False)
        # One gain per dim of a head, shared by every head (no class-level default: a class
        # attribute would hide the submodule, which nn.Module keeps outside __dict__).
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, rope: Tensor, cache: LayerKV | None = None) -> Tensor:
        # Head counts come from the projected shapes, never from the config: a tensor-parallel
        # rewrite that keeps a slice of the heads in wq/wk/wv (and wo's columns) runs unchanged.
        q = self.wq(x).unflatten(-1, (-1, self.head_dim))
        k = self.wk(x).unflatten(-1, (-1, self.head_dim))
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is None:
            out = self.core(q, k, v)
        else:  # incremental decoding: attend over every token cached so far
            out = cached_attention(q, *cache.append(k, v), window=self.sliding_window)
        return self.wo(out.transpose(1, 2).flatten(2))

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of q [b, h, s, d] over k, v [b, h_kv, s, d], within the sliding
        window if there is one. Context parallel replaces it (per module) with ring attention
        over the cp ranks' sequence slices (validation refuses a window shorter than them)."""
        return causal_attention(q, k, v, self.sliding_window)


def visible_keys(s: int, t: int, window: int | None, device: torch.device) -> Tensor:
    """bool [s, t]: which of t keys each of the last s queries sees. Query i sits at position
    p = t - s + i and sees keys p - window < j <= p (all j <= p without a window)."""
    pos = torch.arange(t - s, t, device=device).unsqueeze(1)
    keys = torch.arange(t, device=device)
    mask = keys <= pos
    if window is not None:
        mask &= keys > pos - window
    return mask


def causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """Causal attention of q [b, h, s, d] over k, v [b, h_kv, s, d]; with ``window``, query i
    sees keys i - window < j <= i only (Mistral's sliding window)."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        # Explicit repeat rather than enable_gqa: every SDPA backend (and torch 2.4) accepts it.
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    s = q.shape[2]
    if window is None or window >= s:  # the window covers every causal key
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = visible_keys(s, s, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class LayerKV:
    """One block's cached keys and values, [b, kv_heads, max_len, head_dim] each, filled up to
    ``length``. The buffers are allocated on the first ``append`` with the shape and dtype of
    the keys written, so a tensor-parallel rank caches only its own heads without knowing it."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [b, kv_heads, s, head_dim] after the cached tokens; return all of them."""
        if self.k is None:
            b, heads, _, dim = k.shape
            self.k = k.new_empty(b, heads, self.max_len, dim)
            self.v = v.new_empty(b, heads, self.max_len, dim)
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {self.length} cached + {k.shape[2]} new tokens "
                             f"exceed its {self.max_len}")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Per-block keys and values of every token seen so far, for incremental decoding
    (``Llama.new_cache``). Preallocated to ``max_len`` so a decode step copies one token's
    K/V per layer, never the whole history."""

    def __init__(self, n_layers: int, max_len: int):
        self.max_len = max_len
        self.layers = [LayerKV(max_len) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def next_positions(self, n: int, device: torch.device) -> Tensor:
        """Absolute positions of the next ``n`` tokens; ValueError if they do not fit."""
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache full: {self.length} cached + {n} new tokens exceed "
                             f"its {self.max_len}")
        return torch.arange(self.length, self.length + n, device=device)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """Attention of the newest s tokens, q [b, h, s, d], over all t cached ones, k, v
    [b, h_kv, t, d] (the queries are the last s of them): query i sees keys 0 .. t - s + i
    (with ``window``, only the last ``window`` of those)."""
    b, h, s, d = q.shape
    h_kv, t = k.shape[1], k.shape[2]
    if s == t:  # the prefill: exactly the training path's causal attention
        return causal_attention(q, k, v, window)
    # A decode step (s = 1, or a few tokens): fold each KV head's group of query heads into
    # query rows instead of repeating the whole cached K/V for every query head.
    q = q.reshape(b, h_kv, (h // h_kv) * s, d)
    mask = None
    if s > 1 or (window is not None and window < t):
        # Row r * s + i is query i of some head: the same row of the mask for every head.
        mask = visible_keys(s, t, window, q.device).repeat(h // h_kv, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(b, h, s, d)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        moe = cfg.moe()
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden) if moe is None else \
            MoE(cfg.dim, moe)

    def forward(self, x: Tensor, rope: Tensor, cache: LayerKV | None = None) -> Tensor:
        # Without a cache the attention gets exactly (x, rope): module-input hooks (torch's
        # tensor-parallel PrepareModuleInput, in the DTensor benchmark) count the inputs.
        a = self.attention(self.attention_norm(x), rope) if cache is None else \
            self.attention(self.attention_norm(x), rope, cache=cache)
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    # Module-name pattern -> tensor-parallel style (see parallel/tensor_plan.py). Attention and
    # MLP each enter their region once ("input"); q/k/v and w1/w3 split heads and hidden width.
    TP_PLAN: ClassVar[dict[str, str]] = {
        "tok_embeddings": "vocab",
        "layers.*.attention": "input",
        "layers.*.feed_forward": "input",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "layers.*.attention_norm": "sequence",
        "layers.*.ffn_norm": "sequence",
        "norm": "sequence",
        "output": "colwise_vocab",
    }

    # With cfg.qk_norm: each tp rank applies the q/k norms to its own heads (see __init__).
    QK_NORM_PLAN: ClassVar[dict[str, str]] = {
        "layers.*.attention.q_norm": "head_shared",
        "layers.*.attention.k_norm": "head_shared",
    }

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.qk_norm:  # this model's plan: the class's, plus the modules only it has
            self.TP_PLAN = {**Llama.TP_PLAN, **Llama.QK_NORM_PLAN}
        if cfg.n_experts:  # experts are whole on every tp rank: the MoE runs replicated
            self.TP_PLAN = {k: v for k, v in self.TP_PLAN.items()
                            if not k.startswith("layers.*.feed_forward")}
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # A tied head's own weight is thrown away at once, so don't allocate it.
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False,
                                device="meta" if cfg.tie_embeddings else None)
        self.tie_weights()
        # complex64, not cos/sin floats: model.to(bfloat16) casts float buffers but leaves
        # complex ones alone, so the table keeps full precision in low-precision models.
        self.register_buffer("freqs_cis", _rope_table(cfg, torch.get_default_device()),
                             persistent=False)

    def tie_weights(self) -> None:
        """(Re-)share the head with the embedding; ``to_empty()`` silently unties them."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def reset_rope(self) -> None:
        """Recompute the RoPE table in place (needed after ``to_empty()``; no-op on meta)."""
        self.freqs_cis = _rope_table(self.cfg, self.freqs_cis.device)

    # -- the model contract (models/contract.py)

    @property
    def hidden_size(self) -> int:
        return self.cfg.dim

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def pieces(self) -> Pieces:
        tied = ("tok_embeddings.weight", "output.weight") if self.cfg.tie_embeddings else None
        return Pieces(input=("tok_embeddings",), blocks="layers", output=("norm", "output"),
                      state=("freqs_cis",), tied=tied, attention="layers.*.attention")

    def embed(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        return self.tok_embeddings(tokens)  # positions enter through RoPE, in the blocks

    def block_context(self, seq_len: int, positions: Tensor | None = None) -> tuple[Tensor]:
        return (Llama.rope(self, seq_len, positions),)

    def head(self, h: Tensor) -> Tensor:
        return self.output(self.norm(h))

    def layer_costs(self, seq_len: int) -> tuple[list[float], float]:
        return self.cfg.layer_costs(seq_len)

    def flops_per_token(self, seq_len: int) -> float:
        return self.cfg.flops_per_token(seq_len)

    def init_tensor(self, name: str, shape: Sequence[int], seed: int) -> Tensor:
        return init_tensor(name, shape, self.cfg, seed)

    def rope(self, seq_len: int, positions: Tensor | None = None) -> Tensor:
        """fp32 (cos, sin) for the blocks: [s, 1, head_dim // 2, 2] ([b, s, ...] for 2-D positions).

        Reads only ``freqs_cis`` and ``cfg``, so a pipeline stage that holds only some blocks
        can run it on itself (``block_context``).
        """
        if positions is None:
            if seq_len > self.freqs_cis.shape[0]:
                raise ValueError(
                    f"sequence length {seq_len} exceeds model.max_seq_len={self.cfg.max_seq_len}"
                )
            freqs = self.freqs_cis[:seq_len]
        else:
            freqs = self.freqs_cis[positions]
        return torch.view_as_real(freqs).unsqueeze(-3)

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                cache: KVCache | None = None) -> Tensor:
        """tokens [b, s] -> logits [b, s, vocab]. ``positions`` (int64 [s] or [b, s], each below
        max_seq_len; default arange(s)) are absolute positions, e.g. of a context-parallel chunk.

        With ``cache`` (from ``new_cache``), ``tokens`` continue the ones already cached: their
        positions follow on, their keys and values are appended to the cache, and they attend
        to every cached token (prefill once with the prompt, then one token per call).
        """
        if cache is not None:
            if positions is not None:
                raise ValueError("with a KV cache the positions follow from the cache")
            positions = cache.next_positions(tokens.shape[1], tokens.device)
        context = self.block_context(tokens.shape[1], positions)
        h = self.embed(tokens, positions)
        if cache is None:
            for layer in self.layers:
                h = layer(h, *context)
        else:
            for layer, kv in zip(self.layers, cache.layers, strict=True):
                h = layer(h, *context, kv)
        return self.head(h)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache for up to ``max_len`` tokens (default and limit: max_seq_len)."""
        max_len = self.cfg.max_seq_len if max_len is None else max_len
        if not 0 < max_len <= self.cfg.max_seq_len:
            raise ValueError(f"KV cache of {max_len} tokens: must be 1..model.max_seq_len="
                             f"{self.cfg.max_seq_len}")
        return KVCache(len(self.layers), max_len)

    def pipeline_cut_points(self) -> list[str]:
        """Blocks the model may be cut between; embedding precedes the first, norm+output follow."""
        return [f"layers.{i}" for i in range(len(self.layers))]

    def fsdp_units(self) -> list[str]:
        """Submodule names to shard as units, innermost first; ``""`` is the root module.

        The root unit owns whatever no earlier unit claimed: ``norm`` and ``output`` (and, with
        tied embeddings, the shared table, since one parameter can belong to only one unit).
        ``model.get_submodule(name)`` resolves every entry, the root included.
        """
        embed = [] if self.cfg.tie_embeddings else ["tok_embeddings"]
        return embed + self.pipeline_cut_points() + [""]


_BIASES = ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias")
_RESIDUAL_OUT = ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.experts.w2",
                 "feed_forward.shared.w2.weight")
_PLAIN = ("tok_embeddings.weight", "output.weight", "attention.wq.weight", "attention.wk.weight",
          "attention.wv.weight", "feed_forward.w1.weight", "feed_forward.w3.weight",
          "feed_forward.router.weight", "feed_forward.experts.w1", "feed_forward.experts.w3",
          "feed_forward.shared.w1.weight", "feed_forward.shared.w3.weight",
          "feed_forward.shared_gate.weight")
# Segments that wrappers (activation checkpointing, torch.compile, FSDP1) insert into names.
_WRAPPER_SEGMENTS = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def param_seed(seed: int, name: str) -> int:
    """32-bit generator seed of one parameter.

    crc32 is linear, so whether two names of equal length collide does not depend on ``seed``:
    checking the names once (the tests do, for 1000 layers) covers every seed.
    """
    return zlib.crc32(f"{seed}:{name}".encode())


def init_tensor(name: str, shape: Sequence[int], cfg: LlamaConfig, seed: int) -> Tensor:
    """The full fp32 CPU initial value of the parameter with canonical name ``name``.

    Sharded strategies call this with the global shape and keep their slice; drawing on CPU keeps
    values identical whatever device the parameter finally lives on.
    """
    if name.endswith("norm.weight"):  # the q/k norms' too
        return torch.ones(tuple(shape))
    if name.endswith(_BIASES):
        return torch.zeros(tuple(shape))
    if name.endswith(_RESIDUAL_OUT):
        # 2*n_layers branches add into the residual stream; shrinking their outputs keeps the
        # stream's variance at init from growing with depth (the GPT-2 scheme).
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    elif name.endswith(_PLAIN):
        std = cfg.init_std
    else:
        raise ValueError(f"no init rule for parameter {name!r}")
    # crc32, not hash(): Python salts str hashes per process, and every rank must agree. The CPU
    # generator keeps only 32 seed bits, so seed and name are hashed together into 32 bits.
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(tuple(shape)).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """Initialise every materialised parameter from its own (seed, name)-seeded generator.

    Embedding, q/k/v, w1/w3 and an untied head: normal(0, init_std); wo and w2: normal(0,
    init_std / sqrt(2 * n_layers)); norms (the q/k norms too): ones; q/k/v biases: zeros.
    Meta parameters are skipped, so a process holding any subset gets the same values as one
    holding them all. A tied head is initialised once, under the embedding's name. Also
    recomputes the RoPE table.
    """
    for name, param in model.named_parameters():
        if not param.is_meta:
            param.copy_(init_tensor(canonical_name(name), param.shape, model.cfg, seed))
    model.reset_rope()


def build_model(
    cfg: LlamaConfig, seed: int, device: str | torch.device = "cpu", dtype=torch.float32
) -> Llama:
    """Validate, construct without allocating, materialise on ``device`` and initialise."""
    cfg.validate()
    device = torch.device(device)
    with torch.device("meta"):
        model = Llama(cfg).to(dtype)
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, seed)
    return model


FAMILY = Family(name="llama", config=LlamaConfig, build=build_model, presets=PRESETS,
                hf="meshloom.models.llama_hf", hf_model_types=("llama",))
