"""Config loading, overrides and pre-launch validation: every bad input is one line, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

from meshloom.commands import main
from meshloom.commands.train import default_nproc
from meshloom.config import ConfigError, dump_toml, load_config
from meshloom.validation import validate

TINY = str(ROOT / "configs" / "tiny.toml")

# (extra CLI args, a fragment the one-line message must contain)
BAD = [
    (["--set", "train.stpes=5"], "did you mean 'steps'"),
    (["--set", "trian.steps=5"], "did you mean 'train'"),
    (["--set", "train.steps=abc"], "train.steps: expected int"),
    (["--set", "train.steps"], "expected key=value"),
    (["--set", "parallel.sequence_parallel=3"], "parallel.sequence_parallel: expected bool"),
    (["--nproc", "3", "--set", "parallel.dp_replicate=2"], "parallel.dp_shard=-1 cannot be"),
    (["--nproc", "2", "--set", "parallel.dp_shard=4"], "but 2 processes are launched"),
    (["--set", "parallel.dp_replicate=0"], "parallel.dp_replicate=0 must be >= 1"),
    (["--nproc", "2", "--set", "parallel.ep=2"], "parallel.ep=2 needs a mixture-of-experts"),
    (["--set", "model.preset=mixtral-tiny", "--set", "model.top_k=0"],
     "model.top_k=0 must be between 1 and model.n_experts=8"),
    (["--set", "model.preset=gpt2-tiny", "--set", "model.n_experts=4"],
     "model.n_experts is not a setting of the gpt2 family"),
    (["--nproc", "3"], "train.global_batch=16 must be divisible by the data-parallel degree 3"),
    (["--nproc", "2", "--set", "train.micro_batch=3"], "train.micro_batch=3 must divide"),
    (["--nproc", "2", "--set", "parallel.tp=2", "--set", "parallel.dp_shard=1",
      "--set", "model.n_heads=3", "--set", "model.n_kv_heads=3", "--set", "model.dim=96"],
     "model.n_heads=3 must be divisible by parallel.tp=2"),
    (["--nproc", "4", "--set", "parallel.tp=4", "--set", "parallel.dp_shard=1"],
     "model.n_kv_heads=2 must be divisible by parallel.tp=4 (fewer KV heads"),
    (["--nproc", "2", "--set", "parallel.tp=2", "--set", "model.ffn_hidden=101"],
     "model.ffn_hidden=101 must be divisible by parallel.tp=2"),
    (["--nproc", "2", "--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true",
      "--set", "data.seq_len=63"], "data.seq_len=63 must be divisible by parallel.tp=2"),
    (["--nproc", "2", "--set", "parallel.pp=2", "--set", "parallel.pp_virtual_stages=2"],
     "parallel.pp_virtual_stages=2 needs parallel.pp_schedule=interleaved_1f1b"),
    (["--nproc", "4", "--set", "parallel.pp=4", "--set", "parallel.pp_schedule=interleaved_1f1b",
      "--set", "parallel.pp_virtual_stages=2"], "8 stages exceeds model.n_layers=4"),
    (["--nproc", "2", "--set", "parallel.pp=2", "--set", "parallel.pp_layers=[3, 2]"],
     "parallel.pp_layers=[3, 2] must list 2 stage sizes"),
    (["--nproc", "2", "--set", "parallel.pp=2", "--set", "parallel.pp_microbatches=3"],
     "parallel.pp_microbatches=3 must divide the per-pipeline batch 16"),
    (["--nproc", "4", "--set", "parallel.pp=4", "--set", "parallel.pp_schedule=interleaved_1f1b",
      "--set", "parallel.pp_virtual_stages=1", "--set", "parallel.pp_microbatches=2"],
     "needs the micro-batch count (2) to be a multiple of parallel.pp=4"),
    (["--nproc", "4", "--set", "parallel.pp=2", "--set", "parallel.zero_stage=2",
      "--set", "model.tie_embeddings=true"], "tied embeddings across pipeline stages"),
    (["--nproc", "2", "--set", "parallel.cp=2", "--set", "data.seq_len=62"],
     "data.seq_len=62 must be divisible by 2 x parallel.cp = 4"),
    (["--set", "parallel.zero_stage=5"], "parallel.zero_stage=5 must be 0, 1, 2 or 3"),
    (["--set", "parallel.zero_stage=1"], "parallel.zero_stage=1 shards over parallel.dp_shard"),
    (["--set", "parallel.pp_schedule=zigzag"], "parallel.pp_schedule: unknown schedule"),
    (["--set", "parallel.sequence_parallel=true"], "parallel.sequence_parallel needs"),
    (["--set", "run.backend=nccl"], "run.backend=nccl"),
    (["--set", "run.backend=tcp"], "run.backend: unknown backend"),
    (["--set", "run.backend=mpi"], "run.backend=mpi is not available"),
    (["--set", "train.lr=0"], "train.lr=0.0 must be > 0"),
    (["--set", "train.steps=0"], "train.steps=0 must be >= 1"),
    (["--set", "data.seq_len=1000"], "data.seq_len=1000 exceeds model.max_seq_len=256"),
    (["--set", "data.val_fraction=1.5"], "data.val_fraction=1.5 must be in (0, 1)"),
    (["--set", "model.preset=tiyn"], "did you mean 'tiny'"),
    (["--set", "model.n_heads=3"], "model."),
    (["--set", "model.vocab_size=100"], "model.vocab_size=100 is smaller than the tokenizer"),
    (["--set", "data.source=/nonexistent/*.txt"], "data.source"),
    (["--set", "data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer"),
    (["--set", "train.eval_sequences=20"], "train.eval_sequences=20 must be a multiple"),
    (["--set", "run.keep_checkpoints=0"], "run.keep_checkpoints=0 must be >= 1"),
    (["--nproc", "-1"], "--nproc=-1"),
    (["--set", "train.dtype=bf61"], "train.dtype: unknown dtype 'bf61' (did you mean 'bf16'?)"),
    (["--set", "parallel.cpu_offload=true"], "parallel.cpu_offload needs parallel.zero_stage"),
    (["--nproc", "2", "--set", "parallel.zero_stage=2", "--set", "parallel.reduce_once=true"],
     "parallel.reduce_once needs parallel.zero_stage=3, not 2"),
    (["--set", "parallel.reduce_dtype=fp8"], "parallel.reduce_dtype: unknown dtype 'fp8'"),
    (["--nproc", "2", "--set", "parallel.rank_devices=2", "--set", "parallel.pp=2"],
     "parallel.rank_devices (several devices per rank) does not combine with parallel.pp=2"),
    (["--set", "parallel.rank_device_blocks=[2, 2]"], "only used with parallel.rank_devices"),
    (["--set", "parallel.rank_devices=2", "--set", "parallel.rank_device_blocks=[1, 1]"],
     "parallel.rank_device_blocks=[1, 1] must list 2 block counts"),
]


@pytest.mark.parametrize("args,fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_config_is_one_line_exit_2(args, fragment, capsys, tmp_path):
    rc = main(["train", TINY, "--set", f"run.dir={tmp_path}", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0, err
    assert err.startswith("meshloom: error: ")
    assert fragment in err, err


def test_missing_and_malformed_files(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    assert main(["train", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[trainn]\nsteps = 3\n")
    assert main(["train", str(unknown)]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err


def test_existing_checkpoints_need_resume(tmp_path, capsys):
    (tmp_path / "checkpoints" / "step_0000003").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_0000003" / "meta.json").write_text("{}")
    assert main(["train", TINY, "--set", f"run.dir={tmp_path}"]) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_cli_subprocess_no_traceback(tmp_path):
    """The real command: exit 2, one line on stderr, no Python traceback."""
    proc = subprocess.run([sys.executable, "-m", "meshloom", "train", TINY, "--set",
                           "parallel.tpp=2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("meshloom: error: parallel.tpp: unknown key "
                                   "(did you mean 'tp'?)")


def test_overrides_types_and_roundtrip(tmp_path):
    cfg = load_config(TINY, ["train.lr=1e-3", "train.steps=7", "data.source=['a', 'b']",
                             "run.dir=some/where", "parallel.sequence_parallel=false",
                             "model.dim=128"])
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 7
    assert cfg.data.source == ["a", "b"]
    assert cfg.run.dir == "some/where" and cfg.model.dim == 128
    # An int is accepted where a float is expected; the dumped TOML loads back identically.
    cfg2 = load_config(TINY, ["train.lr=1"])
    assert cfg2.train.lr == 1.0 and isinstance(cfg2.train.lr, float)
    out = tmp_path / "resolved.toml"
    out.write_text(dump_toml(cfg))
    assert load_config(out).to_dict() == cfg.to_dict()


def test_layout_resolution():
    cfg = load_config(TINY)
    assert default_nproc(cfg) == 1
    dims = validate(cfg, 4, check_data=False)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp) == (1, 4, 4)
    cfg = load_config(TINY, ["parallel.dp_replicate=2"])
    dims = validate(cfg, 4, check_data=False)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 2)
    with pytest.raises(ConfigError, match="parallel.dp_shard=-1 cannot be inferred"):
        validate(load_config(TINY, ["parallel.dp_replicate=3"]), 4, check_data=False)


def test_demo_config_is_valid():
    from meshloom.launch import builtin_config

    cfg = load_config(builtin_config("demo"))
    dims = validate(cfg, default_nproc(cfg))
    # The 2-D layout of the demo: FSDP over 2 data-parallel shards x tensor parallel 2.
    assert (dims.dp_shard, dims.tp, dims.world_size) == (2, 2, 4)
    assert cfg.parallel.zero_stage == 3
