"""Autoregressive sampling for smoke tests and demos: full recompute, no KV cache."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _sample(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """Extend ``prompt`` [b, s] to [b, s + n], n <= max_new_tokens.

    ``temperature=0`` is greedy. The context fed to the model is cropped to its last
    ``max_seq_len`` tokens (default ``model.cfg.max_seq_len`` when the model has one). With
    ``eos_id``, rows that have finished keep emitting ``eos_id`` and sampling stops once every
    row has. ``generator`` (on the model's device) makes sampling reproducible.
    """
    if prompt.dim() != 2:
        raise ValueError(f"prompt must be [batch, seq], got shape {tuple(prompt.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if max_seq_len is None:
        max_seq_len = getattr(getattr(model, "cfg", None), "max_seq_len", None)

    was_training = model.training
    model.eval()
    try:
        tokens = prompt
        done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for _ in range(max_new_tokens):
            context = tokens if max_seq_len is None else tokens[:, -max_seq_len:]
            logits = model(context)[:, -1, :].float()
            nxt = _sample(logits, temperature, top_k, generator)
            if eos_id is not None:
                nxt = nxt.masked_fill(done, eos_id)
                done |= nxt == eos_id
            tokens = torch.cat([tokens, nxt.unsqueeze(1).to(tokens.dtype)], dim=1)
            if eos_id is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return tokens
