"""Smoke test of benchmarks/tp_generate.py: tp 1 and 2 on the tiny model with a short prompt,
checking the JSON shape, the speedups, the collectives per token that follow from the plan, and
that both degrees generate the same greedy tokens."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_tp_generate_smoke(tmp_path):
    out = tmp_path / "results" / "tp_generate.json"
    repeats, new = 1, 4
    bench = load_benchmark("tp_generate")
    result = bench.main(["--preset", "tiny", "--heads", "0", "--kv-heads", "0", "--tps", "1,2",
                         "--prompt-len", "8", "--new-tokens", str(new), "--repeats",
                         str(repeats), "--warmup", "0", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    c = result["config"]
    assert c["tps"] == [1, 2] and c["backend"] == "gloo" and c["n_layers"] == 4
    assert result["reference_tp"] == 1 and list(result["runs"]) == ["1", "2"]
    one, two = result["runs"]["1"], result["runs"]["2"]
    for r in (one, two):
        assert len(r["prefill_s"]) == len(r["decode_s"]) == repeats
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["agrees_with_first"]
    assert one["prefill_speedup"] == one["decode_speedup"] == 1.0
    assert two["decode_speedup"] == two["decode_tokens_per_s"] / one["decode_tokens_per_s"]
    # One process moves nothing; two: 2 all-reduces per layer + the embedding's, 1 all-gather.
    assert one["collectives_per_token"] == {} and one["comm_share_estimate"] == 0
    assert two["collectives_per_token"] == {"all_reduce": 2 * 4 + 1, "all_gather": 1}
    assert two["allreduce_latency_us"] > 0 and two["comm_share_estimate"] > 0
    assert one["collective_share"] == 0 and 0 < two["collective_share"] < 1
    assert two["decode_bytes_per_token"] == 4 * (9 * 64 + 258)  # dim 64, vocab 257 padded
    assert result["check"]["ok"]
