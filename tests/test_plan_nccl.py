"""NCCL's algorithm and protocol choice (plan/nccl.py), worked by hand from tuning.cc's
constants: which pair a call runs with, its start and its bytes' time."""

from __future__ import annotations

import math

import pytest

from meshloom.plan import PlanError
from meshloom.plan.hardware import LINK_EFFICIENCY, make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.models import PRESETS
from meshloom.plan.timing import step_time

H100 = make_cluster("h100", 1024)
NVLINK = 450 * LINK_EFFICIENCY  # GB/s, the Simple ring's bus bandwidth inside an H100 node


def us(call) -> tuple[float, float]:
    return 1e6 * call.seconds, 1e6 * call.start


def test_a_small_all_reduce_inside_a_node_runs_ll():
    """1 KB over 8 NVLink ranks: LL's 6.6 us start and 0.6 us a step beat LL128 (14.0 + 1.9)
    and Simple (8.4 + 3.4); its bandwidth is a quarter of the ring's, capped at 87.7 GB/s
    (Hopper, one node); the tree (a chain in a node) starts in 6.8 + 2 x 7 x 0.6."""
    c = H100.collective("all_reduce", 1e3, 8, 1)
    assert c.name == "ring/LL"
    ll_bus = min(87.7, NVLINK / 4)
    assert us(c) == pytest.approx((6.6 + 14 * 0.6 + 1e3 / (ll_bus * 8 / 14) * 1e-3,
                                   6.6 + 14 * 0.6))
    simple = H100.collective("all_reduce", 1e3, 8, 1, "simple")
    assert simple.name == "ring/Simple"
    assert us(simple)[1] == pytest.approx(8.4 + 14 * 3.4)


def test_mid_sized_calls_run_ll128_and_large_ones_simple():
    """8 MB over 8 NVLink ranks: LL128 (14.0 + 14 x 1.9 us, 0.92 of the bandwidth) beats
    Simple (8.4 + 14 x 3.4 us); at 1 GB the 8% of bandwidth outweighs the 15 us."""
    nbytes = 8e6
    want_ll128 = 14.0 + 14 * 1.9 + 2 * 7 / 8 * nbytes / (0.92 * NVLINK) * 1e-3
    want_simple = 8.4 + 14 * 3.4 + 2 * 7 / 8 * nbytes / NVLINK * 1e-3
    assert want_ll128 < want_simple
    c = H100.collective("all_reduce", nbytes, 8, 1)
    assert c.name == "ring/LL128" and us(c)[0] == pytest.approx(want_ll128)
    big = H100.collective("all_reduce", 1e9, 8, 1)
    assert big.name == "ring/Simple"
    assert us(big)[0] == pytest.approx(8.4 + 14 * 3.4 + 2 * 7 / 8 * 1e9 / NVLINK * 1e-3)


def test_an_all_reduce_across_many_nodes_takes_the_tree():
    """64 ranks, one a node (a data-parallel group 8 ranks apart), 1 MB: the ring crosses the
    network on every one of its 126 steps; the tree on 2 x log2(64) = 12 hops. The tree's
    bandwidth: 0.92 of the ring's, capped per channel at 36.0 GB/s (Hopper, > 2 nodes) against
    the channel's 50 GB/s port; with LL128 120/128 of that, capped at 29.0 / 50; half of it
    is the algorithm's bandwidth, and at 1 MB (64 B x 2^14) NCCL corrects it by 0.6."""
    nbytes = 1e6
    bus = 50 * LINK_EFFICIENCY  # one port per node
    tree = bus * min(0.92, 36.0 / 50)
    ll128 = min(tree * 120 / 128, bus * 29.0 / 50)
    want = 14.0 + 2 * 6 * 8.5 + nbytes / (ll128 * 0.5 * 0.6) * 1e-3
    c = H100.collective("all_reduce", nbytes, 64, 8)
    assert c.name == "tree/LL128" and us(c)[0] == pytest.approx(want)
    ring = H100.collective("all_reduce", nbytes, 64, 8, "simple")
    assert ring.seconds > 3 * c.seconds
    # Gathers and reduce-scatters have no tree.
    assert H100.collective("all_gather", nbytes, 64, 8).algorithm == "ring"


