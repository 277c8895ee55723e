"""GPT-2 (Radford et al. 2019), a family of the model contract (models/contract.py).

Learned token and position tables, pre-LayerNorm blocks (LayerNorm with bias), attention with
separate q/k/v/o projections carrying biases (Hugging Face's fused ``c_attn`` is split on import,
models/gpt2_hf.py, so that tensor parallel can split heads like any other family), a 4x GELU
(tanh approximation, HF's "gelu_new") MLP with biases, a final LayerNorm and a head tied to the
token table by default.

Dropout (embedding, attention probabilities, residual branches) is ``cfg.dropout``, 0.0 by
default: HF's GPT-2 trains with 0.1, but every preset here trains with 0.0 so that the layouts can
be parity-tested (a rank draws its own dropout masks) and because short runs on small data gain
little from it; set ``model.dropout = 0.1`` for HF's recipe. Dropout runs only in training mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshloom.models.contract import Family, Pieces

# The KV cache (one block's keys and values, preallocated) and the attention of new tokens over
# it are the same as Llama's: nothing in them knows about RoPE.
from meshloom.models.llama import KVCache, LayerKV, cached_attention, canonical_name, param_seed


@dataclass
class GPT2Config:
    family: ClassVar[str] = "gpt2"  # models/families.py

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 257
    max_seq_len: int = 256  # rows of the learned position table (HF: n_positions)
    norm_eps: float = 1e-5  # LayerNorm eps (HF: layer_norm_epsilon)
    init_std: float = 0.02  # HF: initializer_range
    ffn_hidden: int | None = None  # None: 4 * dim (HF: n_inner)
    tie_embeddings: bool = True
    dropout: float = 0.0  # HF's resid/embd/attn_pdrop (0.1 there); see the module docstring

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:  # config.ModelDims: GPT-2 has no grouped-query attention
        return self.n_heads

    @property
    def hidden(self) -> int:
        """The MLP width."""
        return 4 * self.dim if self.ffn_hidden is None else self.ffn_hidden

    def _layer_matmul_params(self) -> int:
        return 4 * self.dim * self.dim + 2 * self.dim * self.hidden

    def num_params(self, include_embeddings: bool = True) -> int:
        """Exact parameter count of ``GPT2(self)``; a tied head is counted once.

        ``include_embeddings=False`` drops the token and position tables; an untied head is a
        real matmul and stays counted (as in LlamaConfig.num_params)."""
        d = self.dim
        biases = 4 * d + self.hidden + d  # q, k, v, o; fc; proj
        layer = self._layer_matmul_params() + biases + 2 * 2 * d  # two LayerNorms
        n = self.n_layers * layer + 2 * d  # final LayerNorm
        if include_embeddings:
            n += (self.vocab_size + self.max_seq_len) * d
        if not self.tie_embeddings:
            n += self.vocab_size * d
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at context ``seq_len``: 6 x every matmul weight (blocks and
        the head, tied or not) plus causal attention, 6 * n_layers * seq_len * dim (the
        convention of LlamaConfig.flops_per_token; biases, norms and lookups are ignored)."""
        blocks, head = self.layer_costs(seq_len)
        return sum(blocks) + head

    def layer_costs(self, seq_len: int) -> tuple[list[float], float]:
        """Training FLOPs per token of each block, and of the head."""
        block = 6.0 * self._layer_matmul_params() + 6.0 * seq_len * self.dim
        return [block] * self.n_layers, 6.0 * self.vocab_size * self.dim

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise ValueError(f"model.ffn_hidden={self.ffn_hidden} must be positive (or unset)")
        for name in ("norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")

    def layout_problem(self, dims, seq_len: int) -> str | None:
        """Why this model cannot train as configured in the layout ``dims``, as one line; or
        None (validation.layout_problem asks it)."""
        if dims.cp > 1 and self.dropout > 0:
            return (f"model.dropout={self.dropout:g} with context parallel (parallel.cp="
                    f"{dims.cp}): ring attention applies no attention-probability dropout; "
                    "use parallel.cp=1 or model.dropout=0")
        return None


_GPT2 = dict(vocab_size=50257, max_seq_len=1024)

