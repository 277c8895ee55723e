"""`meshloom plan --trainer NAME` plans the step as a public trainer runs it: the same
implementation keys the validation plans that trainer's published runs with (plan/trainers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_benchmark

from meshloom.plan import PlanError
from meshloom.plan.trainers import OTHER_LOOP, TRAINERS, trainer_impl, trainer_key

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "published" / "runs.json"
PLAN = ["plan", "--model", "gpt2", "--gpus", "8", "--seq", "1024", "--global-batch", "16",
        "--top", "1", "--json"]


def test_every_published_run_has_its_trainer_and_the_validation_uses_this_table():
    pv = load_benchmark("planner_validation")
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
    """--trainer X prices a layout exactly as --fix with X's keys does, and says which it
    was (on a layout every trainer runs: its search is limited to those, below)."""
    pin = "tp=1,pp=1,cp=1,zero=0,recompute=none"
    by_flag = _plan(capsys, "--trainer", trainer, "--fix", pin)
    fix = ",".join(f"{k}={str(v).lower()}" for k, v in trainer_impl(trainer).items())
    by_fix = _plan(capsys, "--fix", f"{fix},{pin}")
    assert by_flag["trainer"] == trainer and by_fix["trainer"] == "meshloom"
    assert by_flag["fix"] == by_fix["fix"]
    assert {k: v for k, v in by_flag["fix"].items() if k in trainer_impl(trainer)} == \
        trainer_impl(trainer)
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


def _lay(**kw):
    from meshloom.plan.layout import Layout
    return Layout(**kw)


def test_every_published_layout_is_one_its_trainer_runs():
    """The layout rules agree with what ran: no published run's layout is refused by its
    trainer's rules (plan/trainers.py LAYOUT_RULES)."""
    from meshloom.plan.trainers import layout_problem
    runs = json.loads(RUNS.read_text())["runs"]
    for run in runs:
        lay = run["layout"]
        got = layout_problem(trainer_key(run["trainer"]), _lay(
            tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], cp=lay["cp"],
            dp_replicate=lay.get("dp_replicate", 1), micro_batch=run["micro_batch"],
            zero=lay["zero"], recompute=lay["recompute"], schedule=lay.get("schedule") or "1f1b",
            v=lay.get("v", 1), sp=lay.get("sp", False), ep=lay.get("ep", 1)))
        assert got is None, (run["id"], got)


@pytest.mark.parametrize("trainer, layout, key, why", [
    ("nemo", dict(dp=8, zero=2), "zero", "nemo shards only the optimizer state"),
    ("megatron-lm", dict(pp=2, dp=4, schedule="gpipe"), "schedule",
     "1F1B or interleaved 1F1B"),
    ("megatron-deepspeed", dict(pp=2, dp=4, zero=2), "zero", "refuses ZeRO-2 and ZeRO-3"),
    ("megatron-deepspeed", dict(cp=2, dp=4), "cp", "has no context parallel"),
    ("llm-foundry", dict(tp=2, dp=4), "tp", "llm-foundry is data-parallel only"),
    ("llm-foundry", dict(dp=8, zero=1), "zero", "shards as ZeRO-0/2/3 only"),
    ("tinyllama", dict(dp=8, zero=3, recompute="selective"), "recompute", "whole blocks only"),
    ("flash-attention", dict(dp=8, zero=3), "zero", "ZeRO-0/1/2 only"),
    ("flash-attention", dict(dp=8, recompute="full"), "recompute", "mlp_checkpoint_lvl"),
    ("torchtitan", dict(dp=8, zero=1), "zero", "never ZeRO-1"),
    ("torchtitan", dict(tp=2, dp=4, zero=0), "zero", "DDP only as 1-D"),
    ("torchtitan", dict(pp=2, dp=4, zero=2), "zero", "held gathered for the step"),
    ("torchtitan", dict(dp=8, zero=2), "zero", "shards with FSDP2: ZeRO-3"),
    ("kempnerforge", dict(dp=8, zero=1), "zero", "FSDP2 only"),
    ("kempnerforge", dict(tp=2, dp=4, zero=0, sp=True), "zero", "FSDP2 only"),
    ("kempnerforge", dict(dp=8, zero=3, recompute="selective"), "recompute",
     "whole attention modules"),
    ("kempnerforge", dict(pp=2, dp=4, zero=3, schedule="interleaved_1f1b", v=2), "schedule",
     "one pipeline stage a rank"),
    ("kempnerforge", dict(tp=4, dp=2, zero=3), "sp", "sequence parallel outside a pipeline"),
    ("kempnerforge", dict(tp=2, pp=2, dp=2, zero=3, sp=True, schedule="1f1b"), "sp",
     "without it inside one"),
])
def test_layout_rules_refuse_what_the_trainer_cannot_run(trainer, layout, key, why):
    from meshloom.plan.trainers import layout_problem
    got = layout_problem(trainer, _lay(**layout))
    assert got is not None and why in got and got.startswith(trainer), got
    # Pinning the key the rule names leaves the layout to the user.
    assert layout_problem(trainer, _lay(**layout), pinned=frozenset({key})) is None


