"""Pipeline sends as trainers issue them: asynchronous (meshloom) or blocking (Megatron-LM
2021, DeepSpeed), whole or split over the tensor-parallel ranks (`p2p_blocking`,
`pp_scatter_gather`)."""

from __future__ import annotations

import pytest

from meshloom.parallel.pipeline_schedule import build_schedule, simulate
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.models import PRESETS
from meshloom.plan.timing import step_time


def test_a_blocking_send_holds_its_rank():
    """1F1B on 2 ranks, 2 micro-batches, F = 1, B = 2, a transfer of 0.5, worked by hand.
    Asynchronous: rank 0 runs both forwards back to back and the last backward starts at 8
    (rank 1's send at 7.5 plus the transfer): span 10. Blocking: every send holds its rank
    for 0.5, so rank 1's second forward waits for its own send to end (5), its last send ends
    at 8.5: span 10.5."""
    lists = build_schedule("1f1b", 2, 2)

    def cost(a):
        return 1.0 if a.kind == "F" else 2.0

    assert simulate(lists, cost, 0.5).makespan == 10.0
    assert simulate(lists, cost, 0.5, blocking_sends=True).makespan == 10.5
    # no transfer time, nothing to wait for: both the same
    assert simulate(lists, cost, 0.0, blocking_sends=True).makespan == \
        simulate(lists, cost, 0.0).makespan


def _timing(lay: Layout, batch: int = 256, **impl) -> object:
    shape = PRESETS["megatron-18.4b"]
    return step_time(shape, lay, make_cluster("a100-80g", lay.tp * lay.pp * lay.dp), 2048,
                     batch, flash=False, impl=Implementation(compile=True, **impl))


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_blocking_sends_cost_time_on_the_critical_path(schedule, v):
    lay = Layout(tp=8, pp=4, dp=2, micro_batch=1, recompute="full", schedule=schedule, v=v)
    free, held = _timing(lay), _timing(lay, p2p_blocking=True)
    assert held.pp > free.pp and held.step_time_s > free.step_time_s
    # only the pipeline's transfers change
    assert (held.compute, held.tp, held.dp, held.bubble) == (free.compute, free.tp, free.dp,
                                                             free.bubble)


def test_scatter_gather_sends_a_tp_slice_and_gathers_it():
    """One micro-batch through GPipe crosses 2(p - 1) stage boundaries in a row, so the
    pipeline's exposed transfer time is exactly 2(p - 1) hops. Without SP a hop is the whole
    activation over the network link (every tp rank sends it); split, the 1/tp piece over the
    link plus the all-gather of the whole over tp. With SP the ranks already send their
    sequence slices: the option changes nothing."""
    lay = Layout(tp=8, pp=4, dp=2, micro_batch=1, recompute="full", schedule="gpipe")
    cl = make_cluster("a100-80g", 64)
    act, link = 2048 * PRESETS["megatron-18.4b"].hidden * 2, cl.link_bandwidth(2, 2 * 8)
    whole, split = _timing(lay, batch=2), _timing(lay, batch=2, pp_scatter_gather=True)
    # Each send starts in NCCL's 8.4 us plus one network hop of 14.0 us (stages are 16 ranks
    # apart, in other nodes).
    start = 1e-6 * (8.4 + 14.0)

    def sends(t):  # the pipeline's time less the tied table's one all-reduce a step
        return t.pp - t.detail["comm_s"]["pp"]["ops"].get("tied_table_all_reduce", 0.0)
    assert sends(whole) == pytest.approx(6 * (act / link + start), rel=1e-9)
    gather = cl.collective("all_gather", act, 8, 1).seconds
    assert gather == pytest.approx(7 / 8 * act / cl.bus_bandwidth(8, 1) + 1e-6 * (8.4 + 7 * 3.4))
    assert sends(split) == pytest.approx(6 * (act / 8 / link + start + gather), rel=1e-9)
    sp = Layout(tp=8, pp=4, dp=2, micro_batch=1, recompute="full", schedule="1f1b", sp=True)
    assert _timing(sp, pp_scatter_gather=True).step_time_s == _timing(sp).step_time_s


