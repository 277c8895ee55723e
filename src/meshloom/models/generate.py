"""Autoregressive sampling: `generate` recomputes the whole context for every token (any model,
smoke tests and demos); `generate_cached` runs the prompt once and then one token per step
against the model's KV cache (meshloom's Llama, and its tensor-parallel slices)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


def sample_token(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """Next ids [b] from logits [b, vocab]: argmax at temperature 0, else top-k sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_args(prompt: Tensor, temperature: float, top_k: int | None) -> None:
    if prompt.dim() != 2:
        raise ValueError(f"prompt must be [batch, seq], got shape {tuple(prompt.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")


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
    _check_args(prompt, temperature, top_k)
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
            nxt = sample_token(logits, temperature, top_k, generator)
            if eos_id is not None:
                nxt = nxt.masked_fill(done, eos_id)
                done |= nxt == eos_id
            tokens = torch.cat([tokens, nxt.unsqueeze(1).to(tokens.dtype)], dim=1)
            if eos_id is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return tokens


@dataclass
class Generation:
    """What `generate_cached` returns: the tokens and where the time went."""

    tokens: Tensor  # [b, s + n]: the prompt and the n <= max_new_tokens new tokens
    prefill_s: float  # the prompt's forward pass and the first new token
    decode_s: float  # every later token: one forward pass over that token alone
    decode_steps: int  # forward passes after the prefill (n - 1, or 0)


def _now(device: torch.device) -> float:
    if device.type == "cuda":  # kernels run asynchronously: wait for them before reading a clock
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def generate_cached(
    model: nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    pick: Callable[[Tensor], Tensor] | None = None,
) -> Generation:
    """`generate` with a KV cache: one forward pass over the prompt (the prefill), then one per
    new token over that token alone, attending to the keys and values cached so far. Greedy
    gives `generate`'s tokens (the logits differ only by float rounding). ``model`` needs
    ``new_cache()`` and a ``cache=`` argument (meshloom's Llama). Nothing is cropped: the
    prompt plus ``max_new_tokens - 1`` fed tokens must fit in max_seq_len.

    ``pick(logits)`` maps the model's last-position logits [b, vocab (or this rank's slice)]
    to the next ids [b]; by default they are sampled here (``sample_token``). Tensor parallel
    passes one that gathers the vocabulary first (meshloom.inference).
    """
    _check_args(prompt, temperature, top_k)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if pick is None:
        def pick(logits: Tensor) -> Tensor:
            return sample_token(logits.float(), temperature, top_k, generator)
    b, s = prompt.shape
    out = torch.empty(b, s + max_new_tokens, dtype=prompt.dtype, device=prompt.device)
    out[:, :s] = prompt
    if max_new_tokens == 0:
        return Generation(out, 0.0, 0.0, 0)
    # The last new token is never fed back, so the cache needs one slot fewer.
    cache = model.new_cache(s + max_new_tokens - 1)
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    was_training = model.training
    model.eval()
    try:
        t0 = _now(prompt.device)
        logits = model(prompt, cache=cache)[:, -1]
        n, steps = 0, 0
        while True:
            nxt = pick(logits).to(out.dtype)
            if eos_id is not None:
                nxt = nxt.masked_fill(done, eos_id)
                done |= nxt == eos_id
            out[:, s + n] = nxt
            n += 1
            if n == 1:
                t1 = _now(prompt.device)
            if n == max_new_tokens or (eos_id is not None and bool(done.all())):
                break
            logits = model(nxt.unsqueeze(1), cache=cache)[:, -1]
            steps += 1
        t2 = _now(prompt.device)
    finally:
        model.train(was_training)
    return Generation(out[:, :s + n], t1 - t0, t2 - t1, steps)
