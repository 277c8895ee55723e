"""Smoke test of benchmarks/pp_vs_torch.py: a tiny run on 2 Gloo ranks (2 pipeline ranks, 2
virtual stages for the interleaved schedules), checking the JSON shape, the ratios, that every
variant computed the same gradients, the lists each side ran, the bubble figures and the bytes
that follow from the micro-batch shapes alone."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

from meshloom.parallel.pipeline_schedule import build_schedule, simulate

SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "interleaved_zb"]
VARIANTS = [f"{side}_{s}" for s in SCHEDULES for side in ("meshloom", "torch")]


def test_pp_vs_torch_smoke(tmp_path):
    out = tmp_path / "results" / "pp_vs_torch.json"
    steps, m, b, seq, pp, v = 2, 4, 2, 16, 2, 2
    bench = load_benchmark("pp_vs_torch")
    assert tuple(VARIANTS) == bench.VARIANTS  # the default runs every schedule on both sides
    result = bench.main(["--nproc", str(pp), "--preset", "tiny", "--steps", str(steps),
                        "--warmup", "1", "--microbatches", str(m), "--batch", str(b),
                        "--seq", str(seq), "--virtual-stages", str(v), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    c = result["config"]
    assert c["nproc"] == c["pp"] == pp and c["backend"] == "gloo" and c["microbatches"] == m
    # tiny: 4 blocks, balanced; 4 stages of one block each when interleaved
    assert c["stage_layers"] == {"1": [[0, 2], [2, 4]], "2": [[0, 1], [1, 2], [2, 3], [3, 4]]}
    assert list(result["variants"]) == VARIANTS
    res = result["variants"]
    for name in VARIANTS:
        s = res[name]
        sched = s["schedule"]
        chunks = v if sched.startswith("interleaved") else 1
        assert s["virtual_stages"] == chunks
        base = res[f"torch_{sched}"]
        assert s["torch_baseline"] == f"torch_{sched}"
        assert len(s["times_s"]) == steps and all(t > 0 for t in s["times_s"])
        assert s["p10_s"] <= s["median_s"] <= s["p90_s"]
        assert s["ratio_to_torch"] == s["median_s"] / base["median_s"]
        assert s["paired_ratio_to_torch"] > 0
        # The lists: ours, or torch's own for its multi-stage classes (the interleaved ones and
        # zb_h1, which is its interleaved zero-bubble class over one stage per rank).
        lists = s["lists"]
        torch_runs_lists = name.startswith("torch") and sched not in ("1f1b", "gpipe")
        assert (lists["source"] == "torch's pipeline_order") == torch_runs_lists
        ours = [[a for a in acts if a.kind in "FBIW"] for acts in build_schedule(sched, pp, m,
                                                                                    chunks)]
        if not torch_runs_lists:
            assert lists["same_as_meshloom"]
            assert lists["compute"] == [" ".join(map(str, acts)) for acts in ours]
        # every stage's every micro-batch: one forward and one whole backward, or I and W
        ran = sorted(a for r in lists["compute"] for a in r.split())
        assert ran == sorted(str(a) for acts in ours for a in acts)
        bub = s["bubble"]
        assert len(bub["measured_per_step"]) == steps
        assert all(0.0 <= x < 1.0 for x in bub["measured_per_step"])
        assert 0.0 <= bub["measured_median"] < 1.0
        if not torch_runs_lists:
            assert bub["predicted_unit_cost"] == simulate(build_schedule(sched, pp, m,
                                                                         chunks)).bubble()
        assert 0.0 <= bub["predicted_measured_costs"] < 1.0
        kinds = "FIW" if "zb" in sched else "FB"
        assert set(bub["compute_median_s"]) == {f"{k}{st}" for k in kinds
                                                for st in range(pp * chunks)}
        assert 0 < max(bub["busy_median_s"]) <= bub["makespan_median_s"]
        # Activations forward and their gradients backward over every stage boundary, once
        # per micro-batch, the same for ours (our CommCounter) and torch's (its send ops).
        expected = 2 * (pp * chunks - 1) * m * b * seq * 64 * 4
        assert s["comm"]["expected_bytes_per_step"] == expected
        assert s["comm"]["bytes_per_step"] == expected
        assert sum(s["comm"]["by_rank"]) == expected
        assert s["final_loss"] > 0
    # Unit costs, 2 ranks, m micro-batches: (p - 1) / (m + p - 1) for 1F1B and GPipe.
    assert abs(res["meshloom_1f1b"]["bubble"]["predicted_unit_cost"] - 1 / (m + 1)) < 1e-12
    assert abs(res["torch_gpipe"]["bubble"]["predicted_unit_cost"] - 1 / (m + 1)) < 1e-12
    for sched in SCHEDULES:
        assert res[f"torch_{sched}"]["ratio_to_torch"] == 1.0
    # Same weights, same micro-batches: every variant computes the same gradients of the whole
    # model (m a power of two: both ways of averaging are exact).
    grads = result["check"]["grads"]
    assert grads["ok"], grads
    assert set(grads["max_rel_diff"]) == set(VARIANTS)
    assert max(grads["max_rel_diff"].values()) < 1e-5
    assert grads["tensors"] == 4 * 9 + 3  # 9 tensors a block; embedding, final norm, head
    assert result["clock_skew_s"]["median"] >= 0.0


def test_pp_vs_torch_refuses_what_a_schedule_cannot_run(capsys):
    """One line naming the option, before any rank starts."""
    bench = load_benchmark("pp_vs_torch")
    for argv, says in [
        (["--preset", "tiny", "--virtual-stages", "3"], "6 pipeline stages need at least"),
        (["--microbatches", "5", "--variants", "meshloom_interleaved_zb"],
         "need --microbatches (5) to be a multiple of --nproc (2)"),
        (["--microbatches", "5", "--variants", "torch_zb_h1"], "multiple of its rounds"),
        (["--virtual-stages", "1"], "--virtual-stages must be >= 2"),
    ]:
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert says in capsys.readouterr().err
