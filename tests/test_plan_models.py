"""Model shapes for the planner: exact parameter counts against real models and published sizes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from meshloom.models import llama
from meshloom.plan import PlanError
from meshloom.plan.models import (
    MEGATRON_TABLE1,
    PRESETS,
    ModelShape,
    from_dims,
    from_hf_config,
    resolve_model,
)

# Hugging Face GPT2LMHeadModel.num_parameters() of the released checkpoints.
HF_GPT2_COUNTS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}


def _write_config(tmp_path: Path, data: dict, folder: str = "model") -> Path:
    directory = tmp_path / folder
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(data))
    return directory


# --- meshloom's own Llama -------------------------------------------------------------------

@pytest.mark.parametrize("name", list(llama.PRESETS))
def test_llama_presets_match_meshloom_count(name):
    cfg = llama.config_from_preset(name)
    shape = PRESETS[name]
    assert shape.arch == "llama" and shape.positions == 0
    assert shape.params == cfg.num_params()
    assert shape.tied == cfg.tie_embeddings
    assert shape.ffn_hidden == cfg.hidden and shape.kv_heads == cfg.kv_heads
    # The matmul count is what FLOPs use: meshloom's 6N term counts blocks plus the head.
    n_matmul = shape.layers * shape.layer_matmul_params + shape.vocab * shape.hidden
    assert 6.0 * n_matmul == cfg.flops_per_token(0)


@pytest.mark.parametrize("name", ["tiny", "demo"])
@pytest.mark.parametrize("tie", [False, True])
def test_llama_shape_matches_built_model(name, tie):
    cfg = llama.config_from_preset(name, tie_embeddings=tie)
    model = llama.Llama(cfg)
    # parameters() yields a shared (tied) tensor once, so this is the real storage count.
    real = sum(p.numel() for p in model.parameters())
    shape = from_dims("llama", cfg.dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size,
                      kv_heads=cfg.kv_heads, tied=tie)
    assert shape.ffn_hidden == cfg.hidden  # same default SwiGLU width rule
    assert shape.params == real == cfg.num_params()
    block = sum(p.numel() for p in model.layers[0].parameters())
    assert shape.layer_params == block


def test_from_dims_llama_uses_meshloom_width_rule():
    shape = from_dims("llama", 4096, 32, 32, 32000)
    # meshloom rounds 2/3 * 4h up to a multiple of 32 (Meta used 256, giving Llama-2's 11008).
    assert shape.ffn_hidden == llama.LlamaConfig(dim=4096).hidden == 10944
    assert shape.kv_heads == 32 and not shape.tied and shape.positions == 0


# --- GPT-2 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(HF_GPT2_COUNTS))
def test_gpt2_presets_match_hf_counts(name):
    shape = PRESETS[name]
    assert shape.arch == "gpt" and shape.tied and shape.positions == 1024
    assert shape.params == HF_GPT2_COUNTS[name]


def test_gpt2_breakdown():
    s = PRESETS["gpt2"]
    h = 768
    assert s.layer_params == 12 * h * h + 13 * h
    assert s.layer_matmul_params == 12 * h * h
    assert s.embedding_params == (50257 + 1024) * h
    assert s.head_params == 0 and s.final_norm_params == 2 * h
    assert s.head_dim == 64 and s.kv_dim == h
    d = s.to_dict()
    assert d["params"] == 124_439_808 and d["name"] == "gpt2" and d["head_dim"] == 64
    json.dumps(d)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("n_inner", [None, 80])
def test_gpt2_hf_config_matches_transformers(tmp_path, tie, n_inner):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101,
                                     n_positions=48, n_inner=n_inner, tie_word_embeddings=tie,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "tiny-gpt2")
    shape = from_hf_config(tmp_path / "tiny-gpt2")
    assert shape.name == "tiny-gpt2" and shape.arch == "gpt"
    assert shape.tied == tie and shape.positions == 48
    assert shape.params == model.num_parameters()
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    assert shape.layer_params == block


# --- Hugging Face Llama ---------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_llama_hf_config_matches_transformers(tmp_path, tie, kv_heads):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv_heads,
                                      vocab_size=100, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "tiny-llama")
    # A path to the file itself works too; the name is still the folder's.
    for target in (tmp_path / "tiny-llama", tmp_path / "tiny-llama" / "config.json"):
        shape = from_hf_config(target)
        assert shape.name == "tiny-llama" and shape.arch == "llama"
        assert shape.kv_heads == kv_heads and shape.tied == tie and shape.ffn_hidden == 160
        assert shape.params == model.num_parameters()
    assert resolve_model(str(tmp_path / "tiny-llama")).params == model.num_parameters()


def test_mistral_hf_config_counts_like_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=100)
    model = transformers.MistralForCausalLM(config)
    model.save_pretrained(tmp_path / "tiny-mistral")
    assert from_hf_config(tmp_path / "tiny-mistral").params == model.num_parameters()


def test_hf_llama_defaults(tmp_path):
    # kv heads default to heads; the head defaults to untied.
    path = _write_config(tmp_path, {"model_type": "llama", "hidden_size": 64,
                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "intermediate_size": 160, "vocab_size": 100})
    shape = from_hf_config(path)
    assert shape.kv_heads == 4 and not shape.tied
    assert shape.params == from_dims("llama", 64, 2, 4, 100, ffn_hidden=160).params


# --- Megatron-LM Table 1 --------------------------------------------------------------------

def test_megatron_table_has_ten_rows():
    assert len(MEGATRON_TABLE1) == 10
    keys = {"name", "params_b", "heads", "hidden", "layers", "tp", "pp", "gpus", "batch",
            "tflops", "pct_peak"}
    assert all(set(row) == keys for row in MEGATRON_TABLE1)
    assert MEGATRON_TABLE1[-1]["name"] == "megatron-1t"


@pytest.mark.parametrize("row", MEGATRON_TABLE1, ids=lambda r: r["name"])
def test_megatron_presets_match_published_size(row):
    shape = PRESETS[row["name"]]
    assert (shape.hidden, shape.layers, shape.heads) == (row["hidden"], row["layers"],
                                                         row["heads"])
    assert shape.vocab == 51200 and shape.positions == 2048 and shape.tied
    billions = shape.params / 1e9
    assert abs(billions / row["params_b"] - 1) < 0.03
    # The table rounds to 0.1B; our exact count rounds to the same figure on every row.
    assert round(billions, 1) == row["params_b"]


# --- resolve_model and errors ---------------------------------------------------------------

def test_resolve_preset():
    assert resolve_model("gpt2") is PRESETS["gpt2"]
    assert resolve_model("llama3-8b").params == llama.config_from_preset("llama3-8b").num_params()


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(PlanError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_preset_suggests_close_match():
    message = _error(resolve_model, "gpt2-mediun")
    assert "'gpt2-mediun'" in message and "did you mean 'gpt2-medium'" in message
    assert "llama3-405b" in message and "megatron-1t" in message


def test_unknown_preset_without_match():
    message = _error(resolve_model, "zzzz")
    assert "unknown model 'zzzz'" in message and "did you mean" not in message


def test_missing_file(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    assert "not found" in _error(resolve_model, str(missing))
    assert "not found" in _error(from_hf_config, missing)
    (tmp_path / "empty").mkdir()
    assert "not found" in _error(from_hf_config, tmp_path / "empty")


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert "invalid JSON" in _error(from_hf_config, tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    assert "JSON object" in _error(from_hf_config, tmp_path)


def test_unsupported_model_type(tmp_path):
    path = _write_config(tmp_path, {"model_type": "bert", "hidden_size": 64})
    message = _error(from_hf_config, path)
    assert "unsupported model_type 'bert'" in message and "llama" in message


@pytest.mark.parametrize("key", ["model_type", "hidden_size", "num_hidden_layers",
                                 "num_attention_heads", "intermediate_size", "vocab_size"])
def test_missing_key(tmp_path, key):
    data = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 160, "vocab_size": 100}
    del data[key]
    assert f"missing key '{key}'" in _error(from_hf_config, _write_config(tmp_path, data))


def test_missing_gpt2_key(tmp_path):
    data = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 100}
    assert "missing key 'n_positions'" in _error(from_hf_config, _write_config(tmp_path, data))


def test_explicit_head_dim_that_does_not_tile_hidden(tmp_path):
    data = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 160, "vocab_size": 100,
            "head_dim": 32}
    message = _error(from_hf_config, _write_config(tmp_path, data))
    assert "head_dim=32" in message and "not supported" in message


def test_biased_llama_refused(tmp_path):
    data = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 160, "vocab_size": 100,
            "attention_bias": True}
    assert "attention_bias" in _error(from_hf_config, _write_config(tmp_path, data))


@pytest.mark.parametrize("field", ["hidden", "layers", "heads", "vocab", "kv_heads",
                                   "ffn_hidden"])
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_dims(field, value):
    dims = dict(arch="llama", hidden=64, layers=2, heads=4, vocab=100, kv_heads=2,
                ffn_hidden=160)
    dims[field] = value
    message = _error(from_dims, **dims)
    assert f"{field}={value}" in message and "positive" in message


def test_non_positive_dim_from_hf(tmp_path):
    data = {"model_type": "gpt2", "n_embd": 32, "n_layer": 0, "n_head": 4, "vocab_size": 100,
            "n_positions": 64}
    assert "layers=0" in _error(from_hf_config, _write_config(tmp_path, data))


def test_hidden_not_divisible_by_heads():
    message = _error(from_dims, "gpt", 100, 2, 3, 50)
    assert "hidden=100" in message and "heads=3" in message and "divisible" in message


def test_heads_not_divisible_by_kv_heads():
    message = _error(from_dims, "llama", 64, 2, 4, 100, kv_heads=3)
    assert "heads=4" in message and "kv_heads=3" in message and "divisible" in message


def test_bad_arch_and_bad_bias_option():
    assert "unknown arch 'bert'" in _error(from_dims, "bert", 64, 2, 4, 100)
    assert "positions=16" in _error(from_dims, "llama", 64, 2, 4, 100, positions=16)
    assert "qkv_bias, not linear_bias" in _error(from_dims, "llama", 64, 2, 4, 100,
                                                  linear_bias=True)
    assert "linear_bias='yes'" in _error(from_dims, "gpt", 64, 2, 4, 100, linear_bias="yes")
    gpt = from_dims("gpt", 64, 2, 4, 100)
    for option in (dict(qkv_bias=True), dict(qk_norm=True)):
        with pytest.raises(PlanError, match="gpt blocks take linear_bias, not the llama"):
            replace(gpt, **option)


# --- GPT-style blocks meshloom does not build: GQA, no biases, RoPE (Nemotron-4) ------------

def test_gqa_gpt_block_counts_and_gemms():
    """A gpt block with 2 of 8 heads' k and v and no biases: its q/k/v projection is q + 2kv
    wide, its parameters are the four matrices and two LayerNorms, and it is not meshloom's
    GPT-2 (so its activations get the per-tensor count)."""
    from meshloom.plan.implementation import MESHLOOM
    from meshloom.plan.memory import uses_meshloom_block
    from meshloom.plan.step_kernels import block_gemms
    h, heads, kv, f = 64, 8, 2, 256
    shape = from_dims("gpt", h, 3, heads, 100, kv_heads=kv, ffn_hidden=f, positions=0,
                      tied=False, linear_bias=False)
    d = h // heads
    assert shape.layer_matmul_params == h * h + 2 * h * kv * d + h * h + 2 * h * f
    assert shape.layer_params == shape.layer_matmul_params + 4 * h
    assert shape.params == 3 * shape.layer_params + 2 * 100 * h + 2 * h
    biased = from_dims("gpt", h, 3, heads, 100, kv_heads=kv, ffn_hidden=f, positions=0,
                       tied=False)
    assert biased.layer_params - shape.layer_params == (h + 2 * kv * d) + h + f + h
    qkv = {g.name: g for g in block_gemms(shape, 16, 2)}["qkv"]
    assert (qkv.m, qkv.n, qkv.k) == (16, (h + 2 * kv * d) // 2, h)
    assert not shape.is_gpt2_block and PRESETS["gpt2"].is_gpt2_block
    assert not uses_meshloom_block(shape, "bf16", MESHLOOM)
    assert uses_meshloom_block(PRESETS["gpt2"], "bf16", MESHLOOM)
    assert "linear_bias" not in PRESETS["gpt2"].to_dict()
    assert shape.to_dict()["linear_bias"] is False


def test_gqa_gpt_block_has_no_meshloom_config():
    from meshloom.plan.layout import Layout, config_toml
    shape = from_dims("gpt", 64, 2, 8, 100, kv_heads=2, positions=0)
    with pytest.raises(PlanError, match="builds gpt blocks only as GPT-2"):
        config_toml(Layout(), shape, 64, 8, "bf16")


def _tiny_hf(tmp_path: Path, family: str, **dims):
    """A tiny transformers model of `family` (e.g. "Nemotron"), saved and read back as a shape:
    (its shape, the model)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, f"{family}Config"):
        pytest.skip(f"this transformers has no {family}")
    config = getattr(transformers, f"{family}Config")(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, vocab_size=100,
        max_position_embeddings=64, **dims)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    model.save_pretrained(tmp_path / family)
    return from_hf_config(tmp_path / family), model


