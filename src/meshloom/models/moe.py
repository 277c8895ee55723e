"""Mixture-of-experts feed-forward: router, routed experts, optional shared expert.

A block's `feed_forward` becomes an `MoE` when the config has `n_experts > 0` (models/llama.py;
the Mixtral family in models/mixtral.py). Per token, the router scores every expert (softmax or
sigmoid of a linear map), the top-k experts are chosen, their weights optionally renormalised to
sum to 1, and the token's output is the weighted sum of those experts' SwiGLU outputs (plus the
shared expert's, which every token goes through).

Routing groups are sequences, as in GShard: the load-balancing loss and the capacity limit are
computed per sequence, then averaged. That makes both independent of how a batch is split into
micro-batches and data-parallel ranks, so every layout routes and drops exactly the tokens the
single-process run does (docs/moe.md).

- Load-balancing loss (Switch Transformer, eq. 4, with top-k): per sequence of s tokens,
  E * sum_i f_i * P_i, where f_i is the share of the s*k assignments that chose expert i and P_i
  the mean router probability of expert i over the s tokens; averaged over sequences and summed
  over layers, times `aux_loss_coef`. Its gradient is added in backward (`AuxLossGrad`), so the
  loss the loop reports stays the language-model loss and the pipeline needs nothing new.
- Capacity (`capacity_factor` set): each expert takes at most ceil(cf * s * k / E) of a
  sequence's assignments, first come (by position, then by rank among the token's k choices);
  the rest are dropped (the token keeps its other experts and the residual). Unset: dropless.

Dispatch and combine go through `self.dispatcher`: `LocalDispatch` runs every expert here;
expert parallel (parallel/expert.py) replaces it with all-to-all to the ranks holding them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class MoESettings:
    """The MoE fields of a model config, checked."""

    n_experts: int
    top_k: int
    hidden: int  # each routed expert's SwiGLU width
    shared_hidden: int = 0  # the shared expert's width; 0 = none
    shared_gate: bool = False  # shared expert's output times sigmoid(linear(x)) (Qwen2-MoE)
    score: str = "softmax"  # "softmax" or "sigmoid"
    normalize: bool = True  # top-k weights renormalised to sum to 1
    aux_loss_coef: float = 0.0
    capacity_factor: float | None = None  # None: dropless

    def capacity(self, seq_len: int) -> int | None:
        """Assignments each expert takes per sequence; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)


def moe_problem(n_experts: int, top_k: int, score: str, capacity_factor: float | None,
                aux_loss_coef: float) -> str | None:
    """Why these MoE settings are invalid (one line, naming the key), or None."""
    if n_experts < 0:
        return f"model.n_experts={n_experts} must be >= 0 (0: a dense feed-forward)"
    if n_experts == 0:
        return None
    if not 1 <= top_k <= n_experts:
        return f"model.top_k={top_k} must be between 1 and model.n_experts={n_experts}"
    if score not in ("softmax", "sigmoid"):
        return f"model.router_score={score!r} must be 'softmax' or 'sigmoid'"
    if capacity_factor is not None and not capacity_factor > 0:
        return f"model.capacity_factor={capacity_factor} must be > 0 (or unset: dropless)"
    if not aux_loss_coef >= 0:
        return f"model.aux_loss_coef={aux_loss_coef} must be >= 0"
    return None


# ---------------------------------------------------------------- routing


@dataclass
class Routing:
    """Where a micro-batch's T = b*s tokens go. Assignments are the (token, choice) pairs that
    were kept, sorted by expert (stable: by token within an expert)."""

    token: Tensor  # [A] token index of each kept assignment
    weight: Tensor  # [A] its combine weight
    counts: Tensor  # [E] kept assignments per expert (int64, on the CPU: split sizes)
    aux: Tensor  # scalar: what the load-balancing loss's gradient is taken of (see route)
    aux_value: Tensor  # scalar: the micro-batch's load-balancing loss (mean over sequences)
    chosen: Tensor  # [E] assignments per expert before the capacity limit
    dropped: Tensor  # scalar: assignments over capacity