def test_ll128_needs_nvlink_and_a_known_generation():
    """NCCL enables LL128 by default only on NVLink nodes of Volta, Ampere and Hopper: a
    PCIe node (the Titan RTX preset, a Turing part) never uses it."""
    pci = make_cluster("titan-rtx-24g", 2)
    for nbytes in (1e3, 1e5, 1e6, 1e7, 1e8):
        assert pci.collective("all_reduce", nbytes, 2, 1).protocol != "LL128"
    assert H100.collective("all_gather", 4e6, 8, 1).protocol == "LL128"


def test_the_cpu_posts_each_network_step():
    """Across nodes a ring step costs at least the CPU's posting overhead, x3 with Simple:
    1 us on Intel (the DGX H100's Xeons), 2 us on AMD (the DGX A100's EPYCs): an A100
    gather over two nodes of 8 pays 6.0 us for each NVLink step, not 3.4."""
    a100 = make_cluster("a100-80g", 16)
    start = 1e6 * a100.collective("all_gather", 1e3, 16, 1, "simple").start
    assert start == pytest.approx(8.4 + 14 * 6.0 + 1 * 14.0)
    h100 = 1e6 * make_cluster("h100", 16).collective("all_gather", 1e3, 16, 1, "simple").start
    assert h100 == pytest.approx(8.4 + 14 * 3.4 + 1 * 14.0)


def test_a_large_ring_all_reduce_across_nodes_pays_the_plateau():
    """A multi-node Simple ring all-reduce of more than 64 bytes per channel and rank starts
    1.4x later (Ampere and later); inside a node, or for a gather, it does not."""
    a100 = make_cluster("a100-80g", 16)
    small = a100.collective("all_reduce", 1e3, 16, 1, "simple").start
    large = a100.collective("all_reduce", 1e9, 16, 1, "simple").start
    assert large == pytest.approx(1.4 * small)
    assert H100.collective("all_reduce", 1e9, 8, 1, "simple").start == pytest.approx(
        H100.collective("all_reduce", 1e3, 8, 1, "simple").start)


@pytest.mark.parametrize("gpu", ["h100", "a100-80g", "titan-rtx-24g"])
def test_the_choice_is_never_slower_than_the_simple_ring(gpu):
    cl = make_cluster(gpu, 256)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for size, stride in ((2, 1), (8, 1), (16, 1), (32, 8), (256, 1)):
            if size * stride > cl.n_gpus:
                continue
            for nbytes in (10 ** k for k in range(2, 11)):
                auto = cl.collective(op, nbytes, size, stride).seconds
                simple = cl.collective(op, nbytes, size, stride, "simple").seconds
                assert 0 < auto <= simple
                # the bytes' time never beats the Simple ring's bandwidth
                factor = (2 if op == "all_reduce" else 1) * (size - 1) / size
                assert auto >= factor * nbytes / cl.bus_bandwidth(size, stride) * (1 - 1e-12)


def test_a_step_prices_its_collectives_with_the_choice():
    """A tensor-parallel layout of a small model: its per-layer all-reduces of a few hundred
    kilobytes run LL or LL128, so the step is shorter than with the Simple ring only; the
    explain breakdown reports the starts of the pair that ran."""
    shape, cl = PRESETS["llama3-1b"], make_cluster("h100", 8)
    lay = Layout(tp=8, micro_batch=1)
    auto = step_time(shape, lay, cl, 512, 1)
    simple = step_time(shape, lay, cl, 512, 1, impl=Implementation(nccl_protocols="simple"))
    assert auto.tp < simple.tp
    assert auto.step_time_s - auto.tp == pytest.approx(simple.step_time_s - simple.tp)
    payload = 512 * shape.hidden * 2
    one = cl.collective("all_reduce", payload, 8, 1)
    assert one.protocol in ("LL", "LL128")
    calls = auto.detail["comm_s"]["tp"]["calls"]["collectives"]
    assert calls["fixed_s"] == pytest.approx(calls["calls"] * one.start)
    assert calls["nccl"] == one.name
    simple_calls = simple.detail["comm_s"]["tp"]["calls"]["collectives"]
    assert simple_calls["nccl"] == "ring/Simple"


