"""Checkpoint/resume: a resumed run's losses and weights equal the uninterrupted run's exactly."""

from __future__ import annotations

import shutil

import torch
from conftest import tiny_config
from dist_harness import run_ranks

from meshloom import checkpoint
from meshloom.train import train


def _job(run_dir, cache, overrides, resume):
    cfg = tiny_config(run_dir, cache, "train.eval_every=0", "train.sample_tokens=0", *overrides)
    r = train(cfg, resume=resume, keep_model=True)
    return {"losses": r.losses, "start": r.summary["start_step"],
            "state": {k: v.detach().clone() for k, v in r.model.state_dict().items()}}


def test_resume_is_exact_ddp(tmp_path, token_cache):
    overrides = ["train.steps=6", "run.checkpoint_every=3", "run.keep_checkpoints=5",
                 "train.micro_batch=4"]
    full = run_ranks(_job, 2, tmp_path / "full", token_cache, overrides, False)
    ckpts = checkpoint.complete_checkpoints(tmp_path / "full")
    assert [c.name for c in ckpts] == ["step_0000003", "step_0000006"]

    # Pretend the run died after step 3: only the step-3 checkpoint survives.
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_0000006")
    resumed = run_ranks(_job, 2, tmp_path / "cut", token_cache, overrides, True)
    assert resumed[0]["start"] == 3
    assert resumed[0]["losses"] == full[0]["losses"][3:]  # bit-identical
    for name, w in full[0]["state"].items():
        assert torch.equal(resumed[0]["state"][name], w), name


def test_resume_extends_a_finished_run(tmp_path, token_cache):
    run_ranks(_job, 1, tmp_path, token_cache, ["train.steps=3"], False)
    more = run_ranks(_job, 1, tmp_path, token_cache, ["train.steps=5"], True)[0]
    assert more["start"] == 3 and len(more["losses"]) == 2
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_0000005"


def test_resume_without_checkpoint_starts_fresh(tmp_path, token_cache):
    res = run_ranks(_job, 1, tmp_path, token_cache, ["train.steps=2"], True)[0]
    assert res["start"] == 0 and len(res["losses"]) == 2


def test_incomplete_checkpoint_is_ignored_and_old_ones_pruned(tmp_path, token_cache):
    run_ranks(_job, 1, tmp_path, token_cache,
              ["train.steps=4", "run.checkpoint_every=1", "run.keep_checkpoints=2"], False)
    root = checkpoint.checkpoint_root(tmp_path)
    assert [c.name for c in checkpoint.complete_checkpoints(tmp_path)] == \
        ["step_0000003", "step_0000004"]
    assert not list(root.glob(".tmp-*"))
    # A folder that a crash left without meta.json is never taken for a resume.
    (root / "step_0000009").mkdir()
    (root / "step_0000009" / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_0000004"
    meta = checkpoint.read_meta(root / "step_0000004")
    assert meta["step"] == 4 and meta["world_size"] == 1 and meta["layout"]["dp_shard"] == 1
