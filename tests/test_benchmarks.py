"""Smoke test of benchmarks/ddp_vs_torch.py: a tiny run on 2 Gloo ranks, checking the JSON shape."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_ddp_vs_torch_smoke(tmp_path):
    out = tmp_path / "results" / "ddp_vs_torch.json"
    steps = 3
    bench = load_benchmark("ddp_vs_torch")
    result = bench.main(["--nproc", "2", "--preset", "tiny", "--steps", str(steps),
                        "--warmup", "1", "--batch", "2", "--seq", "16",
                        "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["config"]["nproc"] == 2 and result["config"]["backend"] == "gloo"
    for name in ("ours", "torch"):
        s = result[name]
        assert len(s["times_s"]) == steps and all(t > 0 for t in s["times_s"])
        assert s["p10_s"] <= s["median_s"] <= s["p90_s"]
    assert result["ratio"] == result["ours"]["median_s"] / result["torch"]["median_s"]
    assert 0.0 <= result["ours_faster_fraction"] <= 1.0
    # Ours all-reduces exactly the gradients once per step.
    assert result["comm"]["bytes_per_step"] == result["comm"]["grad_bytes"]
    # Both copies trained on the same data, so they must agree.
    assert result["check"]["allclose"]
    assert result["check"]["max_abs_diff"] < 1e-5
    buckets = result["bucket_bytes"]
    assert sum(buckets["ours"]) == result["comm"]["grad_bytes"]
    assert buckets["torch"] is None or buckets["same_layout"]  # None: torch's private API moved
