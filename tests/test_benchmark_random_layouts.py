"""benchmarks/random_layouts.py: its draws are layouts the config accepts as written, they reach
every axis and option, and a run records, bounds and fails as documented."""

from __future__ import annotations

import json
import random

import pytest
from conftest import load_benchmark

from meshloom.config import load_config

rl = load_benchmark("random_layouts")


def test_draws_parse_and_cover_every_axis_and_option():
    rng = random.Random(0)
    seen: dict[str, set] = {}
    for _ in range(400):
        family, world, ov = rl.draw(rng)
        assert world in (2, 4)
        cfg = load_config(rl.ROOT / "configs" / "tiny.toml", [*rl._model(family), *ov])
        p = cfg.parallel
        assert p.tp * p.pp * p.cp * p.dp_replicate * p.dp_shard == world  # no axis inferred
        for o in ov:
            key, value = o.split("=")
            seen.setdefault(key, set()).add(value)
        seen.setdefault("family", set()).add(family)
    assert seen["family"] == set(rl.FAMILIES)
    for axis in ("tp", "pp", "cp", "dp_replicate", "ep"):
        assert "2" in seen[f"parallel.{axis}"], axis
    assert seen["parallel.zero_stage"] == {"0", "1", "2", "3"}
    assert seen["parallel.pp_schedule"] == set(rl.SCHEDULES)
    assert seen["train.activation_checkpointing"] == {"selective", "full"}
    assert {"true"} <= seen["parallel.sequence_parallel"]
    assert seen["parallel.reshard_after_forward"] == {"true", "false"}


def test_a_short_run_trains_accepted_draws_and_writes_its_bounds(tmp_path):
    out = tmp_path / "r.json"
    rl.main(["--layouts", "2", "--seed", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["layouts"] == len(result["rows"]) == 2
    assert s["draws"] == 2 + s["refused_before_launch"]
    assert s["failed_after_acceptance"] == s["beyond_bound"] == 0
    assert s["bounds"] == rl.BOUNDS["fp32"]
    assert {"tp", "pp", "cp", "ep", "zero_stage=3", "zb_h1", "recompute"} <= set(s["covered"])
    assert sum(s["covered"][a] for a in ("tp", "pp", "cp", "dp_replicate", "dp_shard")) >= 2
    for row in result["rows"]:
        assert row["ok"] and 0 <= row["max_rel_loss_diff"] <= 1e-5
        assert 0 <= row["max_rel_grad_norm_diff"] <= 1e-4
    assert result["config"]["git"]["commit"]


def test_a_draw_beyond_its_bound_fails_the_run(tmp_path, monkeypatch):
    """Negative bounds, which every draw exceeds (even one that matched bit for bit): the run
    records it and exits 1."""
    monkeypatch.setitem(rl.BOUNDS, "fp32", {"loss": -1.0, "norm_first": -1.0,
                                             "norm_later": -1.0})
    with pytest.raises(SystemExit) as e:
        rl.main(["--layouts", "1", "--seed", "3", "--out", str(tmp_path / "r.json")])
    assert e.value.code == 1
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["beyond_bound"] == 1


def test_bf16_draws_also_compare_with_one_bf16_process(tmp_path):
    out = tmp_path / "r.json"
    rl.main(["--layouts", "1", "--seed", "5", "--dtype", "bf16", "--out", str(out)])
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    s = result["summary"]
    assert s["bounds"] == rl.BOUNDS["bf16"] and row["ok"]
    assert "train.dtype=bf16" not in row["overrides"]  # recorded once, in the config
    assert result["config"]["dtype"] == "bf16"
    assert row["same_dtype"]["max_rel_loss_diff"] > 0  # bf16 rounding moved something
    assert set(s["one_process_vs_fp32"]) == {row["family"]}
    assert s["one_process_vs_fp32"][row["family"]]["max_rel_loss_diff"] > 0