class SequenceSplit(Protocol):
    """Context parallel's view of the sequences (parallel/expert.py provides it): this rank
    holds chunks `chunk_ids` (equal parts, in that order) of the `n_chunks` of every sequence,
    which `ranks` ranks share."""

    ranks: int
    n_chunks: int
    chunk_ids: tuple[int, ...]
    grad_scale: int  # what data parallel's average divides this rank's gradients by, beyond dp

    def chunk_of(self, rank: int) -> tuple[int, ...]:
        """The chunk ids rank `rank` holds, in the order its tokens come."""

    def sum(self, t: Tensor) -> Tensor:
        """t summed over the ranks sharing the sequences (not differentiable)."""

    def gather(self, t: Tensor) -> Tensor:
        """[ranks, *t.shape]: every rank's t (not differentiable)."""


def route(logits: Tensor, s: int, cfg: MoESettings,
          split: SequenceSplit | None = None) -> Routing:
    """Top-k routing of router `logits` [T, E] (T = b*s tokens, sequence after sequence).

    Under context or sequence parallel (`split`) each sequence's s tokens here are only its
    parts on this rank: the assignment counts of the whole sequences are summed over the ranks,
    so the loss and the capacity are exactly those of the whole sequences. The loss's gradient
    then comes from this rank's probabilities only (`aux`, scaled by `split.grad_scale`: data
    parallel's average divides a context-parallel rank's gradients by cp, while sequence
    parallel sums its tp ranks')."""
    T, E, k = logits.shape[0], cfg.n_experts, cfg.top_k
    b = T // s
    logits = logits.float()
    scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
    top_w, top_i = scores.topk(k, dim=-1)  # [T, k]
    if cfg.normalize:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    # Assignments token-major (position order, then the token's choice rank); each one's
    # (sequence, expert) group as one key.
    expert = top_i.reshape(-1)
    key = torch.arange(T * k, device=logits.device) // (s * k) * E + expert
    per_seq = torch.bincount(key, minlength=b * E)  # [b*E]
    # Per sequence: f_i = share of its s*k assignments on expert i; P_i = mean probability
    # (sigmoid scores made a distribution over the experts first, as DeepSeek-V3 does).
    probs = scores if cfg.score == "softmax" else scores / scores.sum(-1, keepdim=True)
    p_sum = probs.view(b, s, E).sum(1)
    whole = 1 if split is None else split.ranks  # the sequence is `whole` times what is here
    scale = 1 if split is None else split.grad_scale
    if split is None:
        counts_seq, p_seq = per_seq.view(b, E).float(), p_sum.detach()
    else:
        both = split.sum(torch.cat([per_seq.view(b, E).float(), p_sum.detach()]))
        counts_seq, p_seq = both[:b], both[b:]
    f = counts_seq / (s * whole * k)
    aux_value = (E * (f * p_seq / (s * whole)).sum(-1)).mean()
    aux = (E * scale * (f * p_sum / (s * whole)).sum(-1)).mean()
    token = torch.arange(T, device=logits.device).repeat_interleave(k)
    weight = top_w.reshape(-1)
    capacity = cfg.capacity(s * whole)
    dropped = torch.zeros((), dtype=torch.int64, device=logits.device)
    if capacity is None:
        order = torch.arange(T * k, device=logits.device)
    else:
        order, dropped = _within_capacity(expert, b, s, k, E, capacity, split)
    # Kept assignments sorted by expert, by token within an expert.
    order = order[torch.argsort(expert[order] * T + token[order])]
    counts = torch.bincount(expert[order], minlength=E).cpu()
    return Routing(token=token[order], weight=weight[order], counts=counts, aux=aux,
                   aux_value=aux_value, chosen=per_seq.view(b, E).sum(0), dropped=dropped)