def test_explain_names_the_pair_each_collective_ran_with():
    """A ZeRO-1 layout across nodes: --explain names, per collective, the algorithm and
    protocol of its calls (the 25 MiB buckets over 2 nodes: LL128)."""
    from meshloom.plan.explain import explain
    from meshloom.plan.search import evaluate

    shape, cl = PRESETS["llama3-8b"], make_cluster("h100", 16)
    c = evaluate(shape, Layout(dp=16, zero=1, micro_batch=1), cl, 4096, 16)
    dp = c.timing.detail["comm_s"]["dp"]["calls"]
    bucket = cl.collective("reduce_scatter", 25 * 2**20, 16, 1)
    assert bucket.name == "ring/LL128"
    assert "ring/LL128" in dp["reduce_scatter"]["nccl"].split(", ")
    text = explain(c)
    assert f"({dp['reduce_scatter']['nccl']})" in text


def test_nccl_protocols_is_a_fix_key():
    assert parse_fix("nccl_protocols=simple") == {"nccl_protocols": "simple"}
    assert parse_fix("nccl_protocols=auto") == {"nccl_protocols": "auto"}
    with pytest.raises(PlanError, match="nccl_protocols=ll must be one of auto, simple"):
        parse_fix("nccl_protocols=ll")


def test_tree_correction_covers_64_bytes_to_256_mb():
    from meshloom.plan.nccl import TREE_CORRECTION
    assert all(len(row) == 23 for row in TREE_CORRECTION)  # 64 B x 2^0 .. 2^22
    assert math.isclose(TREE_CORRECTION[2][14], 0.5)


def test_the_crossovers_docs_quote():
    """docs/plan.md's figures: on 8 H100s NCCL's model runs an all-reduce with LL up to about
    1.7 MB and LL128 up to about 37 MB; a 25 MiB reduce-scatter over 32 ranks in 4 nodes runs
    LL128 in 184 us where the Simple ring takes 223."""
    pair = {nbytes: H100.collective("all_reduce", nbytes, 8, 1).name
            for nbytes in (1.6e6, 1.8e6, 36e6, 38e6)}
    assert pair == {1.6e6: "ring/LL", 1.8e6: "ring/LL128", 36e6: "ring/LL128",
                    38e6: "ring/Simple"}
    cl = make_cluster("h100", 64)
    auto = cl.collective("reduce_scatter", 25 * 2**20, 32, 1)
    simple = cl.collective("reduce_scatter", 25 * 2**20, 32, 1, "simple")
    assert auto.name == "ring/LL128"
    assert (round(1e6 * auto.seconds), round(1e6 * simple.seconds)) == (184, 223)


def test_committed_choices_are_what_the_code_prices():
    """benchmarks/results/planner/nccl_choice.json, which docs/plan.md quotes, is what
    `python benchmarks/nccl_choice.py` writes from the code now."""
    import json

    from conftest import load_benchmark

    nc = load_benchmark("nccl_choice")
    committed = json.loads(nc.OUT.read_text())
    assert committed["cases"] == nc.cases()
    assert committed["h100_node_all_reduce_switches"] == nc.switches()
    assert [s["pair"] for s in committed["h100_node_all_reduce_switches"]] == [
        "ring/LL", "ring/LL128", "ring/Simple"]
