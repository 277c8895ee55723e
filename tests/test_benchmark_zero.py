"""Smoke test of benchmarks/zero_vs_fsdp2.py: a tiny run on 2 Gloo ranks, checking the JSON shape,
that every variant trained the same parameters, and the comm and memory figures that follow
from the sharding alone."""

from __future__ import annotations

import json

from conftest import load_benchmark

VARIANTS = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]


def test_zero_vs_fsdp2_smoke(tmp_path):
    out = tmp_path / "results" / "zero_vs_fsdp2.json"
    steps = 2
    bench = load_benchmark("zero_vs_fsdp2")
    result = bench.main(["--nproc", "2", "--preset", "tiny", "--steps", str(steps),
                        "--warmup", "1", "--batch", "2", "--seq", "16",
                        "--variants", ",".join(VARIANTS), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["config"]["nproc"] == 2 and result["config"]["backend"] == "gloo"
    assert list(result["variants"]) == VARIANTS
    psi = result["config"]["param_bytes"]
    v = result["variants"]
    for name in VARIANTS:
        s = v[name]
        assert len(s["times_s"]) == steps and all(t > 0 for t in s["times_s"])
        assert s["p10_s"] <= s["median_s"] <= s["p90_s"]
        assert s["ratio_to_fsdp2"] == s["median_s"] / v["fsdp2"]["median_s"]
        assert s["ratio_to_ddp"] == s["median_s"] / v["ddp"]["median_s"]
        m = s["memory_bytes"]
        assert len(m["per_rank_total"]["step_peak"]) == 2
        assert m["step_peak"] >= m["after_step"]["total"] > 0
        assert m["after_step"]["total"] == sum(b for k, b in m["after_step"].items()
                                               if k != "total")
    assert v["fsdp2"]["comm"] is None  # FSDP2 does not report to our counter
    assert v["ddp"]["comm"]["by_op"] == {"all_reduce": psi}  # every gradient once
    for stage in ("zero1", "zero2"):  # reduce-scatter the gradients, all-gather the parameters
        assert v[stage]["comm"]["by_op"]["reduce_scatter"] >= psi
        assert v[stage]["comm"]["by_op"]["all_gather"] >= psi
    # Sharding: stage 1 splits the optimizer state, stage 2 the gradients too, stage 3 and
    # FSDP2 everything (up to padding).
    state = {n: v[n]["memory_bytes"]["after_step"] for n in VARIANTS}
    assert state["zero1"]["optim"] < state["ddp"]["optim"]
    assert state["zero2"]["grads"] < state["zero1"]["grads"]
    assert state["zero3"]["params"] < state["zero2"]["params"]
    assert abs(state["zero3"]["total"] - state["fsdp2"]["total"]) < 0.01 * state["ddp"]["total"]
    # Same data, same model: every variant must end with the same parameters.
    check = result["check"]
    assert check["allclose"], check
    assert max(check["max_abs_diff"].values()) < 1e-5
    assert set(check["max_abs_diff"]) == set(VARIANTS)
