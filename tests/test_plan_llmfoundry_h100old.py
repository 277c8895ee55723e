"""A second llm-foundry H100 session, held out (benchmarks/llmfoundry_h100old.py): its rows are
not in the validation, the committed result is what the planner plans now, the validation's
llm-foundry pricing holds on them, the 30B row at 8192 tokens reproduces apart, and
docs/plan.md quotes the committed result."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def mod():
    return load_benchmark("llmfoundry_h100old")


@pytest.fixture(scope="module")
def committed(mod):
    return json.loads(mod.DEFAULT_OUT.read_text())


def test_quoted_rows_are_a_held_out_session_run_three_times(mod):
    """Every quoted row is an 8-GPU H100 bf16 FULL_SHARD row of one stack, each setting run
    three times, and no row is in runs.json (none decided anything)."""
    pv = load_benchmark("planner_validation")
    held = " ".join(json.dumps(json.loads(pv.RUNS.read_text())["runs"]).split())
    lines = mod.quoted_rows(mod.TABLE)
    rows = [mod.parse(line) for line in lines]
    assert len(rows) == 66
    for line, r in zip(lines, rows, strict=True):
        assert r["gpus"] == 8 and "| FULL_SHARD |" in line and "| PURE |" in line
        assert "mosaicml/pytorch:2.0.1_cu118" in line
        assert " ".join(line.split()) not in held
    settings = Counter((r["model"], r["seq"], r["micro_batch"]) for r in rows)
    assert set(settings.values()) == {3}
    with pytest.raises(SystemExit, match="not an H100 bf16 row"):
        mod.parse(lines[0].replace("amp_bf16", "amp_fp8"))


def test_committed_result_is_what_the_planner_plans_now(mod, committed):
    lines = mod.quoted_rows(mod.TABLE)
    assert len(committed["rows"]) == len(lines)
    for line in lines[::9]:  # a few rows re-planned (the whole table is one script run)
        live = mod.predict(mod.parse(line))
        old = next(r for r in committed["rows"] if r["quote"] == line.strip())
        for key in ("error", "attention_share", "memory_gb"):
            assert old[key] == pytest.approx(live[key], abs=2e-4), (key, line)
    assert committed["summary"] == mod.summarise(committed["rows"])


def test_the_validation_pricing_holds_and_the_30b_row_reproduces(committed):
    """All but the 30B model at 8192 tokens within 8% (long sequences included, where the
    Triton attention is most of the step); those three runs over +25%, as the validation's
    row of the same setting from the other session reads over 20%."""
    s = committed["summary"]
    assert s["all_but_30b_8192"]["rows"] == 63 and s["all_but_30b_8192"]["max_abs_error"] < 0.08
    assert s["all_but_30b_8192"]["mean_abs_error"] < 0.03
    long = [r for r in committed["rows"] if r["seq"] >= 16384]
    assert len(long) == s["from_16384_tokens"]["rows"] == 18
    assert all(r["attention_share"] > 0.6 and abs(r["error"]) < 0.08 for r in long)
    apart = [r for r in committed["rows"] if (r["model"], r["seq"]) == ("mpt-30b", 8192)]
    assert len(apart) == 3 and all(r["error"] > 0.25 for r in apart)
    shorter = [r for r in committed["rows"] if r["model"] == "mpt-30b" and r["seq"] < 8192]
    assert shorter and all(abs(r["error"]) < 0.02 for r in shorter)


def test_docs_quote_the_committed_result(committed):
    pv = load_benchmark("planner_validation")
    doc = " ".join(pv.docs_text().split())
    s = committed["summary"]
    rest, long = s["all_but_30b_8192"], s["from_16384_tokens"]
    assert (f"{rest['rows']} of its {len(committed['rows'])} rows read "
            f"{100 * rest['mean_abs_error']:.1f}% off on average (worst "
            f"{100 * rest['max_abs_error']:.1f}%, {100 * rest['mean_error']:+.1f}% signed)") in doc
    shares = [r["attention_share"] for r in committed["rows"] if r["seq"] >= 16384]
    assert (f"{100 * min(shares):.0f}–{100 * max(shares):.0f}% of the planned step, "
            f"{100 * long['mean_abs_error']:.1f}% (worst "
            f"{100 * long['max_abs_error']:.1f}%)") in doc
    apart = sorted(r["error"] for r in committed["rows"]
                   if (r["model"], r["seq"]) == ("mpt-30b", 8192))
    assert f"read {100 * apart[0]:+.1f}% to {100 * apart[-1]:+.1f}%" in doc
