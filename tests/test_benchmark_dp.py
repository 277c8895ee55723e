"""Smoke test of benchmarks/dp_vs_ddp.py: a tiny run (2 replicas in one process vs 2 Gloo
ranks), checking the JSON shape, that the variants trained the same parameters, and that the
bytes each moved per step are the formulas'."""

from __future__ import annotations

import json

from conftest import load_benchmark

VARIANTS = ["dp", "ddp", "single"]


def test_dp_vs_ddp_smoke(tmp_path):
    out = tmp_path / "results" / "dp_vs_ddp.json"
    steps = 2
    bench = load_benchmark("dp_vs_ddp")
    result = bench.main(["--nproc", "2", "--preset", "tiny", "--steps", str(steps),
                        "--warmup", "1", "--batch", "2", "--seq", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    c = result["config"]
    assert c["nproc"] == 2 and c["backend"] == "gloo" and c["global_batch"] == 4
    v = result["variants"]
    assert list(v) == VARIANTS
    for name in VARIANTS:
        s = v[name]
        assert len(s["times_s"]) == steps and all(t > 0 for t in s["times_s"])
        assert s["p10_s"] <= s["median_s"] <= s["p90_s"]
        assert s["ratio_to_ddp"] == s["median_s"] / v["ddp"]["median_s"]
        assert set(s["phase_median_s"]) == {"forward", "backward", "optimizer"}
    assert result["ratio"] == v["dp"]["ratio_to_ddp"]
    m = result["comm"]
    # DDP all-reduces every gradient once; dp copies what the formula says, by op.
    assert m["ddp"]["by_op"] == {"all_reduce": c["param_bytes"]}
    assert m["dp"]["bytes_per_step"] == m["dp_expected_bytes_per_step"]
    assert m["dp"]["by_op"]["broadcast_params"] == m["dp"]["by_op"]["reduce_grads"] \
        == c["param_bytes"]
    assert "single" not in m  # one device copies nothing
    # Same data, same model: the same gradients (up to the order of the sums), and after so
    # few steps the same parameters.
    grads, params = result["check"]["grads"], result["check"]["params"]
    assert grads["ok"] and set(grads["max_rel_diff"]) == set(VARIANTS), grads
    # 2 replicas in one process reproduce DDP on 2 ranks bit for bit
    # (tests/test_single_process_dp.py says why); the whole batch at once differs in the last bits.
    assert grads["max_rel_diff"]["ddp"] == grads["max_rel_diff"]["dp"] == 0.0
    assert params["allclose"], params
