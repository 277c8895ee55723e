"""`meshloom plan --config`: a training config priced as it stands (plan/from_config.py), the
inverse of `--write-config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshloom.config import load_config
from meshloom.plan import PlanError
from meshloom.plan.from_config import plan_from_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _plan_json(capsys, *args: str) -> dict:
    from meshloom.commands import main
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model, fix", [("small", "tp=2"), ("llama3-8b", "zero=3,pp=2"),
                                         ("gpt2-medium", "tp=1")])
def test_a_written_config_plans_back_to_the_same_step(tmp_path, capsys, model, fix):
    """What `--write-config` writes, `--config` reads back to the same model, layout, memory
    and step time; llama3-8b's config names its 128,256-word vocabulary, which the run would
    otherwise take from the tokenizer (257 bytes) and train a smaller model than planned."""
    out = tmp_path / "best.toml"
    first = _plan_json(capsys, "--model", model, "--gpus", "8", "--seq", "1024",
                       "--global-batch", "32", "--top", "1", "--fix", fix,
                       "--write-config", str(out))
    again = _plan_json(capsys, "--config", str(out))
    a, b = first["candidates"][0], again["candidates"][0]
    assert b["layout"] == a["layout"] and b["step_time_s"] == a["step_time_s"]
    assert b["memory_per_gpu_bytes"] == a["memory_per_gpu_bytes"]
    for key in ("hidden", "layers", "heads", "kv_heads", "vocab", "params"):
        assert again["model"][key] == first["model"][key], key
    assert (again["seq"], again["global_batch"], again["dtype"]) == (1024, 32, "bf16")


def test_the_gpt2_xl_config_fits_two_24gb_gpus_only_sharded(capsys):
    """configs/gpt2_xl_fsdp.toml as it stands: ZeRO-3 over 2 Titan RTX fits; the DDP twin its
    comment gives (`--set parallel.zero_stage=0`) does not (docs/gpt2_fsdp.md)."""
    path = str(CONFIGS / "gpt2_xl_fsdp.toml")
    fsdp = _plan_json(capsys, "--config", path, "--gpu", "titan-rtx-24g")
    ddp = _plan_json(capsys, "--config", path, "--gpu", "titan-rtx-24g", "--set",
                     "parallel.zero_stage=0")
    assert fsdp["candidates"][0]["fits"] and fsdp["candidates"][0]["layout"]["zero"] == 3
    assert not ddp["candidates"][0]["fits"] and ddp["candidates"][0]["layout"]["zero"] == 0
    assert fsdp["model"]["name"] == "gpt2-xl" and fsdp["cluster"]["gpus"] == 2


def test_the_micro_batch_is_the_runs():
    """Unset, a rank's whole share of the batch; under a pipeline, that share over
    parallel.pp_microbatches, or over pp x virtual stages (pipeline_microbatches)."""
    cfg = load_config(CONFIGS / "tiny.toml", ["parallel.dp_shard=4", "train.global_batch=32",
                                              "train.micro_batch=0"])
    assert plan_from_config(cfg, None).fixed["micro_batch"] == 8
    piped = ["parallel.dp_shard=2", "parallel.pp=2", "train.global_batch=32",
             "train.micro_batch=0"]
    cfg = load_config(CONFIGS / "tiny.toml", [*piped, "parallel.pp_microbatches=8"])
    got = plan_from_config(cfg, None)
    assert got.fixed["micro_batch"] == 2 and got.gpus == 4 and got.fixed["schedule"] == "1f1b"
    cfg = load_config(CONFIGS / "tiny.toml", [*piped, "parallel.pp_schedule=interleaved_1f1b",
                                              "parallel.pp_virtual_stages=2"])
    assert plan_from_config(cfg, None).fixed["micro_batch"] == 4


def test_zero3_run_options_are_planned_as_set():
    cfg = load_config(CONFIGS / "tiny.toml", ["parallel.zero_stage=3", "parallel.dp_shard=2",
                                              "parallel.reshard_after_forward=false",
                                              "parallel.reduce_once=true",
                                              "parallel.reduce_dtype=bf16", "train.compile=true",
                                              "train.dtype=bf16"])
    got = plan_from_config(cfg, None)
    assert got.fixed["reshard_after_forward"] is False and got.fixed["fsdp_no_sync"] is True
    assert got.fixed["grad_reduce_dtype"] == "bf16" and got.fixed["compile"] is True
    assert got.dtype == "bf16" and got.shape.vocab == 257  # the byte tokenizer's


@pytest.mark.parametrize("args, msg", [
    (["--seq", "8"], "--config sets the model, batch and layout; drop --seq"),
    (["--model", "tiny"], "drop --model"),
    (["--fix", "tp=2"], "--fix tp: the --config sets the layout"),
    (["--gpus", "8"], "make 2 GPUs (pp 1 x dp_replicate 1 x dp_shard 2"),
    (["--set", "parallel.cpu_offload=true"], "parallel.cpu_offload: the planner does not price"),
    (["--set", "parallel.pp_layers=[1,1]", "--set", "parallel.pp=2",
      "--set", "parallel.dp_shard=1"], "parallel.pp_layers: the planner does not price"),
    (["--set", "parallel.dp_shard=-1"], "parallel.dp_shard=-1 takes whatever the GPUs leave"),
    (["--set", "train.global_batch=3"], "train.global_batch=3 must be divisible by the "
                                        "data-parallel degree 2"),
    (["--set", "train.micro_batch=3"], "train.micro_batch=3 must divide the per-rank batch"),
    (["--set", "parallel.pp=2", "--set", "parallel.dp_shard=1", "--set",
      "parallel.pp_microbatches=3"], "parallel.pp_microbatches=3 must divide"),
    (["--set", "parallel.nosuch=1"], "parallel.nosuch"),
])
def test_a_config_plan_refuses_in_one_line(args, msg, capsys):
    from meshloom.commands import main
    path = str(CONFIGS / "gpt2_small_cpu.toml")
    assert main(["plan", "--config", path, *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1, err


def test_set_needs_a_config(capsys):
    from meshloom.commands import main
    assert main(["plan", "--model", "tiny", "--set", "train.steps=3"]) == 2
    assert "--set overrides a --config's keys" in capsys.readouterr().err


def test_unset_degrees_take_the_gpus():
    cfg = load_config(CONFIGS / "tiny.toml", ["parallel.dp_shard=-1", "parallel.tp=2"])
    got = plan_from_config(cfg, 8)
    assert (got.gpus, got.fixed["tp"], got.fixed["dp"]) == (8, 2, 4)
    with pytest.raises(PlanError, match="give --gpus"):
        plan_from_config(cfg, None)
