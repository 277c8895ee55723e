"""Smoke test of benchmarks/moe_ep.py: a tiny MoE layer on 2 Gloo ranks, ep 1 against ep 2,
checking the JSON shape, that both compute the same thing, and the all-to-all bytes against the
formula worked out here (not the script's own)."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

RANKS, TOKENS, DIM, EXPERTS, HIDDEN, TOP_K, STEPS = 2, 48, 16, 4, 24, 2, 2


def test_moe_ep_smoke(tmp_path):
    out = tmp_path / "results" / "moe_ep.json"
    bench = load_benchmark("moe_ep")
    result = bench.main(["--nproc", str(RANKS), "--tokens", str(TOKENS), "--dim", str(DIM),
                         "--experts", str(EXPERTS), "--hidden", str(HIDDEN), "--top-k",
                         str(TOP_K), "--steps", str(STEPS), "--warmup", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    c = result["config"]
    assert c["ep"] == RANKS and c["backend"] == "gloo" and c["capacity"] == "dropless"
    assert list(result["variants"]) == ["ep1", "epN"]
    for v in result["variants"].values():
        assert len(v["times_s"]) == STEPS and all(t > 0 for t in v["times_s"])
        assert v["p10_s"] <= v["median_s"] <= v["p90_s"]
    assert result["variants"]["ep1"]["paired_ratio_to_ep1"] == 1.0

    # Every assignment crosses once to its expert and once back, forward and again backward:
    # 4 x (ranks x tokens x top_k) rows of dim fp32, every step, over the group.
    a2a = result["comm"]["all_to_all"]
    assert a2a["formula_per_step"] == 4 * RANKS * TOKENS * TOP_K * DIM * 4
    assert a2a["group_per_step"] == [a2a["formula_per_step"]] * STEPS and a2a["equal"]
    assert a2a["ep1_per_step"] == 0  # the local experts move nothing
    # The per-expert counts: each rank sends all of its experts' counts once per forward.
    splits = result["comm"]["all_to_all_splits"]
    assert splits["group_per_step"] == [RANKS * EXPERTS * 8] * STEPS and splits["equal"]

    one_rank = 3 * EXPERTS * HIDDEN * DIM * 4
    assert result["variants"]["ep1"]["expert_param_bytes_per_rank"] == [one_rank] * RANKS
    assert result["variants"]["epN"]["expert_param_bytes_per_rank"] == [one_rank // RANKS] * RANKS

    check = result["check"]
    assert check["ok"] and result["ok"], check
    assert set(check["max_rel_diff"]) == {"output", "input_grad", "router_grad",
                                          "expert_grad_w1", "expert_grad_w3", "expert_grad_w2"}
    assert max(check["max_rel_diff"].values()) <= 1e-5
    assert sum(check["expert_load"]) == RANKS * TOKENS * TOP_K


@pytest.mark.parametrize("argv, word", [(["--experts", "3"], "--experts"),
                                        (["--top-k", "9"], "--top-k"),
                                        (["--steps", "1"], "--steps")])
def test_bad_arguments_exit_2(argv, word, capsys):
    bench = load_benchmark("moe_ep")
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert word in capsys.readouterr().err
