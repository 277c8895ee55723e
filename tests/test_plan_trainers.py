"""`meshloom plan --trainer NAME` plans the step as a public trainer runs it: the same
implementation keys the validation plans that trainer's published runs with (plan/trainers.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from meshloom.plan import PlanError
from meshloom.plan.trainers import OTHER_LOOP, TRAINERS, trainer_impl, trainer_key

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "published" / "runs.json"
PLAN = ["plan", "--model", "gpt2", "--gpus", "8", "--seq", "1024", "--global-batch", "16",
        "--top", "1", "--json"]


def test_every_published_run_has_its_trainer_and_the_validation_uses_this_table():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import planner_validation as pv
    assert pv.trainer_impl is trainer_impl
    for run in json.loads(RUNS.read_text())["runs"]:
        assert trainer_key(run["trainer"]) in TRAINERS, run["id"]


def test_a_trainer_is_its_keys_over_the_other_loop_and_meshloom_is_none():
    assert trainer_impl("meshloom") == {}
    for key, keys in TRAINERS.items():
        assert trainer_impl(key) == {**OTHER_LOOP, **keys}
    assert trainer_key("Megatron-DeepSpeed (bigscience fork)") == "megatron-deepspeed"
    assert trainer_key("TinyLlama (lit-gpt + Lightning Fabric)") == "tinyllama"
    assert trainer_key("DeepSpeed-Chat") is None
    with pytest.raises(PlanError, match="unknown trainer 'deepspeed-chat'; one of meshloom"):
        trainer_impl("deepspeed-chat")


def _plan(capsys, *extra: str) -> dict:
    from meshloom.commands import main
    assert main([*PLAN, *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_trainer_flag_is_its_fix_keys(trainer, capsys):
    """--trainer X plans exactly what --fix with X's keys plans, and says which it was."""
    by_flag = _plan(capsys, "--trainer", trainer)
    fix = ",".join(f"{k}={str(v).lower()}" for k, v in trainer_impl(trainer).items())
    by_fix = _plan(capsys, "--fix", fix)
    assert by_flag["trainer"] == trainer and by_fix["trainer"] == "meshloom"
    assert by_flag["fix"] == by_fix["fix"] == trainer_impl(trainer)
    assert by_flag["candidates"] == by_fix["candidates"]


def test_fix_overrides_the_trainers_keys(capsys):
    got = _plan(capsys, "--trainer", "llm-foundry", "--fix", "attention_kernel=fa2,zero=3")
    assert got["fix"]["attention_kernel"] == "fa2" and got["fix"]["zero"] == 3
    assert got["fix"]["optimizer_impl"] == "for_loop"  # the rest is llm-foundry's
    assert got["candidates"][0]["layout"]["zero"] == 3


def test_trainers_plan_differently_from_meshloom(capsys):
    """Not a no-op: the trainers' loops cost differently from meshloom's on the same layout."""
    pin = ["--fix", "tp=1,pp=1,dp=8,micro_batch=2,zero=3,recompute=none"]
    step = {t: _plan(capsys, "--trainer", t, *pin)["candidates"][0]["step_time_s"]
            for t in ("meshloom", "llm-foundry", "torchtitan")}
    assert len(set(step.values())) == 3, step
