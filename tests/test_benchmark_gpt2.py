"""Smoke test of benchmarks/gpt2_vs_transformers.py: a one-block GPT-2 beside transformers' on a
short batch; the JSON shape, the ratio and the check that both give the same logits and
gradients (the weights go through models/gpt2_hf.py)."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

pytest.importorskip("transformers")


def test_gpt2_vs_transformers_smoke(tmp_path):
    out = tmp_path / "gpt2_vs_transformers.json"
    bench = load_benchmark("gpt2_vs_transformers")
    result = bench.main(["--layers", "1", "--dim", "64", "--heads", "4", "--vocab", "300",
                         "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "0",
                         "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    c = result["config"]
    assert c["layers"] == 1 and c["vocab"] == 300 and c["params"] > 0
    runs = result["runs"]
    assert set(runs) == {"ours", "transformers"}
    assert all(len(r["times_s"]) == 2 for r in runs.values())
    assert result["ratio_ours_to_transformers"] == \
        runs["ours"]["median_s"] / runs["transformers"]["median_s"]
    assert result["paired_ratio_ours_to_transformers"] > 0
    assert result["cpu_ratio_ours_to_transformers"] == \
        runs["ours"]["cpu"]["median_s"] / runs["transformers"]["cpu"]["median_s"]
    assert result["check"]["ok"]
    assert result["check"]["max_abs_logit_diff"] <= 1e-5
