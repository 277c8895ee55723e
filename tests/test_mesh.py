"""ParallelDims arithmetic, the layout drawing, and real groups per axis."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT
from dist_harness import run_ranks

from meshloom import comm
from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims, draw_layout


def test_coordinates_tp_innermost():
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert dims.world_size == 8
    assert dims.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert dims.coordinates(1)["tp"] == 1 and dims.coordinates(2)["dp_shard"] == 1
    assert dims.coordinates(4)["pp"] == 1
    # Groups of an axis partition the world, and tp groups are neighbouring ranks.
    for axis in ("pp", "dp_shard", "tp", "dp", "dp_cp", "world"):
        groups = dims.group_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all(len(g) == dims.degree(axis) for g in groups)
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_resolve_infers_dp_shard_and_rejects_mismatch():
    assert ParallelDims.resolve(8, tp=2).dp_shard == 4
    assert ParallelDims.resolve(8, dp_replicate=2, dp_shard=2, tp=2).world_size == 8
    with pytest.raises(ValueError, match="parallel.dp_shard=-1 cannot be inferred"):
        ParallelDims.resolve(6, tp=4)
    with pytest.raises(ValueError, match="but 4 processes"):
        ParallelDims.resolve(4, dp_shard=2)
    with pytest.raises(ValueError, match="parallel.tp=0"):
        ParallelDims.resolve(4, tp=0)


def test_drawing_groups_ranks_by_node():
    text = draw_layout(ParallelDims(dp_replicate=2, dp_shard=2), ranks_per_node=2,
                       backend="gloo", device="cpu")
    assert text.splitlines()[0].startswith("mesh: pp=1 x dp_replicate=2 x dp_shard=2")
    assert "node 0" in text and "node 1" in text
    assert "rank   3  dp_replicate 1/2  dp_shard 1/2" in text
    assert "batch part 3" in text


def _groups_job(world):
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = Mesh(ParallelDims(dp_replicate=2, dp_shard=2), rank, "cpu", CommCounter())
    out = {}
    for axis in ("dp_replicate", "dp_shard", "dp", "tp"):
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, mesh, axis)
        out[axis] = t.item()
    out["bytes"] = dict(mesh.counter.bytes)
    out["coord"] = (mesh.coord("dp_replicate"), mesh.coord("dp_shard"), mesh.coord("dp"))
    return out


def test_mesh_groups_reduce_over_the_right_ranks():
    res = run_ranks(_groups_job, 4, 4)
    # ranks: 0=(r0,s0) 1=(r0,s1) 2=(r1,s0) 3=(r1,s1)
    assert [r["dp_shard"] for r in res] == [1, 1, 5, 5]
    assert [r["dp_replicate"] for r in res] == [2, 4, 2, 4]
    assert all(r["dp"] == 6 for r in res)
    assert all(r["tp"] == r_i for r_i, r in enumerate(res))  # size-1 axis: untouched
    assert res[3]["coord"] == (1, 1, 3)
    # Four bytes per reduce on each real axis; nothing recorded for the size-1 tp axis.
    assert res[0]["bytes"] == {("dp_replicate", "all_reduce"): 4, ("dp_shard", "all_reduce"): 4,
                               ("dp", "all_reduce"): 4}


def test_drawing_shows_what_each_shard_holds():
    text = draw_layout(ParallelDims(dp_replicate=2, dp_shard=2), zero_stage=3)
    assert "rank   1  dp_replicate 0/2  dp_shard 1/2" in text
    assert "shard 1/2 of params + grads + optimizer" in text


def test_drawing_shows_each_ranks_tensor_parallel_slice():
    from meshloom.models.llama import config_from_preset

    model = config_from_preset("tiny")  # 4 heads, 2 KV heads, MLP 192, vocabulary 257
    text = draw_layout(ParallelDims(dp_shard=2, tp=2), zero_stage=3, model=model,
                       sequence_parallel=True)
    lines = text.splitlines()
    r3 = lines.index(next(line for line in lines if line.startswith("    rank   3")))
    assert "dp_shard 1/2  tp 1/2" in lines[r3]
    assert "shard 1/2 of params + grads + optimizer" in lines[r3]
    assert ("tp slice 1/2 of layers 0-3: heads 2-3 of 4 (KV heads 1-1 of 2), MLP columns "
            "96-191 of 192; vocabulary rows 129-256 of 257") in lines[r3 + 1]
    assert "sequence part 1/2" in lines[r3 + 1]
    assert "heads 0-1 of 4" in text and "vocabulary rows 0-128 of 257" in text


def test_layout_command_draws_pipeline_stages(capsys):
    from meshloom.commands import main

    rc = main(["layout", str(ROOT / "configs" / "tiny.toml"), "--nproc", "4", "--set",
               "parallel.pp=2", "--set", "parallel.pp_schedule=interleaved_1f1b", "--set",
               "parallel.pp_virtual_stages=2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "stage 0: layers 0-0 + embedding; stage 2: layers 2-2" in out
    assert "stage 3: layers 3-3 + norm, head, loss" in out
