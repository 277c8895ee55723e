"""Smoke test of benchmarks/gpu_mfu.py on the CPU: both tiny models, all six variants, fp32 (so
that activation checkpointing must reproduce the plain run's losses exactly), compiled with
dynamo's eager backend (no C++ toolchain needed). Run as a subprocess, as on a GPU machine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_mfu.py"
VARIANTS = ("eager", "compiled", "eager+ac", "compiled+ac", "eager+sac", "compiled+sac")
AC = {"": "none", "+ac": "full", "+sac": "selective"}
PREDICTED = ("step_time_s", "tokens_per_s", "mfu", "planner_mfu", "memory_bytes", "fits")


def _run(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # One thread: the tiny shapes gain nothing from more, and a loaded machine's spinning OpenMP
    # threads make every step many times slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def test_gpu_mfu_smoke_cpu(tmp_path):
    out = tmp_path / "gpu_mfu_smoke.json"
    steps, warmup = 2, 1
    proc = _run("--smoke", "--device", "cpu", "--compile-backend", "eager", "--dtype", "fp32",
                "--models", "llama1b,gpt2", "--variants", ",".join(VARIANTS),
                "--steps", str(steps), "--warmup", str(warmup), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MFU" in proc.stdout and f"wrote {out}" in proc.stdout
    r = json.loads(out.read_text())
    c = r["config"]
    assert c["device"] == "cpu" and c["dtype"] == "fp32" and c["compile_backend"] == "eager"
    assert c["smoke"] and c["steps"] == steps and c["warmup"] == warmup
    assert c["torch"] and "commit" in c["git"] and c["peak_flops"] > 0
    assert r["ok"] and set(r["models"]) == {"llama1b", "gpt2"}
    for key, m in r["models"].items():
        assert m["seq"] == 32 and m["batch"] == 2 and m["tokens_per_step"] == 64
        assert m["flops_per_token"] > 0
        assert list(m["variants"]) == list(VARIANTS), key
        # The planner sizes the same model the script built.
        assert m["planner_params"] == m["params"], key
        for name, v in m["variants"].items():
            assert "error" not in v, (key, name, v.get("error"))
            assert v["compiled"] == name.startswith("compiled")
            assert v["activation_checkpointing"] == AC[name[name.find("+"):] if "+" in name
                                                       else ""]
            assert v["tokens_per_s"] > 0 and len(v["times_s"]) == steps
            assert 0 < v["mfu"] < 1
            assert math.isclose(v["mfu"], v["tokens_per_s"] * m["flops_per_token"]
                                / c["peak_flops"], rel_tol=1e-9)
            assert v["max_memory_allocated"] is None  # not measured on CPU
            assert len(v["losses"]) == warmup + steps
            assert all(math.isfinite(x) for x in v["losses"])
            if v["compiled"]:
                assert v["dynamo"]["graphs"] >= 1  # dynamo really captured the blocks
            p = v["predicted"]
            assert "error" not in p, p
            for field in PREDICTED:
                assert field in p, (key, name, field)
            assert p["step_time_s"] > 0 and p["tokens_per_s"] > 0 and p["memory_bytes"] > 0
            assert 0 < p["mfu"] < 1 and 0 < p["planner_mfu"] < 1
        vs = m["variants"]
        # Full recompute: the planner predicts less memory and a slower step.
        assert vs["eager+ac"]["predicted"]["memory_bytes"] < vs["eager"]["predicted"][
            "memory_bytes"]
        assert vs["eager+ac"]["predicted"]["step_time_s"] > vs["eager"]["predicted"][
            "step_time_s"]
        # Activation checkpointing must not change the maths: same seed, same data, fp32 on the
        # CPU -> the very same losses at every step.
        for base in ("eager", "compiled"):
            for suffix in ("+ac", "+sac"):
                assert vs[base + suffix]["losses"] == vs[base]["losses"], (key, base, suffix)
                assert m["ac_loss_max_abs_diff"][base + suffix] == 0.0
        # Training on random tokens from a near-uniform start: the loss goes down, if slightly.
        assert vs["eager"]["losses"][-1] < vs["eager"]["losses"][0], key


def test_gpu_mfu_cuda_unavailable_exits_2(tmp_path):
    proc = _run("--device", "cuda", "--out", str(tmp_path / "x.json"),
                env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stderr
    assert not (tmp_path / "x.json").exists()