def test_the_options_are_fix_keys():
    assert parse_fix("p2p_blocking=true,pp_scatter_gather=yes") == {
        "p2p_blocking": True, "pp_scatter_gather": True}
    assert Implementation().p2p_blocking is False  # meshloom's sends are asynchronous
    assert Implementation(p2p_blocking=True).short() == "p2p_blocking=true"


def test_context_ring_steps_pay_a_send_start():
    """A context-parallel ring step is a send: its K, V block's bytes over the link plus NCCL's
    start and one hop (8.4 + 3.4 us over NVLink), hidden behind the ring's work on the block
    the rank already holds, less the overlap's contention charge. Backward (meshloom's ring,
    parallel/context.py): step 0 passes the bf16 block on, step 1 the fp32 accumulator of
    the block's gradients, and the last accumulator goes home after the last step, exposed.
    Worked by hand for Llama 3 8B at cp 2, one micro-batch, no recompute."""
    from meshloom.plan.compute import block_cost, rates_for
    from meshloom.plan.hardware import OVERLAP_SLOWDOWN

    shape, cl, seq = PRESETS["llama3-8b"], make_cluster("h100", 16), 8192
    lay = Layout(cp=2, dp=8, micro_batch=1, zero=1, recompute="none")
    t = step_time(shape, lay, cl, seq, 8)
    blk = block_cost(shape, lay, rates_for(cl), seq, 2, True, Implementation())
    kv = 2 * (seq // 2) * shape.kv_dim * 2
    link, start = cl.link_bandwidth(2, 1), 1e-6 * (8.4 + 3.4)

    def exposed(comm, compute):
        return max(0.0, comm - compute) + OVERLAP_SLOWDOWN * min(comm, compute)

    fwd = exposed(kv / link + start, blk.ring.fwd / 2)
    bwd = (exposed(kv / link + start, blk.ring.bwd / 2)
           + exposed(2 * kv / link + start, blk.ring.bwd / 2) + 2 * kv / link + start)
    assert t.cp == pytest.approx(shape.layers * (fwd + bwd), rel=1e-12)
    assert cl.send_latency(2, 1) == pytest.approx(11.8e-6, rel=1e-12)


def test_a_tied_table_split_over_the_ends_is_summed_once_a_step():
    """A token table tied to the head, with the two on the first and the last pipeline stage:
    one all-reduce of its V x h gradient (at the gradient's bytes) between those two ranks
    after the backward, on the critical path; across nodes it runs on the network. Nothing
    without a pipeline or without tying (tests/test_pipeline.py counts meshloom's own)."""
    from dataclasses import replace

    shape = PRESETS["llama3-1b"]
    assert shape.tied
    lay = Layout(pp=2, dp=4, zero=1, micro_batch=1)

    def run(model, layout, per_node=8):
        return step_time(model, layout, make_cluster("h100", 8, per_node), 2048, 32)
    t = run(shape, lay)
    pp = t.detail["comm_s"]["pp"]
    cluster = make_cluster("h100", 8)
    far = 4  # stage 1's rank 0 is dp x cp x tp = 4 ranks on
    want = cluster.collective("all_reduce", shape.vocab * shape.hidden * 2, 2, far).seconds
    assert pp["ops"]["tied_table_all_reduce"] == pytest.approx(want)
    assert pp["calls"]["tied_table_all_reduce"]["calls"] == 1
    untied = run(replace(shape, tied=False), lay)
    assert "tied_table_all_reduce" not in untied.detail["comm_s"]["pp"].get("ops", {})
    assert t.pp - untied.pp == pytest.approx(want)
    assert t.step_time_s == pytest.approx(sum(t.breakdown().values()))
    assert "tied_table_all_reduce" not in run(shape, Layout(dp=8, zero=1)).detail["comm_s"][
        "pp"].get("ops", {})
    # four GPUs a node: the two ends sit on different nodes, the sum crosses the network
    split = run(shape, lay, 4).detail["comm_s"]["pp"]["ops"]["tied_table_all_reduce"]
    assert split > 3 * want