def test_nemotron_hf_config_matches_transformers(tmp_path):
    shape, model = _tiny_hf(tmp_path, "Nemotron", num_attention_heads=8, num_key_value_heads=2)
    assert (shape.arch, shape.kv_heads, shape.positions, shape.tied) == ("gpt", 2, 0, False)
    assert shape.has_linear_bias is False and not shape.is_gpt2_block
    assert shape.params == model.num_parameters()
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.layer_params == block


def test_nemotron_head_dim_of_its_own_matches_transformers(tmp_path):
    """Minitron 8B's heads are 128 wide on a hidden of 4096 with 48 of them: q is 6144 wide.
    The count, the q/k/v GEMM and the per-tensor activation count all use q's own width."""
    from meshloom.plan.implementation import Implementation
    from meshloom.plan.layout import Layout
    from meshloom.plan.memory import layer_activation_bytes
    from meshloom.plan.step_kernels import block_gemms
    shape, model = _tiny_hf(tmp_path, "Nemotron", num_attention_heads=6, num_key_value_heads=2,
                            head_dim=16)
    assert (shape.head_dim, shape.q_dim, shape.kv_dim) == (16, 96, 32)
    assert shape.params == model.num_parameters()
    assert shape.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert not shape.is_gpt2_block
    gemms = {g.name: g for g in block_gemms(shape, 8, 1)}
    assert (gemms["qkv"].n, gemms["proj"].k) == (96 + 2 * 32, 96)
    # Q and the attention output are 96 wide, not 64: 2 x 32 more values per token, 2 bytes.
    tiling = replace(shape, explicit_head_dim=None, heads=4)  # q 64, k and v 32 as before
    lay, eager = Layout(), Implementation(meshloom_block=False, expand_kv=False)
    wide = layer_activation_bytes(shape, 16, 1, lay, "bf16", impl=eager)
    narrow = layer_activation_bytes(tiling, 16, 1, lay, "bf16", impl=eager)
    assert wide - narrow == 16 * 2 * (96 - 64) * 2 + 16 * 4 * (6 - 4)  # and an lse per head
    # Per token: the four h-wide inputs, Q, O, K, V and GeLU's input and output (2 bytes),
    # the fp32 log-sum-exp per head.
    assert wide == 16 * (4 * 64 * 2 + (2 * 96 + 2 * 32 + 2 * 192) * 2 + 4 * 6)


