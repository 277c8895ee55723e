"""Smoke test of benchmarks/pp_vs_torch.py: a tiny run on 2 Gloo ranks (2 pipeline stages),
checking the JSON shape, the ratios, that every variant computed the same gradients, the bubble
figures and the bytes that follow from the micro-batch shapes alone."""

from __future__ import annotations

import json

from conftest import load_benchmark

VARIANTS = ["meshloom_1f1b", "meshloom_gpipe", "torch_1f1b", "torch_gpipe"]


def test_pp_vs_torch_smoke(tmp_path):
    out = tmp_path / "results" / "pp_vs_torch.json"
    steps, m, b, seq = 2, 4, 2, 16
    bench = load_benchmark("pp_vs_torch")
    result = bench.main(["--nproc", "2", "--preset", "tiny", "--steps", str(steps),
                        "--warmup", "1", "--microbatches", str(m), "--batch", str(b),
                        "--seq", str(seq), "--variants", ",".join(VARIANTS),
                        "--out", str(out)])
    assert json.loads(out.read_text()) == result
    c = result["config"]
    assert c["nproc"] == c["pp"] == 2 and c["backend"] == "gloo" and c["microbatches"] == m
    assert c["stage_layers"] == [[0, 2], [2, 4]]  # tiny: 4 blocks, balanced
    assert list(result["variants"]) == VARIANTS
    v = result["variants"]
    for name in VARIANTS:
        s = v[name]
        base = v[f"torch_{s['schedule']}"]
        assert s["torch_baseline"] == f"torch_{s['schedule']}"
        assert len(s["times_s"]) == steps and all(t > 0 for t in s["times_s"])
        assert s["p10_s"] <= s["median_s"] <= s["p90_s"]
        assert s["ratio_to_torch"] == s["median_s"] / base["median_s"]
        assert s["paired_ratio_to_torch"] > 0
        bub = s["bubble"]
        assert len(bub["measured_per_step"]) == steps
        assert all(0.0 <= x < 1.0 for x in bub["measured_per_step"])
        assert 0.0 <= bub["measured_median"] < 1.0
        # Unit costs, 2 stages, m micro-batches: (p - 1) / (m + p - 1) for both schedules.
        assert abs(bub["predicted_unit_cost"] - 1 / (m + 1)) < 1e-12
        assert 0.0 <= bub["predicted_measured_costs"] < 1.0
        assert set(bub["compute_median_s"]) == {"F0", "F1", "B0", "B1"}
        assert 0 < max(bub["busy_median_s"]) <= bub["makespan_median_s"]
        # Activations forward and their gradients backward, once per micro-batch, the same for
        # ours (our CommCounter) and torch's (its send ops).
        expected = 2 * m * b * seq * 64 * 4
        assert s["comm"]["expected_bytes_per_step"] == expected
        assert s["comm"]["bytes_per_step"] == expected
        assert s["comm"]["by_rank"] == [expected / 2, expected / 2]
        assert s["final_loss"] > 0
    assert v["torch_1f1b"]["ratio_to_torch"] == v["torch_gpipe"]["ratio_to_torch"] == 1.0
    # Same weights, same micro-batches: every variant computes the same gradients.
    grads = result["check"]["grads"]
    assert grads["ok"], grads
    assert set(grads["max_rel_diff"]) == set(VARIANTS)
    assert max(grads["max_rel_diff"].values()) < 1e-5
    assert result["clock_skew_s"]["median"] >= 0.0
