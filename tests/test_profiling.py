"""`run.profile_start` / `run.profile_steps`: the profiler covers the asked steps of a real run
and each rank writes its trace and its per-kernel (per-op on CPU) totals."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, tiny_config
from dist_harness import run_ranks

from meshloom.commands import main as cli_main
from meshloom.train import train


def _profiled(run_dir, cache) -> list[float]:
    cfg = tiny_config(run_dir, cache, "train.steps=4", "train.eval_every=0",
                      "train.sample_tokens=0", "run.profile_start=3", "run.profile_steps=1")
    return train(cfg).losses


def _plain(run_dir, cache) -> list[float]:
    cfg = tiny_config(run_dir, cache, "train.steps=4", "train.eval_every=0",
                      "train.sample_tokens=0")
    return train(cfg).losses


def test_two_ranks_each_write_a_trace_and_kernel_totals(tmp_path, token_cache):
    profiled = run_ranks(_profiled, 2, tmp_path / "run", token_cache)[0]
    plain = run_ranks(_plain, 2, tmp_path / "plain", token_cache)[0]
    assert profiled == plain  # the profiler observes, it changes nothing
    folder = tmp_path / "run" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank0.trace.json", "rank0_kernels.json", "rank1.trace.json", "rank1_kernels.json"]
    trace = json.loads((folder / "rank1.trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("ProfilerStep#" in n for n in names)  # one profiled step, named by the profiler
    assert any("mm" in n for n in names)  # the model's matmuls are in it
    k = json.loads((folder / "rank0_kernels.json").read_text())
    assert k["steps"] == 1 and k["rank"] == 0 and k["kernels"]
    times = [r["total_ms"] for r in k["kernels"]]
    assert times == sorted(times, reverse=True) and k["total_ms"] == pytest.approx(sum(times),
                                                                                 abs=1e-2)


@pytest.mark.parametrize("override,msg", [
    ("run.profile_start=-1", "run.profile_start=-1 must be >= 0"),
    ("run.profile_steps=0", "run.profile_steps=0 must be >= 1"),
    ("run.profile_start=999", "run.profile_start=999 is past the last step"),
])
def test_bad_profile_settings_are_one_line(override, msg, capsys):
    assert cli_main(["layout", str(ROOT / "configs" / "tiny.toml"), "--set", override]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1
