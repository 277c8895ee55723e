"""The model contract: everything `parallel/` may rely on about a model, declared by the model.

A family (our Llama, a GPT-2-like toy in tests/test_model_contract.py, ...) is plain PyTorch plus
this data; no strategy imports a concrete model. See docs/model.md, "The model contract".

Pieces, in forward order: the input part (embeddings), the repeated blocks (an `nn.ModuleList`:
the pipeline's cut unit and the activation-checkpoint unit) and the output part (final norm and
head; the loss follows the logits). A pipeline stage keeps only some pieces, under their original
names, and runs `embed`, `block_context` and `head` on itself: so those three methods must read
nothing on `self` but the pieces, the `state` buffers and `cfg`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from torch import Tensor, nn


@dataclass(frozen=True)
class Pieces:
    """Where the model's parts live, by attribute name."""

    input: tuple[str, ...]  # run by the first stage, e.g. ("tok_embeddings",)
    blocks: str  # the nn.ModuleList of blocks, each called as block(h, *block_context(...))
    output: tuple[str, ...]  # run by the last stage, e.g. ("norm", "output")
    state: tuple[str, ...] = ()  # buffers that block_context reads (a RoPE table); every stage
    # (input parameter, output parameter) when the head shares the embedding's table
    tied: tuple[str, str] | None = None
    # Module-name pattern (`*` = one segment) of the attention modules, e.g. "layers.*.attention":
    # each has a `core(q, k, v)` (causal attention of [b, heads, s, head_dim] tensors) that
    # context parallel replaces with ring attention. None: every module with a `core`.
    attention: str | None = None


@runtime_checkable
class ModelContract(Protocol):
    """What a model declares for the strategies (the pipeline split, tensor and context parallel,
    activation checkpointing, ZeRO-3 units) and for the loop (FLOPs, initialisation)."""

    # Module-name pattern (`*` = one segment) -> tensor-parallel style (parallel/tensor_plan.py).
    TP_PLAN: ClassVar[dict[str, str]]
    hidden_size: int  # width of the hidden states between blocks (a pipeline boundary)
    vocab_size: int  # width of the logits

    def pieces(self) -> Pieces: ...

    def embed(self, tokens: Tensor, positions: Tensor | None) -> Tensor:
        """Input part: token ids [b, s] (at absolute `positions`, default arange(s)) -> h."""

    def block_context(self, seq_len: int, positions: Tensor | None) -> tuple:
        """The extra arguments every block takes after h (e.g. the RoPE table); may be ()."""

    def head(self, h: Tensor) -> Tensor:
        """Output part: h [b, s, hidden] -> logits [b, s, vocab]."""

    def pipeline_cut_points(self) -> list[str]:
        """The blocks the model may be cut between: `<blocks>.<i>`, one per block."""

    def layer_costs(self, seq_len: int) -> tuple[list[float], float]:
        """Training FLOPs per token of each block, and of the output part (pipeline balance)."""

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the whole model (MFU)."""

    # Optional: `init_tensor(name, shape, seed) -> Tensor`, the initial value of parameter
    # `name` (canonical, whole shape) from (seed, name) alone, so that every rank builds the
    # same weights by itself. parallelize() broadcasts global rank 0's weights to the other
    # ranks of a model without it (a user's own: docs/library.md).


def name_pattern(pattern: str) -> re.Pattern:
    """A module-name pattern of the contract (TP_PLAN keys, Pieces.attention) as a regex: `*`
    stands for one dotted segment (a layer index)."""
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def blocks_of(model: nn.Module) -> nn.Module:
    """The container of a model's blocks: the one its `pieces()` names, else `layers` (a Hugging
    Face decoder's or a pipeline stage's)."""
    name = model.pieces().blocks if hasattr(model, "pieces") else "layers"
    container = getattr(model, name, None)
    if container is None:
        raise ValueError(f"{type(model).__name__} has no `{name}` of blocks")
    return container


@dataclass(frozen=True)
class Family:
    """A model family as the rest of meshloom sees it (models/families.py lists them).

    `config` is a dataclass with `validate()`, `num_params()`, `flops_per_token(seq)` and the
    fields config.ModelConfig may override (dim, n_layers, n_heads, vocab_size, ...); its
    `family` class attribute names the family, so a stored config knows how to rebuild itself.
    `build(cfg, seed, device, dtype)` returns a model that honours ModelContract. `hf` names the
    module that maps the family to Hugging Face's format (imported only when needed; see
    models/hf_checkpoint.py for what it provides)."""

    name: str
    config: type
    build: Callable[..., nn.Module]
    presets: dict[str, dict]
    hf: str | None = None
    hf_model_types: tuple[str, ...] = ()
