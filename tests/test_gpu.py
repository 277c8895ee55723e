"""Checks that need a CUDA GPU; skipped without one (CI has none). Run on a GPU machine with
`python -m pytest tests/test_gpu.py` (benchmarks/gpu_check.sh tests does).

The training run goes through the real launcher (torchrun, NCCL bound to the GPU) with bf16,
compiled blocks and loss, and selective checkpointing; its CUDA allocator peak is held against
the planner's prediction for the same run, which the run itself writes to summary.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshloom.config import TrainConfig
from meshloom.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(run_dir: Path, cache: Path, *overrides: str) -> dict:
    cmd = [sys.executable, "-m", "meshloom", "train", str(ROOT / "configs" / "tiny.toml"),
           "--nproc", "1", "--set", f"run.dir={run_dir}", "--set", f"data.cache_dir={cache}",
           "--set", "run.device=cuda", "--set", "model.preset=small", "--set", "data.seq_len=512",
           "--set", "train.global_batch=8", "--set", "train.eval_every=0"]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "memory per GPU: peak allocated" in proc.stdout + proc.stderr
    return json.loads((run_dir / "summary.json").read_text())


def test_gpu_run_memory_against_the_planner(tmp_path):
    s = _train(tmp_path / "run", tmp_path / "cache", "train.steps=4", "train.dtype=bf16",
               "train.compile=true", "train.activation_checkpointing=selective")
    assert s["final_loss"] < s["first_loss"]
    allocated = s["peak_mem_bytes_per_rank"][0]
    reserved = s["peak_mem_reserved_bytes_per_rank"][0]
    predicted = s["predicted_memory_per_gpu"]
    states = predicted["params"] + predicted["grads"] + predicted["optimizer"]
    # The allocator holds at least the model states, at most what the planner allows for.
    assert states <= allocated <= reserved <= predicted["total"], (allocated, reserved, predicted)


def test_bf16_tracks_fp32_on_gpu(tmp_path):
    """bf16 autocast with fp32 masters follows the fp32 run (same data, same init)."""
    ref = _train(tmp_path / "fp32", tmp_path / "cache", "train.steps=12")
    bf16 = _train(tmp_path / "bf16", tmp_path / "cache", "train.steps=12", "train.dtype=bf16")
    assert bf16["first_loss"] == pytest.approx(ref["first_loss"], rel=1e-2)
    assert bf16["final_loss"] == pytest.approx(ref["final_loss"], rel=3e-2)


def test_fused_adamw_on_cuda():
    p = torch.nn.Parameter(torch.randn(8, 8, device="cuda"))
    b = torch.nn.Parameter(torch.zeros(8, device="cuda"))
    opt = build_optimizer([p], [b], TrainConfig())
    assert opt.defaults.get("fused") is True