def test_starcoder2_hf_config_matches_transformers(tmp_path):
    """Starcoder2: GQA, biases on every linear, LayerNorm, RoPE, tied head, a window on every
    layer. Counted exactly; planned (the window shortens attention, context parallel is
    refused as for Mistral), never written as a meshloom config."""
    from meshloom.plan.hardware import make_cluster
    from meshloom.plan.layout import Layout, config_toml
    from meshloom.plan.search import evaluate
    shape, model = _tiny_hf(tmp_path, "Starcoder2", num_attention_heads=8,
                            num_key_value_heads=2, sliding_window=16, bos_token_id=0,
                            eos_token_id=0)
    assert (shape.arch, shape.kv_heads, shape.positions, shape.tied) == ("gpt", 2, 0, True)
    assert (shape.sliding_window, shape.has_linear_bias, shape.has_dropout) == (16, True, False)
    assert shape.params == model.num_parameters()
    assert shape.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert not shape.is_gpt2_block
    with pytest.raises(PlanError, match="builds gpt blocks only as GPT-2"):
        config_toml(Layout(), shape, 64, 8, "bf16")
    cluster = make_cluster("h100", 2)
    full = replace(shape, sliding_window=None)

    def step(s, seq=64):
        return evaluate(s, Layout(dp=2), cluster, seq, 2).timing.step_time_s

    assert step(shape) < step(full)  # 64 queries see at most 16 keys
    assert step(shape, seq=16) == step(full, seq=16)  # the window covers the sequence
    with pytest.raises(PlanError, match="sliding_window"):
        evaluate(shape, Layout(cp=2), cluster, 64, 2)