def _within_capacity(expert: Tensor, b: int, s: int, k: int, E: int, capacity: int,
                     split: SequenceSplit | None) -> tuple[Tensor, Tensor]:
    """The assignments (indices into `expert`, token-major) that fit: within each (sequence,
    expert) group, the first `capacity` by position, then by the token's choice rank. Under
    context parallel, the assignments of the sequence's earlier chunks, on whichever rank, come
    first."""
    dev = expert.device
    parts = 1 if split is None else len(split.chunk_ids)
    chunk = s // parts  # tokens of one chunk of one sequence here
    idx = torch.arange(b * s * k, device=dev)
    local_chunk = idx // (chunk * k) % parts
    # Group key (sequence, local chunk, expert): positions run in order inside a key.
    key = (idx // (s * k) * parts + local_chunk) * E + expert
    groups = torch.bincount(key, minlength=b * parts * E)
    order = torch.argsort(key, stable=True)
    rank = idx - (groups.cumsum(0) - groups)[key[order]]  # place within its group, sorted
    if split is not None:
        # Assignments to each expert in every chunk of every sequence, by global chunk id:
        # those in earlier chunks come before this rank's.
        every = split.gather(groups.view(b, parts, E).float())  # [ranks, b, parts, E]
        by_chunk = torch.zeros(b, split.n_chunks, E, device=dev)
        ids = torch.tensor(split.chunk_ids, device=dev)
        for r in range(split.ranks):
            by_chunk[:, split.chunk_of(r)] = every[r]
        before = (by_chunk.cumsum(1) - by_chunk)[:, ids].long()  # [b, parts, E]
        rank = rank + before.reshape(-1)[key[order]]
    kept = rank < capacity
    return order[kept], (~kept).sum()


class AuxLossGrad(torch.autograd.Function):
    """Identity on `x` in forward; in backward, also the gradient of `coef * aux * scale` for
    the router. `scale` is the micro-batch's share of the step's loss times the loss scale
    (set by the step, `aux_grad_scale`), what the language-model loss's backward gets."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, coef: float) -> Tensor:
        ctx.coef = coef
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        grad_aux = torch.full((), ctx.coef * _AUX_GRAD_SCALE[0], dtype=torch.float32,
                              device=g.device)
        return g, grad_aux, None


_AUX_GRAD_SCALE = [1.0]


def set_aux_grad_scale(scale: float) -> None:
    """What each micro-batch's loss is multiplied by before backward (1/micro-batches times the
    fp16 loss scale): the load-balancing loss's gradient gets the same factor."""
    _AUX_GRAD_SCALE[0] = scale


# ---------------------------------------------------------------- experts


def _swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def _matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul reading `x` runs in: autocast's where it is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def grouped_mm_usable(x: Tensor, w: Tensor) -> bool:
    """torch._grouped_mm needs 16-byte-aligned rows (in the dtype it runs in); on CUDA it runs
    every group as one kernel."""
    size = torch.finfo(_matmul_dtype(x)).bits // 8
    return hasattr(torch, "_grouped_mm") and all(
        d * size % 16 == 0 for d in (w.shape[-1], w.shape[-2]))


def _autocast_operands(*ts: Tensor) -> list[Tensor]:
    """The operands as autocast would cast a matmul's: torch._grouped_mm has no autocast rule
    (pytorch/pytorch#174763), so under autocast with fp32 parameters it would otherwise run in
    fp32 (or refuse fp32 where the kernel is bf16-only), unlike the loop's matmuls."""
    device = ts[0].device.type
    if not torch.is_autocast_enabled(device):
        return list(ts)
    return [t.to(torch.get_autocast_dtype(device)) for t in ts]


class _ContiguousGrad(torch.autograd.Function):
    # torch._grouped_mm's backward refuses a broadcast gradient (e.g. from .sum()).
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g.contiguous()


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three stacked weights: w1, w3 [E, hidden, dim], w2 [E, dim, hidden]
    (each expert's matrices in nn.Linear's [out, in] layout). `forward(x, counts)` runs rows of
    `x` sorted by expert, `counts[e]` rows for expert e, as one grouped computation: one grouped
    GEMM per matrix where the device has it (CUDA), a loop over the experts elsewhere."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        # "auto": grouped GEMM on CUDA, loop elsewhere; "grouped"/"loop" force one (tests).
        self.kernel = "auto"

    @property
    def n_local(self) -> int:
        return self.w1.shape[0]

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        kernel = self.kernel
        if kernel == "auto":
            kernel = "grouped" if x.is_cuda and grouped_mm_usable(x, self.w1) else "loop"
        if kernel == "grouped" and x.shape[0] > 0:
            offs = counts.to(x.device).cumsum(0).to(torch.int32)
            x, w1, w3, w2 = _autocast_operands(x, self.w1, self.w3, self.w2)
            h = F.silu(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)) * \
                torch._grouped_mm(x, w3.transpose(1, 2), offs=offs)
            return _ContiguousGrad.apply(torch._grouped_mm(h, w2.transpose(1, 2), offs=offs))
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                outs.append(_swiglu(x[start:start + n], self.w1[e], self.w3[e], self.w2[e]))
                start += n
        if not outs:
            # No row here. The weights and the input stay in the graph all the same (zero
            # gradients): a data-parallel strategy waits for every weight's gradient, and under
            # expert parallel the input's backward is an all-to-all every rank must join.
            return x.new_zeros(0, self.w2.shape[1]) + 0.0 * (
                x.sum() + self.w1.sum() + self.w3.sum() + self.w2.sum())
        return torch.cat(outs)


