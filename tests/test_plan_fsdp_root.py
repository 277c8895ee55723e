"""ZeRO-3's root unit (`fsdp_root`): what lies outside the blocks is gathered once a micro-batch
and kept gathered to its backward (plan/memory.py `zero3_root_params`, plan/timing.py
`_dp_time`). FSDP1 and FSDP2 wrapping the blocks keep it all in the root (`outer`), gathered
first and exposed; meshloom's root holds the final norm and the head, which the last block's
forward prefetches, its embedding a unit gathered first. tests/test_zero.py holds the planner's
root against the one meshloom's ZeRO-3 builds, tests/test_fsdp_root.py the order it gathers
it in. Every micro-batch here gathers its own: holding the opening units from one micro-batch to
the next (`fsdp_carry`) is tests/test_plan_fsdp_carry.py's."""

from __future__ import annotations

import pytest

from meshloom.plan import PlanError, timing
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import MESHLOOM, Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import (
    memory_per_gpu,
    outer_params,
    zero3_first_outer_params,
    zero3_root_params,
)
from meshloom.plan.models import PRESETS, from_dims
from meshloom.plan.search import evaluate
from meshloom.plan.trainers import trainer_impl

SEQ, BATCH = 2048, 32
HEAD = Implementation(fsdp_carry=False)
OUTER = Implementation(fsdp_root="outer", fsdp_carry=False)


def test_which_root_each_trainer_has():
    assert MESHLOOM.fsdp_root == "head"
    for name in ("torchtitan", "llm-foundry", "tinyllama"):  # FSDP1 / FSDP2 over the blocks
        assert trainer_impl(name)["fsdp_root"] == "outer"
    assert parse_fix("fsdp_root=outer") == {"fsdp_root": "outer"}
    with pytest.raises(PlanError, match="fsdp_root=whole must be one of head, outer"):
        parse_fix("fsdp_root=whole")


def test_root_parameters_by_rank_and_tying():
    """Per tp rank: meshloom's root is the head (or tied table) and final norm on the last
    pipeline rank; `outer` is every parameter outside the blocks, embedding on the first."""
    llama = PRESETS["llama3-8b"]  # untied
    v, h = llama.vocab, llama.hidden
    lay = Layout(dp=8, zero=3)
    assert zero3_root_params(llama, lay, 0, MESHLOOM) == v * h + h
    assert zero3_root_params(llama, lay, 0, OUTER) == 2 * v * h + h
    tp2 = Layout(tp=2, dp=4, zero=3)
    assert zero3_root_params(llama, tp2, 0, OUTER) == v * h + h  # norms stay whole
    pp2 = Layout(pp=2, dp=4, zero=3)
    assert zero3_root_params(llama, pp2, 0, MESHLOOM) == 0
    assert zero3_root_params(llama, pp2, 1, MESHLOOM) == v * h + h
    assert zero3_root_params(llama, pp2, 0, OUTER) == v * h
    assert zero3_root_params(llama, pp2, 1, OUTER) == v * h + h
    gpt = from_dims("gpt", 768, 12, 12, 50257, positions=1024)  # tied, learned positions
    assert zero3_root_params(gpt, lay, 0, MESHLOOM) == 50257 * 768 + 2 * 768
    assert zero3_root_params(gpt, lay, 0, OUTER) == (50257 + 1024) * 768 + 2 * 768
    assert outer_params(gpt, lay, 0) == zero3_root_params(gpt, lay, 0, OUTER)
    # Nothing is gathered without ZeRO-3 sharding.
    for other in (Layout(dp=8, zero=2), Layout(dp=8, zero=3, dp_replicate=8)):
        assert zero3_root_params(llama, other, 0, OUTER) == 0


def test_which_outer_parameters_are_gathered_before_anything_runs():
    """`outer`: the whole root, as the forward begins. meshloom: the embedding unit, and the
    root only when it holds the token table the embedding reads (tied, one pipeline rank);
    its untied root, or a tied head's copy on the last of several pipeline ranks, is the last
    block's prefetch (parallel/fsdp.py)."""
    llama = PRESETS["llama3-8b"]
    v, h = llama.vocab, llama.hidden
    lay, pp2 = Layout(dp=8, zero=3), Layout(pp=2, dp=4, zero=3)
    assert zero3_first_outer_params(llama, lay, 0, MESHLOOM) == v * h
    assert zero3_first_outer_params(llama, lay, 0, OUTER) == outer_params(llama, lay, 0)
    assert zero3_first_outer_params(llama, pp2, 0, MESHLOOM) == v * h
    assert zero3_first_outer_params(llama, pp2, 1, MESHLOOM) == 0
    assert zero3_first_outer_params(llama, pp2, 1, OUTER) == v * h + h
    gpt = from_dims("gpt", 768, 12, 12, 50257, positions=1024)  # tied, learned positions
    assert zero3_first_outer_params(gpt, lay, 0, MESHLOOM) == outer_params(gpt, lay, 0)
    assert zero3_first_outer_params(gpt, pp2, 0, MESHLOOM) == (50257 + 1024) * 768
    assert zero3_first_outer_params(gpt, pp2, 1, MESHLOOM) == 0


@pytest.mark.parametrize("dtype, impl, nbytes", [
    ("bf16", OUTER, 2), ("fp32", OUTER, 4),
    ("bf16", Implementation(fsdp_root="outer", fp32_params=True), 4)])
