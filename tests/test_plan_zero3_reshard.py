"""ZeRO-3 without resharding after forward (`reshard_after_forward=false`, meshloom's
`parallel.reshard_after_forward`): the planner holds every unit gathered at the peak
(plan/memory.py `zero3_gathered_params`), prices no backward gathers, and, for meshloom, which
keeps the units gathered across the step's micro-batches (parallel/fsdp.py), one gather a unit
a step (plan/timing.py `_dp_time`). tests/test_zero.py checks the real ranks' gathered bytes and
gathers against the same figures, tests/test_pipeline.py the gathers under a pipeline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshloom.plan import timing
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import MESHLOOM, Implementation
from meshloom.plan.layout import Layout, config_toml, parse_fix
from meshloom.plan.memory import (
    _buffers,
    memory_per_gpu,
    rank_param_split,
    zero3_gathered_params,
    zero3_root_params,
)
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate
from meshloom.plan.stages import rank_layers, stage_layers

SEQ, BATCH = 2048, 32
KEPT = Implementation(reshard_after_forward=False)
LLAMA = PRESETS["llama3-8b"]


def _plan(lay, impl=MESHLOOM, shape=LLAMA):
    return evaluate(shape, lay, make_cluster("h100", 8), SEQ, BATCH, impl=impl)


def _dp(lay, impl=MESHLOOM, shape=LLAMA):
    return _plan(lay, impl, shape).timing.detail["comm_s"]["dp"]


def test_a_fix_key_meshloom_reshards_by_default():
    assert MESHLOOM.reshard_after_forward
    assert parse_fix("reshard_after_forward=false") == {"reshard_after_forward": False}


@pytest.mark.parametrize("lay", [Layout(dp=8, zero=3, micro_batch=1),
                                 Layout(pp=2, dp=4, zero=3, micro_batch=1),
                                 Layout(tp=2, dp=4, zero=3, micro_batch=2, sp=True)])
def test_every_unit_is_gathered_at_the_peak(lay):
    """The root unit is replaced by all of the rank's parameters, and the buffers keep only the
    running unit's gradient of the three unit-sized buffers (running, prefetched, gradient)."""
    on, off = _plan(lay).memory, _plan(lay, KEPT).memory
    layers = rank_layers(stage_layers(LLAMA, lay.pp, lay.v, SEQ, MESHLOOM.pp_split), lay.pp)
    dense, _ = rank_param_split(LLAMA, lay, off.rank, layers[off.rank])
    assert off.held_units == dense * 2 and off.root_unit == 0
    assert on.held_units == 0 and on.root_unit == zero3_root_params(LLAMA, lay, on.rank,
                                                                       MESHLOOM) * 2
    unit = LLAMA.layer_params / lay.tp
    if off.rank == on.rank:
        assert off.buffers - off.held_units == pytest.approx(
            on.buffers - on.root_unit - unit * 2 * 2, rel=1e-12)
    for name in ("params", "grads", "optimizer", "activations"):
        assert getattr(off, name) == getattr(on, name), name


def test_experts_are_held_too():
    moe = PRESETS["mixtral-8x7b"]
    lay = Layout(dp=8, zero=3, ep=4, micro_batch=1)
    dense, experts = rank_param_split(moe, lay, 0)
    assert zero3_gathered_params(moe, lay, 0, KEPT) == dense + experts
    # Experts on ranks of their own (expert shard degree 1) are not sharded: nothing to gather.
    alone = Layout(dp=4, zero=3, ep=4, micro_batch=1)
    assert zero3_gathered_params(moe, alone, 0, KEPT) == rank_param_split(moe, alone, 0)[0]


def test_nothing_changes_but_for_zero3():
    for lay in (Layout(dp=8, zero=2, micro_batch=1), Layout(dp=8, zero=0, micro_batch=1)):
        on, off = _plan(lay), _plan(lay, KEPT)
        assert on.memory == off.memory and on.timing.step_time_s == off.timing.step_time_s
    assert _buffers(LLAMA, Layout(dp=8, zero=3), SEQ, 1, "bf16", resharded=False) == (
        LLAMA.layer_params * 2)


@pytest.mark.parametrize("lay", [Layout(dp=8, zero=3, micro_batch=1),
                                 Layout(pp=2, dp=4, zero=3, micro_batch=1)])
def test_meshloom_gathers_each_unit_once_a_step(lay):
    """Without resharding meshloom holds every unit from the step's first forward to its last
    backward (with a pipeline too): one gather a unit a step. Another implementation that does
    not hold them (FSDP1's SHARD_GRAD_OP-like) gathers each micro-batch's forward; resharding
    gathers for every forward and backward."""
    m = lay.microbatches(BATCH)
    held = _dp(lay, KEPT)
    again = _dp(lay, replace(KEPT, fsdp_carry=False))
    units = held["calls"]["all_gather"]["calls"]
    assert again["calls"]["all_gather"]["calls"] == m * units
    assert again["ops"]["all_gather"] == pytest.approx(m * held["ops"]["all_gather"], rel=1e-9)
    assert held["exposed"] <= again["exposed"] <= _dp(lay)["exposed"]
    # The same reduce-scatters: one a unit a micro-batch, whatever the gathers.
    assert held["ops"]["reduce_scatter"] == again["ops"]["reduce_scatter"] == (
        _dp(lay)["ops"]["reduce_scatter"])