class LocalDispatch:
    """Every expert on this rank: the sorted rows go straight to the experts."""

    def __call__(self, x: Tensor, counts: Tensor, experts: GroupedExperts) -> Tensor:
        return experts(x, counts)


class FeedForward(nn.Module):
    """The SwiGLU feed-forward: a dense block's (models/llama.py) and the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Combine(torch.autograd.Function):
    """Each token's sum of its weighted expert rows: `index_add` into zeros, saving only the
    token index. (Autograd's own index_add also saves the rows, only for their shape: under
    autocast an fp32 copy of every expert output, 4 bytes x hidden per assignment.)"""

    @staticmethod
    def forward(ctx, rows: Tensor, token: Tensor, n_tokens: int) -> Tensor:
        ctx.save_for_backward(token)
        return rows.new_zeros(n_tokens, rows.shape[1]).index_add(0, token, rows)

    @staticmethod
    def backward(ctx, g: Tensor):
        (token,) = ctx.saved_tensors
        return g.index_select(0, token), None, None


@dataclass
class MoEStats:
    """What a block's routing did since the last `reset_stats` (logged per step). Tensors, so
    that recording costs no device synchronisation."""

    aux: Tensor | float = 0.0  # sum of micro-batch load-balancing losses (before the coefficient)
    micro_batches: int = 0
    load: Tensor | int = 0  # [E] assignments per expert before the capacity limit
    dropped: Tensor | int = 0  # assignments over capacity
    assignments: int = 0  # tokens * top_k


class MoE(nn.Module):
    """A block's mixture-of-experts feed-forward: x [b, s, dim] -> [b, s, dim]."""

    def __init__(self, dim: int, cfg: MoESettings):
        super().__init__()
        self.settings = cfg
        self.router = nn.Linear(dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, dim, cfg.hidden)
        self.shared = FeedForward(dim, cfg.shared_hidden) if cfg.shared_hidden else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if cfg.shared_gate else None
        self.dispatcher = LocalDispatch()
        self.split: SequenceSplit | None = None  # set by context parallel
        self.stats = MoEStats()

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        r = route(self.router(flat), s, self.settings, self.split)
        if self.training and torch.is_grad_enabled():
            self._record(r, b * s)
        # Cast to the experts' compute dtype before the rows travel: under autocast expert
        # parallel's dispatch then moves 2-byte rows, not fp32 ones (same values).
        (rows,) = _autocast_operands(flat[r.token])
        y = self.dispatcher(rows, r.counts, self.experts)
        y = y * r.weight.unsqueeze(-1).to(y.dtype)
        out = _Combine.apply(y.to(flat.dtype), r.token, flat.shape[0])
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(flat))
            out = out + shared
        out = out.view(b, s, d)
        if self.settings.aux_loss_coef and self.training and torch.is_grad_enabled():
            out = AuxLossGrad.apply(out, r.aux, self.settings.aux_loss_coef)
        return out

    def _record(self, r: Routing, tokens: int) -> None:
        st = self.stats
        st.aux = st.aux + r.aux_value
        st.micro_batches += 1
        st.load = st.load + r.chosen
        st.dropped = st.dropped + r.dropped
        st.assignments += tokens * self.settings.top_k

    def reset_stats(self) -> MoEStats:
        out, self.stats = self.stats, MoEStats()
        return out


def moe_blocks(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE of `model` (of this pipeline stage), by module name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
