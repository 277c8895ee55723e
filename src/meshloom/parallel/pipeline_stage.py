"""Cutting the model into pipeline stages.

`split_layers()` decides which blocks each of the pp x v stages runs: explicit counts from the
config, or a contiguous split that balances the stages' training FLOPs (embedding on the first
stage, final norm + head + loss on the last, so the head's matmul counts there). Every block is
in exactly one stage, and every stage has at least one.

`PipelineStageModel` is what one pipeline rank keeps of the model: its chunks' blocks under their
original names (`layers.<i>...`, so checkpoints do not depend on the layout), the embedding if it
runs stage 0, norm and head if it runs the last stage. With tied embeddings and the two ends on
different ranks, the last stage keeps its own copy of the table for the head; the pipeline keeps
the two copies equal by summing their gradients (and it is saved once, under the embedding's name).
"""

from __future__ import annotations

import torch
from torch import nn

from meshloom.models.llama import Llama, LlamaConfig
from meshloom.placement import mark_duplicate, set_checkpoint_name


def layer_costs(cfg: LlamaConfig, seq_len: int) -> tuple[list[float], float]:
    """Training FLOPs per token of each block, and of the head (its matmul over the vocabulary)."""
    block = 6.0 * cfg._layer_matmul_params() + 6.0 * seq_len * cfg.dim
    return [block] * cfg.n_layers, 6.0 * cfg.vocab_size * cfg.dim


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

    # best[s][i]: the smallest possible max stage cost of putting blocks [0, i) into s stages.
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        last = s == n_stages
        for i in range(s, n_layers + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], stage_cost(j, i, last and i == n_layers))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n_layers
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


class PipelineStageModel(nn.Module):
    """The chunks of the model that one pipeline rank runs; `forward(x, chunk, seq_len)`."""

    TP_PLAN = Llama.TP_PLAN

    def __init__(self, full: Llama, stages: list[int], bounds: list[tuple[int, int]]):
        super().__init__()
        self.cfg = full.cfg
        n_stages = len(bounds)
        self.stages = stages  # global stage index of each chunk, chunk order
        self.bounds = [bounds[s] for s in stages]
        self.first, self.last = 0 in stages, n_stages - 1 in stages
        self.chunk_first = [s == 0 for s in stages]
        self.chunk_last = [s == n_stages - 1 for s in stages]
        self.tok_embeddings = full.tok_embeddings if self.first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i]
                                     for lo, hi in self.bounds for i in range(lo, hi)})
        self.norm = full.norm if self.last else None
        self.output = full.output if self.last else None
        self.tied_copy = False
        if self.last and not self.first and self.cfg.tie_embeddings:
            # The head's own copy of the shared table: same values, saved under the embedding's
            # name, counted once in the grad norm (on the first stage).
            self.output.weight = nn.Parameter(full.tok_embeddings.weight.detach().clone())
            set_checkpoint_name(self.output.weight, "tok_embeddings.weight")
            mark_duplicate(self.output.weight)
            self.tied_copy = True
        self.register_buffer("freqs_cis", full.freqs_cis, persistent=False)

    def rope(self, seq_len: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        return Llama.rope(self, seq_len, positions)

    def forward(self, x: torch.Tensor, chunk: int, seq_len: int,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Chunk `chunk`: token ids -> hidden (first stage), hidden -> hidden, or hidden ->
        logits (last stage). `positions`: the tokens' absolute positions (context parallel)."""
        rope = self.rope(seq_len, positions)
        h = self.tok_embeddings(x) if self.chunk_first[chunk] else x
        lo, hi = self.bounds[chunk]
        for i in range(lo, hi):
            h = self.layers[str(i)](h, rope)
        return self.output(self.norm(h)) if self.chunk_last[chunk] else h

    def tied_parameter(self) -> nn.Parameter | None:
        """This rank's copy of a table shared by the first and the last stage, if any."""
        if not self.cfg.tie_embeddings or self.first == self.last:
            return None
        return self.tok_embeddings.weight if self.first else self.output.weight

    def fsdp_units(self) -> list[str]:
        embed = ["tok_embeddings"] if self.first and not self.cfg.tie_embeddings else []
        return embed + [f"layers.{k}" for k in self.layers] + [""]
