"""When ZeRO-3 gathers its root unit (parallel/fsdp.py), on real Gloo ranks: the last block's
forward starts the root's gather and the final norm waits for it, so the last block's compute
hides it; a tied root is gathered when the embedding runs; a model whose own forward reads a
root parameter gets the root before its forward. Parity of the training these serve is in
tests/test_zero.py; the planner prices the same order (tests/test_plan_fsdp_root.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch import nn

from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.llama import Llama, build_model, config_from_preset
from meshloom.parallel import fsdp
from meshloom.parallel.fsdp import FullyShardedDataParallel

LAYERS = 3


class _ScaledHead(Llama):
    """A Llama whose own `head` reads a parameter of the model itself, outside every piece."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.logit_scale = nn.Parameter(torch.ones(()))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return super().head(h) * self.logit_scale


def _model(kind: str) -> nn.Module:
    cfg = config_from_preset("tiny", n_layers=LAYERS, tie_embeddings=kind == "tied")
    if kind != "scaled":
        return build_model(cfg, 0)
    torch.manual_seed(0)
    return _ScaledHead(cfg)


def _root_order_job(world: int, kind: str) -> dict:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = Mesh(ParallelDims(dp_shard=world), rank, "cpu", CommCounter())
    model = _model(kind)
    strat = FullyShardedDataParallel(model, mesh)
    events: list[tuple[str, str]] = []
    start, finish = fsdp._Unit.start_gather, fsdp._Unit._finish_gather

    def spy_start(u, m):
        if not u.gathered and u.work is None:
            events.append(("start", u.name))
        start(u, m)

    def spy_finish(u):
        events.append(("wait", u.name))
        finish(u)

    fsdp._Unit.start_gather, fsdp._Unit._finish_gather = spy_start, spy_finish
    # Registered after the strategy's own hooks, so each runs once that module's gather is done.
    names = ["tok_embeddings", *(f"layers.{i}" for i in range(LAYERS)), "norm", "output"]
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(
            lambda mod, args, name=name: events.append(("run", name)))
    steps, left_gathered = [], []
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        events.clear()
        x = torch.randint(0, 257, (2, 16), generator=g)
        if kind == "headless" and step == 2:  # a pipeline chunk without the head, say
            h = model.tok_embeddings(x)
            for layer in model.layers:
                h = layer(h, *model.block_context(16, None))
            loss = h.square().mean()
        else:
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1),
                                               torch.roll(x, -1, 1).flatten())
        steps.append(list(events))
        loss.backward()
        strat.finish()
        left_gathered.append([u.name for u in strat.units if u.gathered or u.work is not None])
    # An eval forward after the step: no backward will come to free what it gathered.
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    eval_left = [u.name for u in strat.units if u.gathered or u.work is not None]
    return {"steps": steps, "left_gathered": left_gathered, "root": strat.root.name,
            "eval_left": eval_left}


def _root_events(events: list[tuple[str, str]]) -> list[tuple[int, str]]:
    return [(i, kind) for i, (kind, name) in enumerate(events) if name == "" and kind != "run"]


@pytest.fixture(scope="module")
def orders() -> dict[str, list[dict]]:
    kinds = ("untied", "tied", "scaled", "headless")
    return {k: run_ranks(_root_order_job, 2, 2, k) for k in kinds}


def test_the_last_block_hides_the_root_gather(orders):
    last, before_last = ("run", f"layers.{LAYERS - 1}"), ("run", f"layers.{LAYERS - 2}")
    for res in orders["untied"]:
        for events in res["steps"]:  # the first forward too: the declared order decides
            # The last block's pre-forward starts it, after the block before ran and before the
            # last one runs, and the norm waits for it once that block has run.
            (s, start), (w, wait) = _root_events(events)
            assert (start, wait) == ("start", "wait")
            assert events.index(before_last) < s < events.index(last) < w
            assert events[w + 1] == ("run", "norm")
        # Nothing stays gathered (or in flight) into the optimizer step.
        assert res["left_gathered"] == [[], [], []]


def test_a_tied_root_is_gathered_when_the_embedding_runs(orders):
    for res in orders["tied"]:
        for events in res["steps"]:
            (s, start), (w, wait) = _root_events(events)
            assert (start, wait) == ("start", "wait")
            assert w < events.index(("run", "tok_embeddings")) and s == 0
        assert res["left_gathered"] == [[], [], []]


def test_a_root_read_by_the_model_itself_is_gathered_before_its_forward(orders):
    """The head reads `logit_scale`, a parameter of the model outside every piece: no module
    hook can tell when it is first read, so the root is waited for before the forward starts."""
    for res in orders["scaled"]:
        for events in res["steps"]:
            assert [kind for _, kind in _root_events(events)] == ["start", "wait"]
            assert events[:2] == [("start", ""), ("wait", "")]
        assert res["left_gathered"] == [[], [], []]


def test_a_root_prefetch_nothing_reads_completes_before_the_step(orders):
    """The last block prefetches the root, but no head runs (a pipeline chunk without it): the
    step's end reduces the root's (zero) gradients and frees it, waiting for the gather first
    rather than freeing storage a gather still writes into, or leaving it in flight (its
    parameters would be the old ones after the optimizer step)."""
    for res in orders["headless"]:
        assert [kind for _, kind in _root_events(res["steps"][2])] == ["start"]
        assert res["left_gathered"] == [[], [], []]


@pytest.mark.parametrize("kind", ["untied", "tied", "scaled"])
def test_a_forward_without_gradients_leaves_nothing_gathered(orders, kind):
    """Eval and sampling run the model under no_grad: the root, held after a training forward
    for its backward, is freed at the forward's end like every block."""
    for res in orders[kind]:
        assert res["eval_left"] == []
