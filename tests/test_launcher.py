"""The real launchers: `meshloom train` and `torchrun -m meshloom.train` (~10 s each)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import ROOT
from fault_injection import env

from meshloom.launch import RankEnd, failure_report

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
    proc = _run([sys.executable, "-m", "meshloom", "train", TINY, "--nproc", "2",
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
    base = [sys.executable, "-m", "meshloom", "train", TINY, "--set", f"run.dir={run_dir}",
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
    proc = subprocess.run([sys.executable, "-m", "meshloom", "train", TINY, "--nproc", "2",
                           "--set", "train.steps=3", "--set", f"run.dir={run_dir}",
                           "--set", f"data.cache_dir={token_cache}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, env=env("raise:1:1"))
    assert proc.returncode == 1
    lines = _said(proc.stderr)
    assert lines[0].startswith("meshloom: rank 1 failed: RuntimeError: fault injected by "
                               "MESHLOOM_FAULT at step 2"), proc.stderr[-3000:]
    assert lines[0].endswith("(exit status 1)")
    assert lines[-1] == "meshloom: training failed on rank 1"
    # After it, the survivor: its own symptom ("rank 0 ...") or, when the launcher stops it
    # before it reports one, "rank(s) 0 stopped by the launcher"; which comes first is a race.
    assert all(re.search(r"\brank(\(s\))? 0\b", ln) for ln in lines[1:-1]), lines
    assert (run_dir / "error_rank1.txt").is_file()


def _said(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("meshloom: ")]


GLOO_LOST = ("rank 0 failed: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
             "Connection closed by peer [127.0.0.1]:40613 (traceback in run/error_rank0.txt)")


def test_failure_report_puts_the_cause_first():
    """The survivors' lost-peer errors come after the rank that died and the restart line,
    however the ranks are numbered; ranks that said nothing are grouped by how they ended."""
    ends = [RankEnd(0, 1, GLOO_LOST), RankEnd(1, -9), RankEnd(2, 1, GLOO_LOST.replace(
        "rank 0", "rank 2")), RankEnd(3, -15, by_itself=False)]
    assert failure_report(ends, "restarting (1 of 2) from step_0000100") == [
        "meshloom: rank 1 was killed by SIGKILL",
        "meshloom: restarting (1 of 2) from step_0000100",
        "meshloom: " + GLOO_LOST + " (exit status 1)",
        "meshloom: " + GLOO_LOST.replace("rank 0", "rank 2") + " (exit status 1)",
        "meshloom: rank(s) 3 stopped by the launcher",
    ]
    # A survivor that said what went wrong and then hung: its line, and who ended it.
    lines = failure_report([RankEnd(1, -9), RankEnd(0, -15, GLOO_LOST, by_itself=False)])
    assert lines == ["meshloom: rank 1 was killed by SIGKILL",
                     "meshloom: " + GLOO_LOST + " (then stopped by the launcher)"]
    # An error of its own is a cause, even on a higher rank than a symptom's; a killed rank
    # comes before it; a line that names no rank gets it; ranks that said nothing, grouped.
    ends = [RankEnd(0, 1, GLOO_LOST), RankEnd(3, 1, "ValueError: bad shard"), RankEnd(2, -9),
            RankEnd(4, 3), RankEnd(5, 3)]
    assert failure_report(ends) == [
        "meshloom: rank 2 was killed by SIGKILL",
        "meshloom: rank 3 failed: ValueError: bad shard (exit status 1)",
        "meshloom: ranks 4, 5 exited with status 3",
        "meshloom: " + GLOO_LOST + " (exit status 1)",
    ]
    # Only lost peers (a network fault, say): they are all that can be said, first.
    assert failure_report([RankEnd(0, 1, GLOO_LOST)], "restarting (1 of 1) from the start") == [
        "meshloom: " + GLOO_LOST + " (exit status 1)",
        "meshloom: restarting (1 of 1) from the start"]


def test_restarts_used_up_cause_first_and_exit_1(tmp_path, token_cache):
    """Rank 1 is killed on every attempt: each attempt's report starts with it, the restart
    line says where from, and the last line says the restarts are used up; exit status 1."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "meshloom", "train", TINY, "--nproc", "2",
                           "--max-restarts", "1", "--set", "train.steps=4",
                           "--set", "train.eval_every=0", "--set", "train.sample_tokens=0",
                           "--set", f"run.dir={run_dir}", "--set", f"data.cache_dir={token_cache}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env("kill:1:1:always"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = _said(proc.stderr)
    killed = "meshloom: rank 1 was killed by SIGKILL"
    assert lines[:2] == [killed, "meshloom: restarting (1 of 1) from the start"], lines
    second = lines.index(killed, 2)
    assert all("rank" in ln and "0" in ln for ln in lines[2:second]), lines  # symptoms only
    assert lines[-1] == ("meshloom: training failed on rank 1; the 1 restart(s) of "
                         "--max-restarts are used up"), lines
    assert all("rank" in ln and "0" in ln for ln in lines[second + 1:-1]), lines
    assert "Traceback" not in proc.stderr


