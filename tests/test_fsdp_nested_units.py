"""ZeRO-3 units a model declares inside its blocks (`fsdp_units()`), under full and selective
recompute, on real Gloo ranks. Recompute reruns each block's forward in backward, which enters
the nested unit's forward again: the unit keeps its one place in the forward order the
prefetches follow (parallel/fsdp.py `_pre_forward`; with full recompute the order repeated the
nested units without it), and training matches one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch import nn

from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.llama import Llama, config_from_preset
from meshloom.parallel.activation_checkpointing import apply_block_options
from meshloom.parallel.fsdp import FullyShardedDataParallel

LAYERS, STEPS, LR = 3, 3, 0.5


class _FeedForwardUnits(Llama):
    """A Llama that shards each block's feed-forward as a unit of its own, inside the block's."""

    def fsdp_units(self) -> list[str]:
        nested = [name for i in range(LAYERS)
                  for name in (f"layers.{i}.feed_forward", f"layers.{i}")]
        return ["tok_embeddings", *nested, ""]


def _model(recompute: str) -> nn.Module:
    torch.manual_seed(0)
    model = _FeedForwardUnits(config_from_preset("tiny", n_layers=LAYERS))
    apply_block_options(model, recompute)
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 257, (2, 16), generator=g)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(x, -1, 1).flatten())


def _job(world: int, recompute: str) -> dict:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(recompute)
    strat = FullyShardedDataParallel(model, Mesh(ParallelDims(dp_shard=world), rank, "cpu",
                                                 CommCounter()))
    decay, no_decay = strat.optim_param_groups()
    opt = torch.optim.SGD(decay + no_decay, lr=LR)
    orders, losses = [], []
    for step in range(STEPS):
        loss = _loss(model, _batch(step, rank))
        loss.backward()
        strat.finish()
        opt.step()
        strat.after_step()
        strat.zero_grad()
        losses.append(loss.item())
        orders.append([u.name for u in strat._order])
    whole = {k: v.clone() for k, v in strat.full_state_dict().items()}

    # One process, the ranks' batches together: the same mean loss and the same steps.
    ref = _model(recompute)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_losses = []
    for step in range(STEPS):
        x = torch.cat([_batch(step, r) for r in range(world)])
        loss = _loss(ref, x)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    worst = max(((whole[n] - p.detach()).abs().max() / p.detach().abs().max()).item()
                for n, p in ref.named_parameters())
    return {"orders": orders, "losses": losses, "ref_losses": ref_losses, "worst": worst}


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_nested_units_keep_their_place_and_train_as_one_process(recompute):
    results = run_ranks(_job, 2, 2, recompute)
    units = ["tok_embeddings", *(name for i in range(LAYERS)
                                 for name in (f"layers.{i}", f"layers.{i}.feed_forward"))]
    for res in results:
        # From the second step on, the order the prefetches follow is the forward's (set by
        # step 1's forward and its recompute in backward): each unit once, a block before the
        # feed-forward nested in it.
        for order in res["orders"][1:]:
            assert order == units, order
        assert res["worst"] < 1e-5
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / len(results)
        assert abs(mean - results[0]["ref_losses"][step]) < 1e-5