def test_nemotron4_340b_size():
    """The dgxc recipe's Nemotron-4 340B dimensions give the published 341B."""
    shape = from_dims("gpt", 18432, 96, 96, 256000, kv_heads=8, ffn_hidden=73728, positions=0,
                      tied=False, linear_bias=False)
    assert round(shape.params / 1e9) == 341


def test_nemotron_with_biases_on_attention_only_is_refused(tmp_path):
    data = {"model_type": "nemotron", "hidden_size": 64, "num_attention_heads": 8,
            "num_hidden_layers": 2, "intermediate_size": 192, "vocab_size": 100,
            "attention_bias": True, "mlp_bias": False}
    with pytest.raises(PlanError, match="attention_bias=true with mlp_bias=false"):
        from_hf_config(_write_config(tmp_path, data))


def test_shape_is_frozen():
    shape = PRESETS["tiny"]
    assert isinstance(shape, ModelShape)
    with pytest.raises(AttributeError):
        shape.hidden = 1  # type: ignore[misc]


def test_a_shape_sent_to_another_process_is_the_same_key_there():
    """A shape hashes and compares by its fields (it keys the planner's caches). Pickled into a
    process whose string hashes differ, it must equal, and hash like, the same shape built
    there: nothing of the sending process's hashing may travel with it."""
    import os
    import pickle
    import subprocess
    import sys
    shape = PRESETS["llama3-8b"]
    assert hash(shape) == hash(replace(shape)) and shape == replace(shape) and shape.params
    code = ("import pickle, sys\nfrom meshloom.plan.models import PRESETS\n"
            "got = pickle.loads(sys.stdin.buffer.read())\nhere = PRESETS['llama3-8b']\n"
            "print(got == here, hash(got) == hash(here), {here: 1}.get(got))\n")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(shape),
                          capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["True", "True", "1"]