def test_meshloom_train_tensor_parallel(tmp_path, token_cache):
    """The CLI path of a tensor-parallel run: drawing of the slices, training, a sample generated
    from vocabulary-split logits with sequence parallel switched off, tp bytes in the metrics."""
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "meshloom", "train", TINY, "--nproc", "2",
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
    proc = _run([sys.executable, "-m", "meshloom", "train", TINY, "--nproc", "2",
                 "--set", "parallel.pp=2", "--set", "parallel.pp_microbatches=4",
                 "--set", "train.steps=3", "--set", "train.eval_every=0",
                 "--set", "train.sample_tokens=10", "--set", f"run.dir={run_dir}",
                 "--set", f"data.cache_dir={token_cache}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stage 1: layers" in proc.stdout and "--- sample ---" in proc.stdout
    records = _records(run_dir)
    assert records[-1]["comm_bytes"]["pp"] > 0
    rep = _run([sys.executable, "-m", "meshloom", "report", str(run_dir)], tmp_path)
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert "bubble" in rep.stdout and "1f1b" in rep.stdout
    assert (run_dir / "pipeline" / "timeline.png").stat().st_size > 1000


def test_meshloom_train_expert_parallel(tmp_path, token_cache):
    """The command docs/moe.md starts with: Mixtral-style experts over 2 of 4 ranks."""
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "meshloom", "train", str(ROOT / "configs" / "moe.toml"),
                 "--nproc", "4", "--set", "parallel.ep=2", "--set", "train.steps=3",
                 "--set", f"run.dir={run_dir}", "--set", f"data.cache_dir={token_cache}"],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(ep=2 of dp_shard x cp)" in proc.stdout
    assert "rank   1  dp_shard 1/4" in proc.stdout and "experts part 1/2" in proc.stdout
    assert "model: mixtral mixtral-tiny" in proc.stdout
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # every token's 2 choices counted, none dropped (dropless)
        assert [sum(layer) for layer in r["moe"]["expert_load"]] == [16 * 64 * 2] * 4
        assert r["moe"]["tokens_dropped"] == 0 and r["moe"]["aux_loss"] > 0
        assert r["comm_bytes"]["ep"] > 0


def test_fork_server_preloads_start_no_thread_or_process():
    """run_ranks forks every rank from a server that imported FORKSERVER_PRELOAD: a module that
    started a thread or a child there would fork a process with a lock held or a helper
    missing. Importing them must leave the threads `import torch` leaves, and no child."""
    code = (
        "import os, importlib, torch\n"
        "from meshloom.launch import FORKSERVER_PRELOAD\n"
        "def threads(): return len(os.listdir('/proc/self/task'))\n"
        "base = threads()\n"
        "for name in FORKSERVER_PRELOAD: importlib.import_module(name)\n"
        "me = str(os.getpid())\n"
        "kids = [p for p in os.listdir('/proc') if p.isdigit()\n"
        "        and open(f'/proc/{p}/stat').read().split(')')[-1].split()[1] == me]\n"
        "print(base, threads(), len(kids))\n")
    done = _run([sys.executable, "-c", code], cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    base, after, kids = map(int, done.stdout.split())
    assert after == base and kids == 0, done.stdout
