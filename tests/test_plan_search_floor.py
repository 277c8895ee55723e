"""The search skips a layout whose compute floor (plan/search.py `_ComputeFloor`: its blocks'
forward and backward compute alone) exceeds the step time of the fastest layouts found so far.
That is only right while the floor never exceeds a layout's first-pass step time and
`compute.block_cost` reads no Layout field but those it is cached by: both are checked here
over whole searches, and the pruned search against one that prunes nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshloom.plan import compute
from meshloom.plan import search as search_mod
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import split_fix
from meshloom.plan.models import PRESETS
from meshloom.plan.search import BLOCK_FIELDS, evaluate, layouts, search
from meshloom.plan.trainers import trainer_impl

# (model, gpus, seq, global batch, trainer, flash attention): dense and MoE, with tp, pp, cp
# and ep among the layouts, meshloom's loop and trainers whose implementation keys reach other
# block paths (Megatron's TP overlap in chunks and fused QKV, torchtitan's per-op recompute),
# and the unfused attention core (`--attention eager`).
CASES = [("llama3-8b", 16, 8192, 32, "meshloom", True),
         ("mixtral-8x7b", 16, 4096, 64, "meshloom", True),
         ("gpt2-large", 8, 1024, 64, "meshloom", True),
         ("gpt2-large", 8, 1024, 64, "meshloom", False),
         ("llama3-8b", 16, 4096, 64, "megatron-lm", True),
         ("llama3-8b", 16, 8192, 32, "torchtitan", True)]


def _setup(model: str, gpus: int, trainer: str):
    fixed, impl = split_fix(trainer_impl(trainer))
    return PRESETS[model], make_cluster("h100", gpus), fixed, impl


class _Spy:
    """A Layout (or Implementation) that records which of its fields are read."""

    def __init__(self, obj, seen: set):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name: str):
        self._seen.add(name)
        return getattr(self._obj, name)


@pytest.mark.parametrize("model, gpus, seq, batch, trainer, flash", CASES)
def test_the_floor_bounds_every_first_pass_step(model, gpus, seq, batch, trainer, flash):
    shape, cluster, fixed, impl = _setup(model, gpus, trainer)
    floor = search_mod._ComputeFloor(shape, cluster, seq, batch, "bf16", flash)
    rates = compute.rates_for(cluster)
    held = replace(impl, reshard_after_forward=False)
    seen: set[str] = set()
    read: set[str] = set()
    checked = 0
    for lay in layouts(shape, cluster, seq, batch, fixed):
        if search_mod._expert_tp_problem(shape, lay, impl):
            continue
        compute.block_cost(shape, _Spy(lay, seen), rates, seq, 2, flash, _Spy(impl, read))
        for run_as in (impl, held) if lay.zero == 3 else (impl,):
            step = evaluate(shape, lay, cluster, seq, batch, flash=flash, exact=False,
                            impl=run_as)
            assert floor(lay, impl) <= step.timing.step_time_s * (1 + search_mod.FLOOR_MARGIN), \
                lay.short()
        checked += 1
    assert checked > 100
    # What the floor's cache of block costs is keyed by is all that block_cost reads, and
    # nothing of how ZeRO-3 reshards: one floor bounds the held variant too.
    assert seen <= set(BLOCK_FIELDS), sorted(seen - set(BLOCK_FIELDS))
    assert "reshard_after_forward" not in read


@pytest.mark.parametrize("model, gpus, seq, batch, trainer, flash", CASES)
def test_pruning_changes_nothing_the_search_returns(model, gpus, seq, batch, trainer, flash,
                                                    monkeypatch):
    """The same candidates, figure for figure, as a search that costs every fitting layout;
    and far fewer layouts costed (from 5875 to 2958 for Megatron's loop, to a tenth for
    meshloom's dense 8B, a quarter for Mixtral)."""
    shape, cluster, fixed, _ = _setup(model, gpus, trainer)
    fix = trainer_impl(trainer)
    held = trainer == "meshloom"
    costed: list[int] = []
    real = search_mod.step_time

    def counting(*a, **k):
        costed.append(1)
        return real(*a, **k)

    monkeypatch.setattr(search_mod, "step_time", counting)
    pruned = search(shape, cluster, seq, batch, fix, flash=flash, top=5, try_held=held)
    n_pruned = len(costed)
    costed.clear()
    monkeypatch.setattr(search_mod._ComputeFloor, "__call__", lambda *a, **k: 0.0)
    everything = search(shape, cluster, seq, batch, fix, flash=flash, top=5, try_held=held)
    assert [c.to_dict() for c in pruned] == [c.to_dict() for c in everything]
    assert n_pruned < 0.6 * len(costed)
