"""benchmarks/pp_lists_vs_torch.py: torch's pipeline action lists beside meshloom's. Run on a
small grid in this process (a fake process group, destroyed afterwards), and the committed
result file read for what docs/pipeline.md says of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import ROOT, load_benchmark

from meshloom.parallel.pipeline_schedule import compute_lists

COMMITTED = ROOT / "benchmarks" / "results" / "cpu-2core-x86_64" / "pp_lists_vs_torch.json"


def test_pp_lists_vs_torch_small_grid(tmp_path: Path):
    bench = load_benchmark("pp_lists_vs_torch")
    out = tmp_path / "lists.json"
    result = bench.main(["--pp", "2,3", "--virtual-stages", "2,3", "--rounds", "1,2",
                         "--out", str(out)])
    assert not dist.is_initialized()  # the fake group is gone
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    # per (pp, m): zb_h1, then both interleaved schedules at each v
    assert len(rows) == 2 * 2 * (1 + 2 * 2)
    for row in rows:
        pp, v, m, sched = row["pp"], row["v"], row["microbatches"], row["schedule"]
        assert v == 1 if sched == "zb_h1" else v in (2, 3)
        ours = row["meshloom"]
        # meshloom's side is meshloom's lists, described exactly
        lists = compute_lists(sched, pp, m, v)
        assert ours["peak_chunk_activations"] == bench.peak_alive(lists)
        split = sched != "interleaved_1f1b"
        if split:  # zero bubble: 3vm + p - 1 unit ticks, p micro-batches of layers a rank
            assert ours["makespan_units"] == 3 * v * m + pp - 1
            assert ours["peak_chunk_activations"] == [v * pp] * pp
        assert ours["bubble_unit_cost"] == bench.describe(lists, pp, v)["bubble_unit_cost"]
        # torch's side ran the same actions (main raises otherwise) and was simulated whole
        assert row["torch"]["makespan_units"] > 0
        assert row["same_lists"] <= row["same_order_without_w"]
        # torch's interleaved zero-bubble lists are meshloom's with the Ws lagged
        assert row.get("same_as_lagged", True) is True
        assert ("same_as_lagged" in row) == (sched == "interleaved_zb")


def test_peak_alive_counts_forwards_until_their_freeing_pass():
    from meshloom.parallel.pipeline_schedule import Action

    bench = load_benchmark("pp_lists_vs_torch")
    acts = [Action("F", 0, 0), Action("F", 0, 1), Action("I", 0, 0), Action("F", 0, 2),
            Action("W", 0, 0), Action("B", 0, 1)]
    assert bench.peak_alive([acts]) == [3]  # I frees nothing; W and B do


def test_committed_comparison_backs_the_docs():
    """docs/pipeline.md: interleaved 1F1B's and ZB-H1's lists are torch's, action for action;
    the interleaved zero-bubble lists share torch's F and I order, unit-cost bubble and
    per-rank peaks, and with the Ws lagged are torch's; 45 cases."""
    rows = json.loads(COMMITTED.read_text())["rows"]
    assert len(rows) == 45
    for row in rows:
        ours, theirs = row["meshloom"], row["torch"]
        assert row["same_order_without_w"]
        assert row["same_lists"] == (row["schedule"] != "interleaved_zb")
        assert row.get("same_as_lagged", True) is True
        assert ours["bubble_unit_cost"] == theirs["bubble_unit_cost"]
        assert ours["peak_chunk_activations"] == theirs["peak_chunk_activations"]
    text = (ROOT / "docs" / "pipeline.md").read_text()
    assert "pp_lists_vs_torch.json" in text


def test_pp_lists_vs_torch_refuses_bad_sizes(capsys):
    bench = load_benchmark("pp_lists_vs_torch")
    for argv, says in [(["--pp", "1"], "at least 2 ranks"),
                       (["--virtual-stages", "1"], "2 or more"),
                       (["--rounds", "two"], "comma-separated positive integers")]:
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert says in capsys.readouterr().err