def test_rules_accept_what_the_trainer_runs_and_a_pinned_key_hides_no_other_problem():
    from meshloom.plan.trainers import layout_problem
    ok = [("nemo", dict(tp=4, pp=2, dp=1, zero=1, schedule="interleaved_1f1b", v=2)),
          ("megatron-deepspeed", dict(dp=8, zero=3)),  # no pipeline: any ZeRO stage
          ("torchtitan", dict(pp=2, dp=4, zero=3)), ("torchtitan", dict(dp=8, zero=0)),
          ("torchtitan", dict(tp=8, zero=1)),  # one data-parallel rank: no sharding at all
          ("llm-foundry", dict(dp=8, zero=3, recompute="full")),
          ("kempnerforge", dict(tp=4, dp=2, zero=3, sp=True)), ("kempnerforge", dict(dp=1)),
          ("kempnerforge", dict(tp=2, pp=2, dp=2, zero=3, schedule="1f1b")),
          ("kempnerforge", dict(pp=2, dp=4, zero=3, schedule="gpipe", recompute="full")),
          ("meshloom", dict(tp=2, pp=2, dp=2, zero=1))]
    for trainer, layout in ok:
        assert layout_problem(trainer, _lay(**layout)) is None, (trainer, layout)
    both = _lay(tp=2, pp=2, dp=2)
    assert "data-parallel only" in layout_problem("llm-foundry", both, frozenset({"tp"}))
    assert layout_problem("llm-foundry", both, frozenset({"tp", "pp"})) is None


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_a_trainers_search_returns_only_layouts_it_runs(trainer, capsys):
    from meshloom.plan.layout import Layout
    from meshloom.plan.trainers import layout_problem
    got = _plan(capsys, "--trainer", trainer, "--top", "40")
    assert got["candidates"]
    for c in got["candidates"]:
        lay = Layout(**{k: v for k, v in c["layout"].items() if k in Layout.__annotations__})
        assert layout_problem(trainer, lay) is None, (trainer, c["layout"])