def test_only_the_first_forward_waits_when_held(monkeypatch):
    """Were every overlapped gather hidden for free, the step would wait for the first
    micro-batch's opening gathers only, and no backward would gather."""
    monkeypatch.setattr(timing, "_exposed", lambda comm, compute: 0.0)
    lay = Layout(dp=8, zero=3, micro_batch=1)
    cl = make_cluster("h100", 8)
    opening = sum(cl.collective("all_gather", p * 2, 8, 1, "auto").seconds
                  for p in (LLAMA.embedding_params, LLAMA.layer_params))
    held = _dp(lay, KEPT)
    assert held["exposed"] == pytest.approx(
        opening + held["ops"]["reduce_scatter_copy_in"], rel=1e-9)


def test_written_config_keeps_the_options():
    lay = Layout(dp=8, zero=3, micro_batch=1)
    text = config_toml(lay, LLAMA, SEQ, BATCH, "bf16", compile_blocks=True,
                       reshard_after_forward=False)
    assert "reshard_after_forward = false" in text and "compile = true" in text
    plain = config_toml(lay, LLAMA, SEQ, BATCH, "bf16")
    assert "reshard_after_forward" not in plain and "compile" not in plain
    # Only ZeRO-3 has the option.
    assert "reshard_after_forward" not in config_toml(replace(lay, zero=2), LLAMA, SEQ, BATCH,
                                                      "bf16", reshard_after_forward=False)


def test_peak_memory_rises_by_the_units_not_held_before():
    lay = Layout(dp=8, zero=3, micro_batch=1)
    on = memory_per_gpu(LLAMA, lay, SEQ, BATCH)
    off = memory_per_gpu(LLAMA, lay, SEQ, BATCH, impl=KEPT)
    whole = sum(rank_param_split(LLAMA, lay, 0)) * 2
    root = zero3_root_params(LLAMA, lay, 0, MESHLOOM) * 2
    assert off.total - on.total == pytest.approx(
        whole - root - 2 * LLAMA.layer_params * 2, rel=1e-12)


# -- the search tries it (meshloom only, unless pinned)

_CLI = ["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100", "--seq", "8192",
        "--global-batch", "64", "--top", "1", "--json", "--fix"]
_PIN = "tp=1,pp=1,dp=16,cp=1,micro_batch=1,zero=3,recompute="


def _best(capsys, fix: str, *more: str) -> dict:
    import json

    from meshloom.commands import main
    assert main([*_CLI, fix, *more]) == 0
    return json.loads(capsys.readouterr().out)["candidates"][0]


def test_the_search_holds_units_where_that_fits_and_is_faster(capsys):
    held = _best(capsys, _PIN + "full")
    assert held["summary"].endswith("zero3 full no-reshard")
    assert held["time_detail_s"]["implementation"]["reshard_after_forward"] is False
    resharded = _best(capsys, _PIN + "full,reshard_after_forward=true")
    assert resharded["summary"].endswith("zero3 full")
    assert held["step_time_s"] < resharded["step_time_s"]
    assert held["memory_per_gpu_bytes"]["total"] > resharded["memory_per_gpu_bytes"]["total"]
    # Pinned false: the same plan as the search's pick.
    assert _best(capsys, _PIN + "full,reshard_after_forward=false")["step_time_s"] == (
        held["step_time_s"])


def test_the_search_keeps_resharding_where_holding_does_not_fit(capsys):
    got = _best(capsys, _PIN + "none")
    assert got["summary"].endswith("zero3 none") and got["fits"]
    kept = _best(capsys, _PIN + "none,reshard_after_forward=false")
    assert not kept["fits"]


def test_other_trainers_are_not_offered_it(capsys):
    got = _best(capsys, _PIN + "full", "--trainer", "llm-foundry")
    assert "no-reshard" not in got["summary"]
    assert got["time_detail_s"]["implementation"]["reshard_after_forward"] is True


def test_the_library_search_does_not_try_it_unless_asked():
    from meshloom.plan.search import search
    lay = dict(tp=1, pp=1, dp=8, cp=1, micro_batch=1, zero=3, recompute="full")
    cl = make_cluster("h100", 8)
    plain = search(LLAMA, cl, SEQ, BATCH, lay, top=1)[0]
    tried = search(LLAMA, cl, SEQ, BATCH, lay, top=1, try_held=True)[0]
    assert not plain.held and tried.held
    assert tried.timing.step_time_s < plain.timing.step_time_s


def test_written_config_follows_the_pick(tmp_path, capsys):
    from meshloom.commands import main
    out = tmp_path / "best.toml"
    assert main([*_CLI[:-2], "--fix", _PIN + "full", "--write-config", str(out)]) == 0
    text = out.read_text()
    assert "reshard_after_forward = false" in text
    assert "no-reshard" in capsys.readouterr().out
