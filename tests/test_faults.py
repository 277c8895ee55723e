"""Surviving faults: damaged checkpoints, non-finite steps, preemption (SIGTERM), stalled ranks,
a rank killed with SIGKILL under --max-restarts, and safe loading of checkpoint metadata."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, tiny_config
from dist_harness import run_ranks
from fault_injection import env, injected

from meshloom import checkpoint
from meshloom.checkpoint import CheckpointError, read_metadata, read_tensors
from meshloom.commands import main as cli_main
from meshloom.faults import axis_groups, stall_message, waiting_for
from meshloom.train import NonFiniteError, train

TINY = str(ROOT / "configs" / "tiny.toml")
QUIET = ["train.eval_every=0", "train.sample_tokens=0"]


def _train(run_dir, cache, overrides, resume=False, fault=""):
    cfg = tiny_config(run_dir, cache, *QUIET, *overrides)
    try:
        with injected(fault):
            r = train(cfg, resume=resume)
    except NonFiniteError as e:
        return {"error": str(e)}
    return {"losses": r.losses, "start": r.summary["start_step"],
            "preempted": r.summary.get("preempted_at_step")}


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(run_dir) -> list[int]:
    return [int(c.name.removeprefix("step_")) for c in checkpoint.complete_checkpoints(run_dir)]


# ---------------------------------------------------------------- damaged checkpoints


@pytest.fixture
def four_checkpoints(tmp_path, token_cache):
    run_ranks(_train, 1, tmp_path / "run", token_cache,
              ["train.steps=4", "run.checkpoint_every=1", "run.keep_checkpoints=3"])
    return tmp_path / "run"


def _data_file(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_damaged_checkpoint_is_named_and_resume_falls_back(four_checkpoints, token_cache,
                                                         damage, capfd):
    run = four_checkpoints
    assert _steps(run) == [2, 3, 4]  # the last 3 kept, older ones removed
    newest = checkpoint.latest_checkpoint(run)
    f = _data_file(newest)
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    else:
        f.unlink()
    assert cli_main(["checkpoint", "info", str(newest)]) == 1
    out = capfd.readouterr().out
    assert "DAMAGED" in out and f.name in out
    res = run_ranks(_train, 1, run, token_cache,
                    ["train.steps=5", "run.checkpoint_every=1", "run.keep_checkpoints=3"], True)
    assert res[0]["start"] == 3  # step 4 was damaged: resumed from step 3
    out = capfd.readouterr().out  # the rank's own output (a forked process)
    assert f"{newest} is damaged" in out and "falling back to the previous one" in out
    assert _steps(run)[-1] == 5


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(four_checkpoints, token_cache):
    for c in checkpoint.complete_checkpoints(four_checkpoints):
        _data_file(c).write_bytes(b"garbage")
    with pytest.raises(Exception, match="no intact checkpoint"):
        run_ranks(_train, 1, four_checkpoints, token_cache, ["train.steps=6"], True)


def test_manifest_lists_every_file_with_size_and_checksum(four_checkpoints):
    ckpt = checkpoint.latest_checkpoint(four_checkpoints)
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = {p.name for p in ckpt.iterdir()} - {"manifest.json", "meta.json"}
    assert set(manifest) == on_disk and ".metadata" in manifest
    assert all(len(v["sha256"]) == 64 and v["bytes"] == (ckpt / k).stat().st_size
               for k, v in manifest.items())


def test_metadata_is_never_unpickled_blindly(four_checkpoints, tmp_path):
    ckpt = checkpoint.latest_checkpoint(four_checkpoints)
    assert read_metadata(ckpt).state_dict_metadata  # the genuine index reads fine
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="refusing to load"):
        read_metadata(ckpt)
    assert not marker.exists()


def test_rng_files_load_with_weights_only(four_checkpoints):
    rng = torch.load(checkpoint.latest_checkpoint(four_checkpoints) / "rng_rank0.pt",
                     weights_only=True)
    assert rng["torch"].dtype == torch.uint8


# ---------------------------------------------------------------- non-finite steps


# "fused": the clip and the skip ride in the fused AdamW kernel (optim.guarded_step), what a
# GPU run does; "foreach": the host decides before the step. Rank 0 alone goes bad.
OPTIMIZERS = ["train.optimizer_impl=foreach", "train.optimizer_impl=fused"]


@pytest.mark.parametrize("impl", OPTIMIZERS)
def test_nonfinite_gradients_stop_without_writing_a_checkpoint(tmp_path, token_cache, impl):
    res = run_ranks(_train, 2, tmp_path, token_cache,
                    ["train.steps=5", "run.checkpoint_every=1", impl], fault="nan:2")
    for r in res:  # every rank stops, at the same step
        assert r["error"].startswith("step 3: the loss or gradients are not finite")
        assert "last checkpoint: step_0000002" in r["error"]
    assert _steps(tmp_path) == [1, 2]


@pytest.mark.parametrize("impl", OPTIMIZERS)
def test_nonfinite_step_skipped_by_config(tmp_path, token_cache, impl):
    ov = ["train.steps=4", "train.on_nonfinite=skip", impl]
    skipped = run_ranks(_train, 2, tmp_path / "skip", token_cache, ov, fault="nan:1")[0]
    clean = run_ranks(_train, 2, tmp_path / "clean", token_cache, ov)[0]
    assert len(skipped["losses"]) == 4 and skipped["losses"][0] == clean["losses"][0]
    rec = _records(tmp_path / "skip")
    assert rec[1].get("skipped") == "non-finite" and "skipped" not in rec[2]
    # Step 2 changed nothing, so step 3 sees step 2's weights again: the same loss as step 2.
    assert skipped["losses"][2] == pytest.approx(clean["losses"][1], rel=0.05)
    final = read_tensors(checkpoint.latest_checkpoint(tmp_path / "skip"))
    assert all(bool(torch.isfinite(t).all()) for t in final.values())


def _save_with_an_inf_on_rank_1(run_dir):
    from meshloom.models.llama import build_model, config_from_preset
    from meshloom.parallel import LocalGrads

    torch.distributed.init_process_group("gloo")
    from meshloom.comm import CommCounter
    from meshloom.mesh import Mesh, ParallelDims

    mesh = Mesh(ParallelDims.resolve(2), torch.distributed.get_rank(), "cpu", CommCounter())
    model = build_model(config_from_preset("tiny", vocab_size=64), 0)
    opt = torch.optim.AdamW(model.parameters())
    if torch.distributed.get_rank() == 1:
        with torch.no_grad():
            model.layers[1].attention.wq.weight[0, 0] = float("inf")
    try:
        checkpoint.save_checkpoint(run_dir, 7, model, opt, LocalGrads(model, mesh), {})
    except CheckpointError as e:
        return str(e)
    return None


def test_save_refuses_nonfinite_state(tmp_path):
    errors = run_ranks(_save_with_an_inf_on_rank_1, 2, tmp_path)
    assert all(e and "refusing to write the step-7 checkpoint" in e and "rank 1" in e
               and "layers.1.attention.wq.weight" in e for e in errors), errors
    assert not list((tmp_path / "checkpoints").glob("*step_0000007"))


def test_nonfinite_config_is_checked(capsys):
    assert cli_main(["layout", TINY, "--set", "train.on_nonfinite=ignore"]) == 2
    assert "train.on_nonfinite" in capsys.readouterr().err


# ---------------------------------------------------------------- preemption


def test_sigterm_on_one_rank_stops_all_at_the_same_step_with_a_checkpoint(tmp_path,
                                                                          token_cache):
    res = run_ranks(_train, 2, tmp_path, token_cache, ["train.steps=50"], fault="term:1:2")
    assert [r["preempted"] for r in res] == [3, 3]
    assert _steps(tmp_path) == [3]
    resumed = run_ranks(_train, 2, tmp_path, token_cache, ["train.steps=5"], True)[0]
    assert resumed["start"] == 3 and len(resumed["losses"]) == 2


def _cli(run_dir, cache, *extra, nproc=2):
    return [sys.executable, "-m", "meshloom", "train", TINY, "--nproc", str(nproc),
            "--set", f"run.dir={run_dir}", "--set", f"data.cache_dir={cache}",
            *[a for kv in QUIET for a in ("--set", kv)], *extra]


def _leftovers(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def test_sigterm_to_the_launcher_saves_and_exits_cleanly(tmp_path, token_cache):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cli(run_dir, token_cache, "--set", "train.steps=100000"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(""))
    # However long a loaded machine takes to log two steps (the run has no end of its own).
    while proc.poll() is None and not (run_dir / "metrics.jsonl").is_file():
        time.sleep(0.2)
    while proc.poll() is None and len(_records(run_dir)) < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by signal SIGTERM" in err and "Traceback" not in err
    saved = _steps(run_dir)
    assert len(saved) == 1 and saved[0] >= 2
    assert "SIGTERM received" in out
    assert not _leftovers(str(run_dir))
    # The next start resumes from it.
    done = subprocess.run(_cli(run_dir, token_cache, "--resume", "--set",
                               f"train.steps={saved[0] + 1}"),
                          capture_output=True, text=True, timeout=180, env=env(""))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"(step {saved[0]})" in done.stdout


# ---------------------------------------------------------------- stalled rank


def test_stall_message_names_the_stalled_rank():
    """Ranks 0-3 as dp 2 x tp 2 (tp groups {0,1} {2,3}, dp groups {0,2} {1,3}). Rank 3 stalled
    before its 5th tp collective: rank 2 waits in it; rank 0 and 1 wait for rank 2 on dp."""
    from meshloom.mesh import ParallelDims

    groups = axis_groups(ParallelDims.resolve(4, tp=2))
    now = time.time()

    def prog(step, axis, op, since, counts, beat=now):
        return {"step": step, "axis": axis, "op": op, "since": now - since, "beat": beat,
                "counts": counts}

    p0 = prog(4, "dp", "all_reduce", 10, {"dp": 9, "tp": 5, "world": 4})
    p1 = prog(4, "dp", "all_reduce", 10, {"dp": 9, "tp": 5, "world": 4})
    p2 = prog(4, "tp", "all_reduce", 30, {"dp": 8, "tp": 5, "world": 4})
    p3 = prog(4, "tp", "all_reduce", 20, {"dp": 8, "tp": 4, "world": 4})  # younger, yet behind
    everyone = {0: p0, 1: p1, 2: p2, 3: p3}
    msg = stall_message(2, p2, 30.0, 20.0, everyone, groups, 10.0)
    assert msg.startswith("rank 2: all_reduce on axis 'tp' at step 5 timed out after 30 s")
    assert "stalled rank: 3 (no progress for 20 s" in msg
    assert stall_message(3, p3, 20.0, 20.0, everyone, groups, 10.0).startswith(
        "rank 3 stalled: no progress for 20 s (run.timeout_s=20) at step 5")
    # Rank 0 waits on dp for rank 2, which is itself waiting: named as behind on dp.
    assert "stalled rank: 2" in stall_message(0, p0, 10.0, 20.0, everyone, groups, 10.0)
    # A rank whose heartbeat stopped (killed, frozen) is said to be not responding.
    gone = {**everyone, 3: {**p3, "beat": now - 60}}
    assert "stalled rank: 3 (not responding" in stall_message(2, p2, 30.0, 20.0, gone, groups,
                                                              10.0)
    # Only the stalled rank waits for others before exiting: for those blocked on it (rank 2 on
    # tp, rank 1 on dp; rank 0 shares no axis but the world with it), so that they name it
    # before it goes.
    assert waiting_for(3, p3, everyone, groups, 10.0) == [1, 2]
    assert waiting_for(2, p2, everyone, groups, 10.0) == []
    assert waiting_for(0, p0, everyone, groups, 10.0) == []


def test_stalled_rank_times_out_naming_rank_and_operation(tmp_path, token_cache):
    run_dir = tmp_path / "run"
    proc = subprocess.run(_cli(run_dir, token_cache, "--set", "train.steps=10",
                               "--set", "run.timeout_s=4"),
                          capture_output=True, text=True, timeout=180, env=env("stall:1:2"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("meshloom: rank")]
    waiting = [ln for ln in lines if ln.startswith("meshloom: rank 0:")]
    assert waiting and "stalled rank: 1" in waiting[0] and "on axis 'dp'" in waiting[0], \
        proc.stderr[-3000:]
    assert any(ln.startswith("meshloom: rank 1 stalled") for ln in lines), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not _leftovers(str(run_dir))


# ---------------------------------------------------------------- kill -9 and restart


def _final(run_dir, cache, overrides):
    cfg = tiny_config(run_dir, cache, *QUIET, *overrides)
    return train(cfg).losses


def test_killed_rank_is_restarted_and_the_run_finishes_identically(tmp_path, token_cache):
    """kill -9 of rank 1 in a 2-rank run with --max-restarts 2: the user reads first which rank
    died and how, then the restart and the checkpoint it resumes from, and only then the
    survivor's symptom; the run finishes bit-identical to an uninterrupted one."""
    ov = ["train.steps=6", "run.checkpoint_every=2", "train.micro_batch=4"]
    run_dir = tmp_path / "run"
    proc = subprocess.run(_cli(run_dir, token_cache, "--max-restarts", "2",
                               *[a for kv in ov for a in ("--set", kv)]),
                          capture_output=True, text=True, timeout=400, env=env("kill:1:3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("meshloom: ")]
    assert lines[:2] == ["meshloom: rank 1 was killed by SIGKILL",
                         "meshloom: restarting (1 of 2) from step_0000002"], proc.stderr[-3000:]
    assert len(lines) <= 3 and all("rank" in ln and "0" in ln for ln in lines[2:]), lines
    assert "resumed from" in proc.stdout and "(step 2)" in proc.stdout
    records = _records(run_dir)
    steps = [r["step"] for r in records]
    assert steps[-1] == 6 and 3 in steps  # step 3 ran twice: before the kill and after
    want = run_ranks(_final, 2, tmp_path / "ref", token_cache, ov)[0]
    assert [r["loss"] for r in records] == [want[st - 1] for st in steps]
    got = read_tensors(checkpoint.latest_checkpoint(run_dir), "")
    want = read_tensors(checkpoint.latest_checkpoint(tmp_path / "ref"), "")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    shutil.rmtree(tmp_path / "ref")