def test_no_layout_the_trainer_runs_is_a_one_line_error(capsys):
    from meshloom.commands import main
    assert main(["plan", "--model", "gpt2", "--gpus", "8", "--trainer", "llm-foundry",
                 "--fix", "dp=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("meshloom plan: error: no layout with --fix dp=4 that the trainer runs: "
                   "llm-foundry is data-parallel only")


def test_a_meshloom_config_is_not_written_from_another_trainers_plan(tmp_path, capsys):
    from meshloom.commands import main
    out = tmp_path / "best.toml"
    assert main(["plan", "--model", "llama3-1b", "--gpus", "8", "--trainer", "nemo",
                 "--write-config", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("meshloom plan: error: --write-config writes a meshloom config, but "
                   "--trainer nemo plans nemo's step; drop one of them")
    assert not out.exists()


def _argv_for(run: dict) -> list[str]:
    """`meshloom plan` flags that plan a published run as the validation does: its model by
    dimensions, its cluster, --trainer, and --fix with its layout and whatever the run sets
    beyond its trainer's keys."""
    pv = load_benchmark("planner_validation")
    m = run["model"]
    argv = ["plan", "--arch", m["arch"], "--hidden", str(m["hidden"]), "--layers",
            str(m["layers"]), "--heads", str(m["heads"]), "--vocab", str(m["vocab"]),
            "--kv-heads", str(m["kv_heads"]), "--ffn-hidden", str(m["ffn_hidden"])]
    if m["arch"] == "gpt":
        argv += ["--positions", str(m["positions"]),
                 "--tied" if m["tied_embeddings"] else "--no-tied",
                 "--linear-bias" if m["linear_bias"] else "--no-linear-bias"]
        if m.get("dropout") is not None:
            argv.append("--dropout" if m["dropout"] else "--no-dropout")
    argv += ["--gpu", run["gpu"], "--gpus", str(run["gpus"]), "--gpus-per-node",
             str(run.get("gpus_per_node", 8)), "--seq", str(run["seq"]), "--global-batch",
             str(run["global_batch"]), "--attention", run.get("attention", "flash")]
    if run.get("gpu_memory_gb"):
        argv += ["--gpu-memory-gb", str(run["gpu_memory_gb"])]
    if run.get("inter_gbps"):
        argv += ["--inter-node-gbps", str(run["inter_gbps"])]
    key = trainer_key(run["trainer"])
    fixed, _ = pv.run_fixed(run)
    own = trainer_impl(key)
    extra = {k: v for k, v in fixed.items() if k not in own or own[k] != v}
    return argv + ["--trainer", key, "--fix",
                   ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                            for k, v in extra.items())]


def test_a_published_run_is_planned_from_the_command_line_as_the_validation_plans_it(capsys):
    """For the first run of each trainer whose model the flags can state, `meshloom plan
    --trainer T --fix <its layout and own settings>` gives the validation row's shape and
    throughput: what a user types reproduces docs/plan.md's table."""
    from meshloom.commands import main
    pv = load_benchmark("planner_validation")
    rows = {r["id"]: r for r in json.loads(pv.DEFAULT_OUT.read_text())["rows"]}
    done = set()
    for run in json.loads(RUNS.read_text())["runs"]:
        key = trainer_key(run["trainer"])
        if key in done or run["model"].get("n_experts") or run["model"].get("rotary") is False:
            continue  # MoE dims and ALiBi have no plan flags; the next run of it stands in
        argv = _argv_for(run)
        assert main([*argv, "--top", "1", "--json"]) == 0, run["id"]
        got = json.loads(capsys.readouterr().out)
        assert got["model"] == pv.run_shape(run).to_dict() | {"name": got["model"]["name"]}
        assert got["candidates"][0]["tokens_per_s_per_gpu"] == pytest.approx(
            rows[run["id"]]["predicted_tokens_per_s_per_gpu"], rel=1e-3), run["id"]
        if run["id"] == "nemo-h100-gpt3-175b-2048-128gpu-2411":  # docs/plan.md shows it
            assert f"meshloom {' '.join(argv)}\n" in pv.docs_text()
            assert f"(planned {round(got['candidates'][0]['tokens_per_s_per_gpu'])} tokens/s " \
                   f"per GPU,\n  published {round(run['published']['tokens_per_s_per_gpu'])}" \
                in pv.docs_text()
        done.add(key)
    assert done == set(TRAINERS) - {"megatron-lm", "megatron-deepspeed"}


def test_kempnerforge_keeps_bf16_parameters_and_moments_only(capsys):
    """KempnerForge trains a bf16 model with no fp32 master (its AdamW moments are bf16): on
    one GPU its model states are 2 + 2 + 4 bytes a parameter, where torchtitan's bf16 FSDP2
    model keeps an fp32 master and fp32 moments (12 bytes of optimizer state a parameter)."""
    args = [a for a in PLAN if a not in ("--gpus", "8")]
    pin = ["--gpus", "1", "--fix", "tp=1,pp=1,cp=1,dp=1,zero=0,recompute=full"]
    from meshloom.commands import main

    def states(trainer: str) -> dict:
        assert main([*args, *pin, "--trainer", trainer]) == 0
        return json.loads(capsys.readouterr().out)["candidates"][0]["memory_per_gpu_bytes"]

    kf, titan = states("kempnerforge"), states("torchtitan")
    assert kf["params"] > 0 and kf["params"] == kf["grads"] == kf["optimizer"] / 2
    assert titan["params"] == kf["params"] and titan["optimizer"] == 3 * kf["optimizer"]
