"""The real launchers: `meshloom train` and `torchrun -m meshloom.train` (~10 s each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

TINY = str(ROOT / "configs" / "tiny.toml")
KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "comm_bytes",
        "step_time_s"}


def _run(cmd, cwd, timeout=240):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_meshloom_train_two_ranks(tmp_path, token_cache):
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "meshloom.cli", "train", TINY, "--nproc", "2",
                 "--set", "train.steps=4", "--set", "train.eval_every=2",
                 "--set", "train.sample_tokens=20", "--set", f"run.dir={run_dir}",
                 "--set", f"data.cache_dir={token_cache}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "mesh: pp=1 x dp_replicate=1 x dp_shard=2" in out
    assert "rank   1  dp_shard 1/2" in out
    assert "eval loss" in out and "--- sample ---" in out
    assert f"run directory: {run_dir}" in out
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(KEYS <= set(r) for r in records)
    assert records[-1]["comm_bytes"]["dp"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["peak_mem_bytes_per_rank"]) == 2
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "checkpoints" / "step_0000004" / "meta.json").is_file()


def test_torchrun_module_entry(tmp_path, token_cache):
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", "-m", "meshloom.train", TINY,
                 "--set", "train.steps=2", "--set", f"run.dir={run_dir}",
                 "--set", f"data.cache_dir={token_cache}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_records(run_dir)) == 2


def test_single_process_and_resume_via_cli(tmp_path, token_cache):
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "meshloom.cli", "train", TINY, "--set", f"run.dir={run_dir}",
            "--set", f"data.cache_dir={token_cache}"]
    first = _run(base + ["--set", "train.steps=2"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _run(base + ["--set", "train.steps=2"], tmp_path)
    assert again.returncode == 2 and "pass --resume" in again.stderr
    more = _run(base + ["--set", "train.steps=3", "--resume"], tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from" in more.stdout
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3]


def test_failing_rank_is_named_and_exits_1(tmp_path, token_cache):
    """A rank that raises: the user gets one line per failed rank naming it and the error,
    the traceback in the run folder, exit status 1."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHLOOM_FAULT": "raise:1:1"}
    proc = subprocess.run([sys.executable, "-m", "meshloom.cli", "train", TINY, "--nproc", "2",
                           "--set", "train.steps=3", "--set", f"run.dir={run_dir}",
                           "--set", f"data.cache_dir={token_cache}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 1
    assert "meshloom: rank 1 failed: RuntimeError: fault injected by MESHLOOM_FAULT at step 2" \
        in proc.stderr
    assert "meshloom: training failed on rank" in proc.stderr
    assert (run_dir / "error_rank1.txt").is_file()


def test_meshloom_train_tensor_parallel(tmp_path, token_cache):
    """The CLI path of a tensor-parallel run: drawing of the slices, training, a sample generated
    from vocabulary-split logits with sequence parallel switched off, tp bytes in the metrics."""
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "meshloom.cli", "train", TINY, "--nproc", "2",
                 "--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true",
                 "--set", "train.steps=3", "--set", "train.eval_every=0",
                 "--set", "train.sample_tokens=20", "--set", f"run.dir={run_dir}",
                 "--set", f"data.cache_dir={token_cache}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "rank   1  tp 1/2" in out and "tp slice 1/2 of layers 0-3: heads 2-3 of 4" in out
    assert "--- sample ---" in out
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["comm_bytes"]["tp"] > 0 and "dp" not in records[-1]["comm_bytes"]


def test_meshloom_train_pipeline_and_report(tmp_path, token_cache):
    """A pipelined run through the CLI (1F1B, sample generated through the stages), then
    `meshloom report` on its folder: the timeline picture and the bubble table."""
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "meshloom.cli", "train", TINY, "--nproc", "2",
                 "--set", "parallel.pp=2", "--set", "parallel.pp_microbatches=4",
                 "--set", "train.steps=3", "--set", "train.eval_every=0",
                 "--set", "train.sample_tokens=10", "--set", f"run.dir={run_dir}",
                 "--set", f"data.cache_dir={token_cache}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stage 1: layers" in proc.stdout and "--- sample ---" in proc.stdout
    records = _records(run_dir)
    assert records[-1]["comm_bytes"]["pp"] > 0
    rep = _run([sys.executable, "-m", "meshloom.cli", "report", str(run_dir)], tmp_path)
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert "bubble" in rep.stdout and "1f1b" in rep.stdout
    assert (run_dir / "pipeline" / "timeline.png").stat().st_size > 1000
