"""Smoke test of benchmarks/cp_memory.py: cp 1 and 2 on a short sequence, checking the JSON shape,
the ratios and that the first step's loss is the same at both degrees."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_cp_memory_smoke(tmp_path):
    out = tmp_path / "results" / "cp_memory.json"
    steps, seq = 2, 256
    bench = load_benchmark("cp_memory")
    result = bench.main(["--preset", "tiny", "--seq", str(seq), "--steps", str(steps),
                         "--warmup", "0", "--cps", "1,2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    c = result["config"]
    assert c["cps"] == [1, 2] and c["backend"] == "gloo" and c["tokens_per_step"] == seq
    assert result["reference_cp"] == 1 and list(result["runs"]) == ["1", "2"]
    for cp, r in result["runs"].items():
        assert r["ranks"] == int(cp) and r["tokens_per_rank"] == seq // int(cp)
        assert len(r["times_s"]) == steps and all(t > 0 for t in r["times_s"])
        assert r["p10_s"] <= r["median_s"] <= r["p90_s"]
        assert len(r["peak_bytes_by_rank"]) == int(cp)
        assert r["peak_bytes"] == max(r["peak_bytes_by_rank"])
        assert 0 < r["state_bytes"] < r["peak_bytes"] and r["rise_bytes"] > 0
        # No warm-up: the memory step starts from the parameters alone (fp32, replicated).
        assert r["state_bytes"] >= r["params"] * 4
        assert len(r["losses"]) == steps + 1  # the memory step, then the timed ones
    one, two = result["runs"]["1"], result["runs"]["2"]
    assert one["peak_ratio"] == one["time_ratio"] == 1.0
    assert two["peak_ratio"] == two["peak_bytes"] / one["peak_bytes"]
    # Half the tokens per rank: fewer activation bytes.
    assert two["rise_bytes"] < one["rise_bytes"]
    check = result["check"]
    assert check["ok"], check
    assert abs(check["first_loss"]["1"] - check["first_loss"]["2"]) <= 1e-5 * check[
        "first_loss"]["1"]
