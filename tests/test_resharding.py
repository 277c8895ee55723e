"""Resharding: a checkpoint saved under one layout resumes under another (dp_shard 2 x tp 2 ->
pp 2 x dp_replicate 2 -> 1 process) with the optimizer state, LR schedule and data position, and
the resumed losses match the uninterrupted run's; `meshloom checkpoint info` describes it."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import WELL_CONDITIONED, tiny_config
from dist_harness import run_ranks

from meshloom import checkpoint
from meshloom.checkpoint import read_tensors
from meshloom.commands import main as cli_main
from meshloom.train import train

STEPS = 6
COMMON = [f"train.steps={STEPS}", "train.eval_every=0", "train.sample_tokens=0",
          "run.checkpoint_every=2", "run.keep_checkpoints=5", "train.warmup_steps=2",
          *WELL_CONDITIONED]
LAYOUT_A = ["parallel.dp_shard=2", "parallel.tp=2", "parallel.zero_stage=3"]
LAYOUT_B = ["parallel.pp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1",
            "parallel.pp_microbatches=4"]


def _job(run_dir, cache, overrides, resume):
    cfg = tiny_config(run_dir, cache, *COMMON, *overrides)
    r = train(cfg, resume=resume)
    return {"losses": r.losses, "start": r.summary["start_step"]}


def _cut(src, dst, keep_up_to: int):
    """A copy of a run as if it had died right after the step-`keep_up_to` checkpoint."""
    shutil.copytree(src, dst)
    for c in checkpoint.complete_checkpoints(dst):
        if int(c.name.removeprefix("step_")) > keep_up_to:
            shutil.rmtree(c)


def _close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def chain(tmp_path_factory, token_cache):
    """Layout A uninterrupted; then A's step-2 checkpoint resumed under layout B; then B's step-4
    checkpoint resumed in one process."""
    root = tmp_path_factory.mktemp("reshard")
    full = run_ranks(_job, 4, root / "a", token_cache, LAYOUT_A, False)[0]
    _cut(root / "a", root / "b", 2)
    b = run_ranks(_job, 4, root / "b", token_cache, LAYOUT_B, True)
    _cut(root / "b", root / "c", 4)
    c = run_ranks(_job, 1, root / "c", token_cache, [], True)[0]
    return {"root": root, "full": full, "b": b[-1], "c": c}  # b's last rank has the loss


def test_resumed_losses_match_across_layouts(chain):
    full, b, c = chain["full"], chain["b"], chain["c"]
    assert b["start"] == 2 and c["start"] == 4
    assert _close(b["losses"], full["losses"][2:]), (b["losses"], full["losses"][2:])
    assert _close(c["losses"], full["losses"][4:]), (c["losses"], full["losses"][4:])
    # The losses still move: the optimizer state and LR schedule came along, not just weights.
    assert full["losses"][-1] < full["losses"][0]


def test_final_weights_and_optimizer_state_match(chain):
    root = chain["root"]
    final_a = checkpoint.latest_checkpoint(root / "a")
    final_c = checkpoint.latest_checkpoint(root / "c")
    assert final_a.name == final_c.name == f"step_{STEPS:07d}"
    for prefix in ("model/", "optim/"):
        a, c = read_tensors(final_a, prefix), read_tensors(final_c, prefix)
        assert a.keys() == c.keys() and len(a) > 10
        for k in a:
            # Each tensor against its own largest element (observed <= 5.3e-7): AdamW's second
            # moments are ~1e-7, where a fixed atol of 1e-6 saw nothing.
            diff, scale = float((a[k] - c[k]).abs().max()), float(c[k].abs().max())
            assert diff <= 1e-5 * scale, f"{prefix}{k}: max |diff| {diff:.3g}, largest {scale:.3g}"


def _resume_with_zeroed_moments(run_dir, cache):
    import torch.distributed.checkpoint as dcp

    cfg = tiny_config(run_dir, cache, *COMMON, *LAYOUT_A)
    orig = dcp.load

    def load_without_moments(state, storage_reader=None, **kw):
        orig(state, storage_reader=storage_reader, **kw)
        for k, v in state.items():
            if k.startswith("optim/") and k != "optim/step":
                for t in ([s.tensor for s in v.local_shards()]
                          if hasattr(v, "local_shards") else [v]):
                    t.zero_()

    dcp.load = load_without_moments
    try:
        return train(cfg, resume=True).losses
    finally:
        dcp.load = orig


def test_resume_without_optimizer_state_would_differ(chain, token_cache, tmp_path):
    """Control: the comparison above can fail. Dropping the AdamW moments from the step-2
    checkpoint (so they restart at zero) changes the resumed losses beyond the tolerance."""
    ckpt = checkpoint.complete_checkpoints(chain["root"] / "a")[0]
    state = read_tensors(ckpt, "")
    assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in state)
    _cut(chain["root"] / "a", tmp_path / "z", 2)
    losses = run_ranks(_resume_with_zeroed_moments, 4, tmp_path / "z", token_cache)[0]
    assert not _close(losses, chain["full"]["losses"][2:])


def test_checkpoint_info_names_layout_and_contents(chain, capsys):
    a = chain["root"] / "a"
    assert cli_main(["checkpoint", "info", str(a)]) == 0
    out = capsys.readouterr().out
    assert "3 checkpoints" in out and "step_0000006" in out
    assert "dp_shard 2 x tp 2, ZeRO-3" in out and "written by 4 ranks" in out
    assert "every file matches manifest.json" in out
    b_ckpt = checkpoint.complete_checkpoints(chain["root"] / "b")[1]  # [0] is A's step 2
    assert cli_main(["checkpoint", "info", str(b_ckpt), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["checkpoints"][0]
    assert d["layout"]["pp"] == 2 and d["layout"]["dp_replicate"] == 2
    assert d["step"] == 4 and d["intact"] and d["rng_files"] == 4
    assert d["tensors"]["model/tok_embeddings.weight"]["shape"][1] == 64


def test_checkpoint_info_bad_input(tmp_path, capsys):
    assert cli_main(["checkpoint", "info", str(tmp_path / "nope")]) == 2
    assert cli_main(["checkpoint", "info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("meshloom: error:") == 2 and "Traceback" not in err