PRESETS: dict[str, dict] = {
    # Byte vocabulary, CPU-sized: tests and the CPU configs.
    "gpt2-tiny": dict(dim=64, n_layers=4, n_heads=4, vocab_size=257, max_seq_len=256),
    "gpt2-demo": dict(dim=128, n_layers=6, n_heads=4, vocab_size=257, max_seq_len=512),
    # OpenAI's four sizes (124M, 355M, 774M, 1.56B parameters).
    "gpt2": dict(_GPT2, dim=768, n_layers=12, n_heads=12),
    "gpt2-medium": dict(_GPT2, dim=1024, n_layers=24, n_heads=16),
    "gpt2-large": dict(_GPT2, dim=1280, n_layers=36, n_heads=20),
    "gpt2-xl": dict(_GPT2, dim=1600, n_layers=48, n_heads=25),
}


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.attn_dropout = self.resid_dropout = cfg.dropout  # probabilities; output
        self.q_proj = nn.Linear(cfg.dim, cfg.dim)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: Tensor, cache: LayerKV | None = None) -> Tensor:
        # Heads from the projected width: a tensor-parallel rank holds a slice of them.
        q, k, v = (f(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for f in (self.q_proj, self.k_proj, self.v_proj))
        out = self.core(q, k, v) if cache is None else cached_attention(q, *cache.append(k, v))
        out = self.o_proj(out.transpose(1, 2).flatten(2))
        p = self.resid_dropout
        return F.dropout(out, p, self.training) if p else out

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of q, k, v [b, h, s, d]. Context parallel replaces it (per module)
        with ring attention, which applies no attention dropout."""
        p = self.attn_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.resid_dropout = cfg.dropout
        self.fc = nn.Linear(cfg.dim, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: Tensor) -> Tensor:
        out = self.proj(F.gelu(self.fc(x), approximate="tanh"))
        p = self.resid_dropout
        return F.dropout(out, p, self.training) if p else out


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cache: LayerKV | None = None) -> Tensor:
        # Without a cache the attention gets x alone (module-input hooks count the inputs).
        a = self.attn(self.ln_1(x)) if cache is None else self.attn(self.ln_1(x), cache=cache)
        h = x + a
        return h + self.mlp(self.ln_2(h))


class GPT2(nn.Module):
    # Module-name pattern -> tensor-parallel style (parallel/tensor_plan.py). The position table
    # is split like the token table ("vocab", over its rows): with sequence parallel each rank
    # must add the positions of its own slice of the sequence, which only a split lookup that is
    # reduce-scattered along the sequence gives it (Megatron all-reduces and splits instead).
    # Column layers' biases split with their rows; a row layer's bias is added once, after the sum.
    TP_PLAN: ClassVar[dict[str, str]] = {
        "wte": "vocab",
        "wpe": "vocab",
        "layers.*.attn": "input",
        "layers.*.mlp": "input",
        "layers.*.attn.q_proj": "colwise",
        "layers.*.attn.k_proj": "colwise",
        "layers.*.attn.v_proj": "colwise",
        "layers.*.attn.o_proj": "rowwise",
        "layers.*.mlp.fc": "colwise",
        "layers.*.mlp.proj": "rowwise",
        "layers.*.ln_1": "sequence",
        "layers.*.ln_2": "sequence",
        "ln_f": "sequence",
        "output": "colwise_vocab",
    }

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        # A tied head's own weight is thrown away at once, so don't allocate it.
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False,
                                device="meta" if cfg.tie_embeddings else None)
        self.tie_weights()

    def tie_weights(self) -> None:
        """(Re-)share the head with the token table; ``to_empty()`` silently unties them."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.wte.weight

    # -- the model contract (models/contract.py)

    @property
    def hidden_size(self) -> int:
        return self.cfg.dim

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def pieces(self) -> Pieces:
        tied = ("wte.weight", "output.weight") if self.cfg.tie_embeddings else None
        return Pieces(input=("wte", "wpe"), blocks="layers", output=("ln_f", "output"),
                      tied=tied, attention="layers.*.attn")

    def embed(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token plus position embedding; ``positions`` are absolute (a context-parallel chunk's
        own). The lookup takes them in the tokens' shape, so that a split table reduce-scatters
        [b, s, dim] along the sequence like the token table."""
        if positions is None:
            if tokens.shape[1] > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {tokens.shape[1]} exceeds "
                                 f"model.max_seq_len={self.cfg.max_seq_len}")
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions.expand_as(tokens))
        p = self.cfg.dropout
        return F.dropout(h, p, self.training) if p else h

    def block_context(self, seq_len: int, positions: Tensor | None = None) -> tuple:
        return ()  # positions entered with the embedding

    def head(self, h: Tensor) -> Tensor:
        return self.output(self.ln_f(h))

    def layer_costs(self, seq_len: int) -> tuple[list[float], float]:
        return self.cfg.layer_costs(seq_len)

    def flops_per_token(self, seq_len: int) -> float:
        return self.cfg.flops_per_token(seq_len)

    def init_tensor(self, name: str, shape: Sequence[int], seed: int) -> Tensor:
        return init_tensor(name, shape, self.cfg, seed)

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                cache: KVCache | None = None) -> Tensor:
        """tokens [b, s] -> logits [b, s, vocab]. ``positions``: absolute positions (int64 [s]
        or [b, s]; default arange(s)). With ``cache`` (``new_cache``) the tokens continue the
        cached ones, as in Llama.forward."""
        if cache is not None:
            if positions is not None:
                raise ValueError("with a KV cache the positions follow from the cache")
            positions = cache.next_positions(tokens.shape[1], tokens.device)
        h = self.embed(tokens, positions)
        if cache is None:
            for layer in self.layers:
                h = layer(h)
        else:
            for layer, kv in zip(self.layers, cache.layers, strict=True):
                h = layer(h, kv)
        return self.head(h)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache for up to ``max_len`` tokens (default and limit: max_seq_len)."""
        max_len = self.cfg.max_seq_len if max_len is None else max_len
        if not 0 < max_len <= self.cfg.max_seq_len:
            raise ValueError(f"KV cache of {max_len} tokens: must be 1..model.max_seq_len="
                             f"{self.cfg.max_seq_len}")
        return KVCache(len(self.layers), max_len)

    def pipeline_cut_points(self) -> list[str]:
        return [f"layers.{i}" for i in range(len(self.layers))]

    def fsdp_units(self) -> list[str]:
        """ZeRO-3 units, innermost first; the root ("") owns ln_f, the head and, when tied, the
        token table (one parameter belongs to one unit)."""
        embed = ["wpe"] if self.cfg.tie_embeddings else ["wte", "wpe"]
        return embed + self.pipeline_cut_points() + [""]


# Residual-branch outputs: 2 * n_layers of them add into the stream (GPT-2's scaled init).
_RESIDUAL_OUT = ("attn.o_proj.weight", "mlp.proj.weight")
_PLAIN = ("wte.weight", "wpe.weight", "output.weight", "attn.q_proj.weight",
          "attn.k_proj.weight", "attn.v_proj.weight", "mlp.fc.weight")
_ONES = ("ln_1.weight", "ln_2.weight", "ln_f.weight")


def init_tensor(name: str, shape: Sequence[int], cfg: GPT2Config, seed: int) -> Tensor:
    """The full fp32 CPU initial value of parameter ``name`` (canonical), from (seed, name)
    alone: normal(0, init_std) for tables and projections, init_std / sqrt(2 * n_layers) for
    the residual outputs, zero biases, LayerNorm weight 1."""
    if name.endswith(_ONES):
        return torch.ones(tuple(shape))
    if name.endswith(".bias"):
        return torch.zeros(tuple(shape))
    if name.endswith(_RESIDUAL_OUT):
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    elif name.endswith(_PLAIN):
        std = cfg.init_std
    else:
        raise ValueError(f"no init rule for parameter {name!r}")
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(tuple(shape)).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: GPT2, seed: int) -> None:
    """Every materialised parameter from its own (seed, name); meta ones are skipped."""
    for name, param in model.named_parameters():
        if not param.is_meta:
            param.copy_(init_tensor(canonical_name(name), param.shape, model.cfg, seed))


def build_model(cfg: GPT2Config, seed: int, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> GPT2:
    """Validate, construct without allocating, materialise on ``device`` and initialise."""
    cfg.validate()
    device = torch.device(device)
    with torch.device("meta"):
        model = GPT2(cfg).to(dtype)
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, seed)
    return model


FAMILY = Family(name="gpt2", config=GPT2Config, build=build_model, presets=PRESETS,
                hf="meshloom.models.gpt2_hf", hf_model_types=("gpt2",))
