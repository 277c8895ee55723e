"""`--nvlink-mesh N`: a node whose N GPUs are wired to each other with no NVSwitch (a four-GPU
SXM board). Each pair gets 1/(N - 1) of a GPU's NVLink, and a ring over k of the board's GPUs
at most (k - 1)/(N - 1) of it (plan/hardware.py `Cluster.nvlink_mesh`)."""

from __future__ import annotations

import json

import pytest

from meshloom.plan import PlanError
from meshloom.plan.hardware import GB, LINK_EFFICIENCY, make_cluster
from meshloom.plan.layout import Layout
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate


def test_a_pair_gets_a_third_of_the_links_and_the_whole_board_all_of_them():
    switched, mesh = make_cluster("h200", 4, 4), make_cluster("h200", 4, 4, nvlink_mesh=4)
    full = 450.0 * GB * LINK_EFFICIENCY
    assert switched.bus_bandwidth(2, 1) == switched.bus_bandwidth(4, 1) == pytest.approx(full)
    assert mesh.bus_bandwidth(2, 1) == pytest.approx(full / 3)
    assert mesh.bus_bandwidth(2, 2) == pytest.approx(full / 3)  # a strided pair: one pair's links
    assert mesh.bus_bandwidth(3, 1) == pytest.approx(2 * full / 3)
    assert mesh.bus_bandwidth(4, 1) == pytest.approx(full)
    assert mesh.link_bandwidth(2, 1) == pytest.approx(full / 3)
    assert switched.link_bandwidth(2, 1) == pytest.approx(full)


def test_across_nodes_the_ring_takes_the_slower_of_the_board_and_the_ports():
    """A group of 2 per node over 2 nodes: its ring's hops inside a node use one pair's links
    (150 GB/s one way), its network hops two ports (2 x 50): the ports decide; with slow
    NVLink (a 60 GB/s override) the board does."""
    mesh = make_cluster("h200", 8, 4, nvlink_mesh=4)
    assert mesh.bus_bandwidth(4, 2) == pytest.approx(100.0 * GB * LINK_EFFICIENCY)
    slow = make_cluster("h200", 8, 4, intra_gbps=60.0, nvlink_mesh=4)
    assert slow.bus_bandwidth(4, 2) == pytest.approx(20.0 * GB * LINK_EFFICIENCY)


def test_tensor_parallel_pays_for_the_pair_and_nothing_else_moves():
    shape = PRESETS["llama3-8b"]

    def step(lay: Layout, mesh: int):
        cluster = make_cluster("h200", 4, 4, nvlink_mesh=mesh)
        return evaluate(shape, lay, cluster, 4096, 16).timing

    tp2 = Layout(tp=2, dp=2, zero=3, sp=True, micro_batch=4)
    assert step(tp2, 4).tp > step(tp2, 0).tp > 0
    assert step(tp2, 4).compute == pytest.approx(step(tp2, 0).compute, rel=1e-12)
    tp4 = Layout(tp=4, sp=True, micro_batch=4)
    assert step(tp4, 4).tp == pytest.approx(step(tp4, 0).tp)  # the whole board: every link


@pytest.mark.parametrize("mesh, per_node", [(1, 4), (4, 8), (8, 4)])
def test_a_mesh_that_is_not_one_board_per_node_is_a_one_line_error(mesh, per_node):
    with pytest.raises(PlanError, match=f"--nvlink-mesh={mesh}: .* must equal --gpus-per-node "
                                        f"\\({per_node}\\)$"):
        make_cluster("h200", 8, per_node, nvlink_mesh=mesh)


def test_the_flag_plans_and_says_so(capsys):
    from meshloom.commands import main
    args = ["plan", "--model", "llama3-8b", "--gpu", "h200", "--gpus", "4", "--gpus-per-node",
            "4", "--seq", "4096", "--global-batch", "32", "--top", "1", "--fix", "tp=2"]
    assert main([*args, "--nvlink-mesh", "4"]) == 0
    out = capsys.readouterr().out
    assert "(4 per node, NVLink wired GPU to GPU on boards of 4)" in out
    assert main([*args, "--json"]) == 0
    switched = json.loads(capsys.readouterr().out)
    assert main([*args, "--json", "--nvlink-mesh", "4"]) == 0
    mesh = json.loads(capsys.readouterr().out)
    assert mesh["cluster"]["nvlink_mesh"] == 4 and switched["cluster"]["nvlink_mesh"] == 0
    assert mesh["candidates"][0]["step_time_s"] > switched["candidates"][0]["step_time_s"]
    assert main(["plan", "--model", "gpt2", "--gpus", "4", "--nvlink-mesh", "4"]) == 2
    assert "--nvlink-mesh=4" in capsys.readouterr().err