def test_the_root_is_held_at_the_peak_in_the_gathered_dtype(dtype, impl, nbytes):
    """The memory's buffers hold the root's gathered parameters: `outer` holds the embedding
    more than `head`, in the dtype the gathers carry."""
    shape, lay = PRESETS["llama3-8b"], Layout(dp=8, zero=3, micro_batch=1)
    head = memory_per_gpu(shape, lay, SEQ, BATCH, dtype, impl=Implementation(
        fp32_params=impl.fp32_params))
    outer = memory_per_gpu(shape, lay, SEQ, BATCH, dtype, impl=impl)
    assert outer.buffers - head.buffers == pytest.approx(shape.vocab * shape.hidden * nbytes)
    assert outer.activations == head.activations and outer.params == head.params


def _dp(lay, impl=HEAD, shape=None):
    plan = evaluate(shape or PRESETS["llama3-8b"], lay, make_cluster("h100", 8), SEQ, BATCH,
                    impl=impl)
    return plan.timing.detail["comm_s"]["dp"]


def test_zero3_gathers_the_outer_parameters_once_a_micro_batch():
    """Each micro-batch gathers every block twice and what lies outside them once: in one call
    more than the blocks' (`outer`'s root) or two (meshloom's embedding and root); the
    gathers' seconds fall by one pass over the outer parameters against gathering everything
    twice, whichever holds the root."""
    shape = PRESETS["llama3-8b"]
    lay = Layout(dp=8, zero=3, micro_batch=2)
    m = BATCH // (8 * lay.micro_batch)
    dp, outer_root = _dp(lay), _dp(lay, OUTER)
    assert dp["calls"]["all_gather"]["calls"] == m * (2 * shape.layers + 2)
    assert outer_root["calls"]["all_gather"]["calls"] == m * (2 * shape.layers + 1)
    # The root's content moves memory and the order, not bytes: the same seconds but a call's.
    assert outer_root["ops"]["reduce_scatter"] == dp["ops"]["reduce_scatter"]
    assert (outer_root["ops"]["all_gather"] - outer_root["calls"]["all_gather"]["fixed_s"]
            == pytest.approx(dp["ops"]["all_gather"] - dp["calls"]["all_gather"]["fixed_s"],
                             rel=1e-12))
    # The gathers scale with their bytes (bandwidth-bound at these sizes): blocks twice,
    # outer once, against a model with no parameters outside its blocks.
    blocks = shape.layers * shape.layer_params
    outer = outer_params(shape, lay, 0)
    bare = _dp(lay, shape=from_dims("llama", shape.hidden, shape.layers, shape.heads, 1,
                                    kv_heads=shape.kv_heads, ffn_hidden=shape.ffn_hidden))
    ratio = dp["ops"]["all_gather"] / bare["ops"]["all_gather"]
    assert ratio == pytest.approx((2 * blocks + outer) / (2 * blocks), rel=0.02)


@pytest.mark.parametrize("impl, first", [(OUTER, "outer"), (HEAD, "embedding")])
def test_the_first_gathers_are_exposed_without_prefetch_and_with(monkeypatch, impl, first):
    """Nothing runs before the first gathers of a micro-batch: without prefetch every gather
    waits, and with it, were all the rest hidden for free, the first block's gather and the
    outer parameters' gathered before it would still be waited on in full, each micro-batch:
    the whole root under `outer`, meshloom's embedding alone (the last block hides its
    root's)."""
    lay = Layout(dp=8, zero=3, micro_batch=2)
    waited = _dp(lay, Implementation(fsdp_prefetch=False, fsdp_root=impl.fsdp_root,
                                     fsdp_carry=False))
    assert waited["exposed"] == pytest.approx(
        waited["ops"]["all_gather"] + waited["ops"]["reduce_scatter"]
        + waited["ops"]["reduce_scatter_copy_in"])
    monkeypatch.setattr(timing, "_exposed", lambda comm, compute: 0.0)
    hidden = _dp(lay, impl)
    shape, m = PRESETS["llama3-8b"], BATCH // (8 * lay.micro_batch)
    lead = outer_params(shape, lay, 0) if first == "outer" else shape.embedding_params
    gather = make_cluster("h100", 8).collective
    lead_s = gather("all_gather", lead * 2, 8, 1, "auto").seconds
    block = gather("all_gather", shape.layer_params * 2, 8, 1, "auto").seconds
    assert hidden["exposed"] == pytest.approx(
        m * (lead_s + block) + hidden["ops"]["reduce_scatter_copy_in"], rel=1e-9)


def test_explain_names_the_root_unit_within_the_buffers():
    """--explain and the plan's JSON say how much of the buffers is the root unit."""
    from meshloom.plan.explain import explain

    shape, lay = PRESETS["llama3-8b"], Layout(dp=8, zero=3, micro_batch=1)
    plan = evaluate(shape, lay, make_cluster("h100", 8), SEQ, BATCH, impl=OUTER)
    root = zero3_root_params(shape, lay, 0, OUTER) * 2
    assert plan.memory.root_unit == root
    assert plan.memory.to_dict()["buffers_root_unit"] == root < plan.memory.buffers
    assert (f"ZeRO-3's root unit, gathered forward to backward (fsdp_root=outer): "
            f"{root / 1e9:.2f} GB") in explain(plan)
    unsharded = evaluate(shape, Layout(dp=8, zero=1, micro_batch=1), make_cluster("h100", 8),
                         SEQ, BATCH)
    assert unsharded.memory.root_unit == 0 and "root unit" not in explain(unsharded)
