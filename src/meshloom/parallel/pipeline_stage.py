"""Cutting the model into pipeline stages.

`split_layers()` decides which blocks each of the pp x v stages runs: explicit counts from the
config, or a contiguous split that balances the stages' training FLOPs (embedding on the first
stage, final norm + head + loss on the last, so the head's matmul counts there). Every block is
in exactly one stage, and every stage has at least one.

`PipelineStageModel` is what one pipeline rank keeps of the model, generic over the pieces the
model declares (models/contract.py): its chunks' blocks under their original names (`layers.<i>`,
so checkpoints do not depend on the layout), the input part if it runs stage 0, the output part
if it runs the last stage. With tied embeddings and the two ends on different ranks, the last
stage keeps its own copy of the table for the head; the pipeline keeps the two copies equal by
summing their gradients (and it is saved once, under the embedding's name).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from meshloom.placement import mark_duplicate, set_checkpoint_name


def split_layers(n_layers: int, n_stages: int, costs: list[float] | None = None,
                 head_cost: float = 0.0, explicit: list[int] | None = None
                 ) -> list[tuple[int, int]]:
    """[lo, hi) block ranges of the stages, in stage order."""
    if explicit:
        if len(explicit) != n_stages or sum(explicit) != n_layers or min(explicit) < 1:
            raise ValueError(f"parallel.pp_layers={explicit} must list {n_stages} stage sizes "
                             f"of at least 1 layer each, adding up to {n_layers} layers")
        bounds, lo = [], 0
        for n in explicit:
            bounds.append((lo, lo + n))
            lo += n
        return bounds
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages need at least as many layers "
                         f"(the model has {n_layers})")
    costs = costs or [1.0] * n_layers
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(lo: int, hi: int, last: bool) -> float:
        return prefix[hi] - prefix[lo] + (head_cost if last else 0.0)

    # best[s][i]: the smallest possible max stage cost of putting blocks [0, i) into s stages;
    # cut[s][i]: the smallest j that reaches it with blocks [j, i) as stage s. Over j,
    # best[s - 1][j] never decreases and the cost of [j, i) never increases (costs >= 0, and
    # floating-point subtraction keeps that order), so the optimum sits where they cross: a
    # binary search instead of trying every j (the planner splits 100+ layers many times).
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        prev = best[s - 1]
        for i in range(s, n_layers + 1):
            last = s == n_stages and i == n_layers

            def tail(j: int, i: int = i, last: bool = last) -> float:
                return stage_cost(j, i, last)

            lo, hi = s - 1, i - 1  # the first j with prev[j] >= tail(j), or i if none
            while lo <= hi:
                mid = (lo + hi) // 2
                if prev[mid] >= tail(mid):
                    hi = mid - 1
                else:
                    lo = mid + 1
            cross = lo
            value, j_best = (prev[cross], cross) if cross <= i - 1 else (inf, i)
            if cross > s - 1 and tail(cross - 1) <= value:
                # Left of the crossing the tail decides; take the first j it ties at.
                value = tail(cross - 1)
                lo, hi = s - 1, cross - 1
                while lo < hi:
                    mid = (lo + hi) // 2
                    if tail(mid) <= value:
                        hi = mid
                    else:
                        lo = mid + 1
                j_best = lo
            best[s][i], cut[s][i] = value, j_best
    bounds, i = [], n_layers
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


class PipelineStageModel(nn.Module):
    """The chunks of the model that one pipeline rank runs; `forward(x, chunk, seq_len)`."""

    def __init__(self, full: nn.Module, stages: list[int], bounds: list[tuple[int, int]]):
        super().__init__()
        pieces = full.pieces()
        self.cfg = getattr(full, "cfg", None)  # the contract's three methods may read it
        self.TP_PLAN = full.TP_PLAN
        self.hidden_size, self.vocab_size = full.hidden_size, full.vocab_size
        self.pieces = lambda: pieces
        n_stages = len(bounds)
        self.stages = stages  # global stage index of each chunk, chunk order
        self.bounds = [bounds[s] for s in stages]
        self.first, self.last = 0 in stages, n_stages - 1 in stages
        self.chunk_first = [s == 0 for s in stages]
        self.chunk_last = [s == n_stages - 1 for s in stages]
        # The pieces under their own names (None where another rank runs them), so that the
        # model's own embed / block_context / head run on this stage unchanged.
        for name in pieces.input:
            setattr(self, name, getattr(full, name) if self.first else None)
        blocks = getattr(full, pieces.blocks)
        setattr(self, pieces.blocks, nn.ModuleDict(
            {str(i): blocks[i] for lo, hi in self.bounds for i in range(lo, hi)}))
        for name in pieces.output:
            setattr(self, name, getattr(full, name) if self.last else None)
        for name in pieces.state:
            self.register_buffer(name, getattr(full, name), persistent=False)
        for method in ("embed", "block_context", "head"):
            setattr(self, method, types.MethodType(getattr(type(full), method), self))
        self.tied, self.tied_copy = pieces.tied, False
        if self.last and not self.first and self.tied:
            # The head's own copy of the shared table: same values, saved under the embedding's
            # name, counted once in the grad norm (on the first stage).
            table, head = self.tied
            owner, _, leaf = head.rpartition(".")
            copy = nn.Parameter(full.get_parameter(table).detach().clone())
            setattr(self.get_submodule(owner), leaf, copy)
            set_checkpoint_name(copy, table)
            mark_duplicate(copy)
            self.tied_copy = True

    def forward(self, x: torch.Tensor, chunk: int, seq_len: int,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Chunk `chunk`: token ids -> hidden (first stage), hidden -> hidden, or hidden ->
        logits (last stage). `positions`: the tokens' absolute positions (context parallel)."""
        context = self.block_context(seq_len, positions)
        h = self.embed(x, positions) if self.chunk_first[chunk] else x
        lo, hi = self.bounds[chunk]
        blocks = getattr(self, self.pieces().blocks)
        for i in range(lo, hi):
            h = blocks[str(i)](h, *context)
        return self.head(h) if self.chunk_last[chunk] else h

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters chunk `chunk`'s backward gives gradients to: its blocks, and the input
        (output) part where it is the first (last) stage. Every parameter of the rank is in
        exactly one chunk."""
        lo, hi = self.bounds[chunk]
        blocks = getattr(self, self.pieces().blocks)
        modules = [blocks[str(i)] for i in range(lo, hi)]
        if self.chunk_first[chunk]:
            modules += [getattr(self, n) for n in self.pieces().input]
        if self.chunk_last[chunk]:
            modules += [getattr(self, n) for n in self.pieces().output]
        seen = {id(p): p for m in modules if m is not None for p in m.parameters()}
        return list(seen.values())  # a table shared by both ends once

    def tied_parameter(self) -> nn.Parameter | None:
        """This rank's copy of a table shared by the first and the last stage, if any."""
        if not self.tied or self.first == self.last:
            return None
        return self.get_parameter(self.tied[0] if self.first else self.tied[1])

    def fsdp_units(self) -> list[str]:
        """The input pieces (bar one holding a tied table: the root owns that), each block, the
        root."""
        tied = self.tied[0] if self.tied else ""
        inputs = [n for n in self.pieces().input
                  if not tied.startswith(n + ".")] if self.first else []
        name = self.pieces().blocks
        return inputs + [f"{name}.{k}" for k in getattr(self, name)] + [""]
