"""`meshloom bench kernels` on CPU: a quick run writes a table the loader reads, holding every
GEMM shape the planner asks for; the TFLOP/s arithmetic of GEMMs and attention; the backward
timed without its forward; bad input and published tables refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshloom.commands import main
from meshloom.plan import kernel_bench as kb
from meshloom.plan import kernel_table
from meshloom.plan.models import PRESETS
from meshloom.plan.step_kernels import all_gemms

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # what the command measures on


def test_quick_cpu_run_writes_a_table_answering_every_planner_shape(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    argv = ["bench", "kernels", "--quick", "--model", "tiny", "--seq", "32",
            "--micro-batch", "1,2", "--tp", "1,2", "--gpu-name", "test", "--out", str(out)]
    assert main(argv) == 0
    assert "GEMM shapes" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["cpu.json"]  # the temporary file was renamed, none left

    raw = json.loads(out.read_text())
    dtype = "bf16" if DEVICE == "cuda" else "fp32"  # a CPU measures fp32 and says so
    assert (raw["kind"], raw["gpu"], raw["dtype"]) == ("measured", "test", dtype)
    prov = raw["provenance"]
    assert {"date", "torch", "cuda", "device_name", "command"} <= set(prov)
    assert prov["command"].startswith("meshloom bench kernels --model tiny --seq 32")
    assert DEVICE == "cuda" or "fp32" in prov["note"]

    # Every forward, input- and weight-gradient GEMM of the asked layouts, plus the squares,
    # each answered exactly (not interpolated) by the loader.
    want = {(g.m, g.n, g.k) for mb in (1, 2) for tp in (1, 2)
            for g in all_gemms(PRESETS["tiny"], 32 * mb, tp)}
    want |= {(s, s, s) for s in kb.SQUARES_QUICK[DEVICE]}
    table = kernel_table.load(out)
    assert {(m, n, k) for m, n, k, _ in table.gemm} == want
    for row in raw["gemm"]:
        assert table.gemm_tflops(row["m"], row["n"], row["k"]) == row["tflops"] > 0

    got = {(r["seq"], r["head_dim"], r["causal"], r["direction"]) for r in raw["attention"]}
    assert got == {(s, 64, c, d) for s in kb.ATTENTION_SEQS_QUICK[DEVICE]
                   for c in (True, False) for d in ("fwd", "bwd")}
    assert table.hbm_gbps > 0 and table.launch_us > 0 and table.optimizer_gbps > 0


def test_shapes_head_widths_and_lengths_are_measured_as_asked(tmp_path):
    """--shapes adds GEMMs beside the models' (what validation_shapes.py writes), and the
    attention grid follows --head-dims and --attention-seqs; the command that reproduces the
    table names them."""
    (tmp_path / "shapes.json").write_text("[[48, 40, 24], [8, 16, 32]]")
    out = tmp_path / "t.json"
    assert main(["bench", "kernels", "--quick", "--gpu-name", "test", "--out", str(out),
                 "--shapes", str(tmp_path / "shapes.json"), "--head-dims", "16,48",
                 "--attention-seqs", "32"]) == 0
    raw = json.loads(out.read_text())
    assert {(48, 40, 24), (8, 16, 32)} <= {(g["m"], g["n"], g["k"]) for g in raw["gemm"]}
    assert {(a["seq"], a["head_dim"]) for a in raw["attention"]} == {(32, 16), (32, 48)}
    assert "--head-dims 16,48 --attention-seqs 32" in raw["provenance"]["command"]


def test_gemm_tflops_is_2mnk_over_the_median_time(monkeypatch):
    monkeypatch.setattr(kb, "measure_seconds", lambda fn, *a, **k: 2e-3)
    rows, skipped = kb.bench_gemms([(3, 5, 7), (8, 4, 2)], CPU, torch.float32, 1, 1)
    assert skipped == []
    assert [(r["m"], r["n"], r["k"]) for r in rows] == [(3, 5, 7), (8, 4, 2)]
    assert rows[0]["tflops"] == pytest.approx(2 * 3 * 5 * 7 / 2e-3 / 1e12, rel=1e-12)
    assert rows[1]["tflops"] == pytest.approx(2 * 8 * 4 * 2 / 2e-3 / 1e12, rel=1e-12)


def test_attention_flops_follow_the_flashattention_convention(monkeypatch):
    """4·b·h·s²·d forward, half of it causal, backward 2.5x: checked against a fixed timer."""
    monkeypatch.setattr(kb, "measure_seconds", lambda fn, *a, **k: 1e-3)
    cases = [kb.AttentionCase(16, 8, causal, batch=3, heads=2) for causal in (True, False)]
    rows = kb.bench_attention(cases, CPU, torch.float32, 1, 1)
    got = {(r["causal"], r["direction"]): r["tflops"] for r in rows}
    fwd = 4 * 3 * 2 * 16 * 16 * 8 / 1e-3 / 1e12
    assert got[(False, "fwd")] == pytest.approx(fwd, rel=1e-12)
    assert got[(True, "fwd")] == pytest.approx(fwd / 2, rel=1e-12)
    assert got[(False, "bwd")] == pytest.approx(2.5 * fwd, rel=1e-12)
    assert got[(True, "bwd")] == pytest.approx(2.5 * fwd / 2, rel=1e-12)
    assert all((r["batch"], r["heads"], r["seq"], r["head_dim"]) == (3, 2, 16, 8) for r in rows)


def test_backward_is_timed_without_its_forward(monkeypatch):
    """The timed backward call runs no attention forward; the forward call runs one."""
    calls = {"n": 0}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **k):
        calls["n"] += 1
        return sdpa(*a, **k)

    per_call = []

    def timer(fn, *a, **k):
        before = calls["n"]
        result = fn()
        per_call.append(calls["n"] - before)
        if isinstance(result, tuple):  # the backward: input gradients of q, k and v
            assert len(result) == 3 and all(g is not None for g in result)
        return 1e-3

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    monkeypatch.setattr(kb, "measure_seconds", timer)
    kb.bench_attention([kb.AttentionCase(16, 8, True, 1, 2)], CPU, torch.float32, 1, 1)
    assert per_call == [1, 0]  # forward timed, then backward alone


def test_infer_gpu_name():
    assert kb.infer_gpu_name("NVIDIA H100 80GB HBM3") == "h100"
    assert kb.infer_gpu_name("NVIDIA H200") == "h200"
    assert kb.infer_gpu_name("NVIDIA A100-SXM4-80GB") == "a100-80g"
    assert kb.infer_gpu_name("NVIDIA A100-SXM4-40GB") == "a100-40g"
    assert kb.infer_gpu_name("NVIDIA H100 PCIe") is None  # not the SXM part the preset is
    assert kb.infer_gpu_name("NVIDIA A100 80GB PCIe") is None
    assert kb.infer_gpu_name("NVIDIA GeForce RTX 4090") is None


@pytest.mark.parametrize("args,msg", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--seq", "0"], "--seq=0"),
    (["--micro-batch", "1,0"], "--micro-batch='1,0'"),
    (["--tp", "-2"], "--tp='-2'"),
    (["--tp", "two"], "--tp='two'"),
    (["--reps", "0"], "--reps=0"),
    (["--gpu-name", "H100!"], "--gpu-name='H100!'"),
    (["--out", "/nonexistent/dir/t.json"], "does not exist"),
    (["--out", "{tmp}"], "is a folder"),
    (["--dtype", "fp8"], "invalid choice"),
    (["--shapes", "{tmp}/missing.json"], "--shapes"),
    (["--shapes", "{tmp}/bad.json"], "give a JSON list of [m, n, k] positive integers"),
    (["--head-dims", "64,x"], "--head-dims='64,x'"),
    (["--attention-seqs", "0"], "--attention-seqs='0'"),
])
def test_bad_input_is_one_line_exit_2(args, msg, tmp_path, capsys):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    (tmp_path / "bad.json").write_text("[[64, 64], [1, 2, 0]]")
    if "--out" not in args:
        args += ["--out", str(tmp_path / "t.json")]
    if "--gpu-name" not in args:  # an unknown GPU would be refused first
        args += ["--gpu-name", "test"]
    try:
        code = main(["bench", "kernels", "--quick", *args])
    except SystemExit as e:  # argparse's own checks exit from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the default --out is the table folder")
def test_cpu_without_out_is_refused(capsys):
    assert main(["bench", "kernels", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and len(err.strip().splitlines()) == 1


def _fake_measure(plan, device, dtype, log=None, fp8=None):
    return {"gemm": [{"m": 2, "n": 2, "k": 2, "tflops": 1.0}], "attention": [],
            "copy_gbps": 1.0, "add_gbps": 1.0, "launch_us": 1.0, "skipped": []}


def test_a_published_table_is_replaced_only_with_force(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kb, "measure", _fake_measure)
    out = tmp_path / "h100.json"
    published = {"gpu": "h100", "kind": "published", "sources": {},
                 "gemm": [{"m": 1, "n": 1, "k": 1, "tflops": 1.0, "source": "X"}]}
    out.write_text(json.dumps(published))
    argv = ["bench", "kernels", "--quick", "--gpu-name", "h100", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "published" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert json.loads(out.read_text()) == published
    assert main(argv + ["--force"]) == 0
    assert json.loads(out.read_text())["kind"] == "measured"
    assert main(argv) == 0  # a measured table may be measured again


def test_the_benchmark_script_is_the_same_command(tmp_path):
    script = ROOT / "benchmarks" / "kernel_rates.py"
    proc = subprocess.run([sys.executable, str(script), "--quick",
                           "--seq", "0", "--out", str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    assert "--seq=0" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_on_a_gpu_the_table_is_named_by_its_preset(tmp_path, capsys, monkeypatch):
    """The device name picks the preset and the default --out; an unknown part is refused.
    (CUDA faked: only the naming is under test, the measurement is replaced.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kb, "measure", _fake_measure)
    monkeypatch.setattr(kb, "default_out", lambda gpu: tmp_path / f"{gpu}.json")
    monkeypatch.setattr(kb, "device_name", lambda device: "NVIDIA H100 PCIe")
    assert main(["bench", "kernels"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-name" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(kb, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert main(["bench", "kernels", "--quick"]) == 2  # a reduced set never lands there
    assert "--out" in capsys.readouterr().err
    assert main(["bench", "kernels"]) == 0
    raw = json.loads((tmp_path / "h100.json").read_text())
    assert (raw["gpu"], raw["dtype"], raw["device"]) == ("h100", "bf16", "NVIDIA H100 80GB HBM3")
    assert "--gpu-name h100" in raw["provenance"]["command"]


def test_fp8_is_refused_in_one_line_where_there_are_no_fp8_tensor_cores(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--quick", "--out", str(out), "--fp8"]) == 2
    assert not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("has no fp8 tensor cores (compute capability 8.9 and up, on CUDA)")
    assert not any("measuring" in line for line in err)  # refused before anything ran
