"""Tensor parallel for Hugging Face's `LlamaForCausalLM` (optional: needs `transformers`).

The same plan mechanism as meshloom's own `Llama.TP_PLAN` (see `parallel/tensor_plan.py`),
written for transformers' module names. Nothing here imports transformers at module level:
importing meshloom never pulls it in.

What the adapter takes care of beyond the plan:
- Attention with sliced heads: transformers' `LlamaAttention` reshapes its projections with
  `view(*input_shape, -1, head_dim)`, so it infers the local head count from the sliced weights,
  and `num_key_value_groups` (heads per KV head) is the same on every slice. Older releases keep
  `num_heads` / `num_key_value_heads` on the module and view with them; those attributes, where
  present, are set to the local counts.
- Refused, with a one-line reason: sequence parallel (transformers builds the causal mask and the
  RoPE positions from the embedding output's length, which sequence parallel splits), `labels=`
  (transformers' loss would read vocabulary-split logits as whole ones; use `tp.loss`), and
  `pretraining_tp > 1` (old checkpoints' sliced-matmul forward assumes whole weights).

Usage: `tp = tensor_parallel_hf_llama(model, mesh)`; `model(ids).logits` is this rank's
vocabulary slice, `tp.loss(logits, targets)` the mean cross-entropy, and
`GatheredLogits(model, tp)(ids)` the whole-vocabulary logits.
"""

from __future__ import annotations

from torch import nn

from meshloom.mesh import Mesh
from meshloom.parallel.tensor import AXIS
from meshloom.parallel.tensor_plan import TensorParallel, check_tp_dims

# check_tp_dims' field names -> transformers' LlamaConfig names, for the error message.
_CONFIG_NAMES = (("model.n_kv_heads", "config.num_key_value_heads"),
                 ("model.n_heads", "config.num_attention_heads"),
                 ("model.ffn_hidden", "config.intermediate_size"))

SEQUENCE_PARALLEL_REFUSED = (
    "sequence_parallel=True is not supported for Hugging Face LlamaForCausalLM: it builds the "
    "causal mask and RoPE positions from the embedding output's sequence length, which sequence "
    "parallel splits across tp ranks")


def _require_llama_for_causal_lm(model: nn.Module) -> None:
    from transformers import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"expected a transformers LlamaForCausalLM, got {type(model).__name__}")


def hf_llama_tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan for transformers' `LlamaForCausalLM` module names. A tied
    `lm_head` needs no entry of its own beyond `colwise_vocab`: TensorParallel gives it the
    embedding's (identically padded and split) slice."""
    _require_llama_for_causal_lm(model)
    layer = "model.layers.*"
    return {
        "model.embed_tokens": "vocab",
        f"{layer}.self_attn": "input",
        f"{layer}.self_attn.q_proj": "colwise",
        f"{layer}.self_attn.k_proj": "colwise",
        f"{layer}.self_attn.v_proj": "colwise",
        f"{layer}.self_attn.o_proj": "rowwise",
        f"{layer}.mlp": "input",
        f"{layer}.mlp.gate_proj": "colwise",
        f"{layer}.mlp.up_proj": "colwise",
        f"{layer}.mlp.down_proj": "rowwise",
        f"{layer}.input_layernorm": "sequence",
        f"{layer}.post_attention_layernorm": "sequence",
        "model.norm": "sequence",
        "lm_head": "colwise_vocab",
    }


def _kv_heads(config) -> int:
    kv = getattr(config, "num_key_value_heads", None)
    return config.num_attention_heads if kv is None else kv


def check_hf_llama_tp(config, tp: int) -> str | None:
    """Why a transformers `LlamaConfig` cannot be split over `tp` ranks (None if it can)."""
    if getattr(config, "pretraining_tp", 1) > 1:
        return (f"config.pretraining_tp={config.pretraining_tp} is not supported with tensor "
                "parallel: set it to 1 (same outputs, whole-weight matmuls)")
    problem = check_tp_dims(tp, n_heads=config.num_attention_heads, kv_heads=_kv_heads(config),
                            ffn_hidden=config.intermediate_size, prefix="model.")
    if problem is None:
        return None
    for ours, theirs in _CONFIG_NAMES:
        problem = problem.replace(ours, theirs)
    return problem


class _Guard:
    """Forward pre-hook on the whole model: refuses what would silently give wrong results."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.tp.sequence_parallel:
            raise ValueError(SEQUENCE_PARALLEL_REFUSED)
        # labels is forward's 6th parameter (after input_ids, attention_mask, position_ids,
        # past_key_values, inputs_embeds).
        if kwargs.get("labels") is not None or (len(args) > 5 and args[5] is not None):
            raise ValueError("labels= is not supported on a tensor-parallel LlamaForCausalLM: its "
                             "logits are split over the vocabulary; compute the loss with "
                             "tp.loss(logits, targets)")
        return None


def tensor_parallel_hf_llama(model: nn.Module, mesh: Mesh, *,
                             sequence_parallel: bool = False) -> TensorParallel:
    """Split a transformers `LlamaForCausalLM` over the mesh's `tp` axis in place (collective-free;
    every tp rank must call it on an identically initialised model)."""
    if sequence_parallel:
        raise ValueError(SEQUENCE_PARALLEL_REFUSED)
    _require_llama_for_causal_lm(model)
    n = mesh.size(AXIS)
    problem = check_hf_llama_tp(model.config, n)
    if problem:
        raise ValueError(problem)
    tp = TensorParallel(model, hf_llama_tp_plan(model), mesh, sequence_parallel=False)
    for layer in model.model.layers:
        attn = layer.self_attn
        for attr in ("num_heads", "num_key_value_heads"):  # transformers < 4.48 views with these
            if isinstance(getattr(attn, attr, None), int):
                setattr(attn, attr, getattr(attn, attr) // n)
    model.register_forward_pre_hook(_Guard(tp), with_kwargs=True)
    return tp
