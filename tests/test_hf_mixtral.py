"""Hugging Face import/export of Mixtral (models/mixtral_hf.py): a small random
MixtralForCausalLM built here converts to a meshloom model whose logits equal transformers' (fp32,
within 1e-5), from one file or from shards that split a layer's experts; it converts back
bit-exactly; a run can start from it; what meshloom cannot run is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from dist_harness import run_ranks

from meshloom.commands import main as cli_main
from meshloom.models import families, hf_checkpoint, mixtral_hf
from meshloom.models.llama import build_model
from meshloom.models.mixtral import MixtralConfig
from meshloom.train import train
from meshloom.weights import load_init_weights, open_source, write_weights_folder

transformers = pytest.importorskip("transformers")

TOL = 1e-5
TOP_K = 2
# A window (16) shorter than the 48 tokens, a RoPE base and an aux coefficient of their own, so
# that each mapping shows.
HF_SHAPE = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=257, max_position_embeddings=128,
                num_local_experts=12, num_experts_per_tok=TOP_K, sliding_window=16,
                rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                rms_norm_eps=1e-5, router_aux_loss_coef=0.02)
TOKENS = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(1))
# Router logits this far apart between the k-th and the next expert cannot swap places over
# the ~1e-7 by which the two models' hidden states differ (summation order): the top-k choice is
# the same on any machine, so the 1e-5 bound does not hinge on one.
MARGIN = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _single_threaded():
    """One thread in this process: GNU OpenMP hangs in ranks forked after a threaded op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _hf_model():
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**HF_SHAPE)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # gains of ones would hide a mixed-up norm
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("gate.weight"):  # decisive routing (see MARGIN)
                p.mul_(50.0)
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(transformers model, {"single": folder, "sharded": folder}) saved by transformers; the
    shards are small enough to split one layer's experts over two files."""
    model = _hf_model()
    root = tmp_path_factory.mktemp("hf-mixtral")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert (root / "sharded" / hf_checkpoint.INDEX).is_file()
    return model, {"single": root / "single", "sharded": root / "sharded"}


@torch.no_grad()
def _hf_logits(model, tokens=TOKENS) -> torch.Tensor:
    return model(tokens).logits


@torch.no_grad()
def _meshloom_logits(path, tokens=TOKENS, **changes) -> torch.Tensor:
    cfg = open_source(path).cfg
    for key, value in changes.items():
        setattr(cfg, key, value)
    model = build_model(cfg, seed=123).eval()
    load_init_weights(model, f"meshloom:{path}")
    return model(tokens)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _routing_margin_and_use(model) -> tuple[float, set]:
    """transformers' smallest gap between a token's k-th and (k+1)-th router logit over TOKENS,
    and the set of experts chosen at least once."""
    gaps, used = [], set()

    def hook(module, args, out):
        top = out[0].topk(TOP_K + 1, dim=-1)
        gaps.append((top.values[:, TOP_K - 1] - top.values[:, TOP_K]).min().item())
        used.update(top.indices[:, :TOP_K].flatten().tolist())

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    _hf_logits(model)
    for h in handles:
        h.remove()
    return min(gaps), used


def test_the_routing_is_decisive_and_uses_every_expert(hf):
    margin, used = _routing_margin_and_use(hf[0])
    assert margin > MARGIN
    assert used == set(range(HF_SHAPE["num_local_experts"]))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_hf_to_meshloom_logits_match(hf, tmp_path, layout):
    model, folders = hf
    dst = tmp_path / "weights"
    assert cli_main(["convert", "hf-to-meshloom", str(folders[layout]), str(dst)]) == 0
    cfg = open_source(dst).cfg
    assert type(cfg) is MixtralConfig and families.family_of(cfg).name == "mixtral"
    assert (cfg.n_experts, cfg.top_k, cfg.moe_hidden) == (12, TOP_K, 48)
    assert (cfg.router_score, cfg.router_norm, cfg.capacity_factor) == ("softmax", True, None)
    assert (cfg.aux_loss_coef, cfg.sliding_window, cfg.rope_theta) == (0.02, 16, 50000.0)
    diff = _diff(_meshloom_logits(dst), _hf_logits(model))
    print(f"max |logit difference| meshloom vs transformers ({layout}): {diff:.2e}")
    assert diff < TOL


def test_expert_order_and_renormalisation_are_what_make_them_match(hf, tmp_path, monkeypatch):
    """The comparison above has teeth: experts stacked in the wrong order, or top-k weights
    left unnormalised, give logits far off."""
    model, folders = hf
    want = _hf_logits(model)
    ok = tmp_path / "ok"
    assert cli_main(["convert", "hf-to-meshloom", str(folders["single"]), str(ok)]) == 0
    assert _diff(_meshloom_logits(ok, router_norm=False), want) > 1e-3

    real = mixtral_hf.stacked_part

    def reversed_experts(key):
        part = real(key)
        return None if part is None else (part[0], HF_SHAPE["num_local_experts"] - 1 - part[1])

    monkeypatch.setattr(mixtral_hf, "stacked_part", reversed_experts)
    bad = tmp_path / "bad"
    assert cli_main(["convert", "hf-to-meshloom", str(folders["single"]), str(bad)]) == 0
    assert _diff(_meshloom_logits(bad), want) > 1e-3


def test_round_trip_back_to_transformers(hf, tmp_path):
    model, folders = hf
    ml, sharded, single = tmp_path / "ml", tmp_path / "sharded", tmp_path / "single"
    assert cli_main(["convert", "hf-to-meshloom", str(folders["sharded"]), str(ml)]) == 0
    assert cli_main(["convert", "meshloom-to-hf", str(ml), str(sharded),
                     "--max-shard-size", "20KB"]) == 0
    assert cli_main(["convert", "meshloom-to-hf", str(ml), str(single)]) == 0
    index = json.loads((sharded / hf_checkpoint.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    # What transformers itself writes: one tensor per expert and matrix.
    assert "model.layers.1.block_sparse_moe.experts.11.w2.weight" in index["weight_map"]
    written = json.loads((single / "config.json").read_text())
    assert (written["num_local_experts"], written["num_experts_per_tok"],
            written["intermediate_size"], written["router_aux_loss_coef"],
            written["sliding_window"]) == (12, TOP_K, 48, 0.02, 16)
    want = model.state_dict()
    for folder in (sharded, single):
        back = transformers.MixtralForCausalLM.from_pretrained(folder).eval()
        got = back.state_dict()
        assert sorted(got) == sorted(want)
        for name, w in want.items():  # permuting, stacking and back is exact
            assert torch.equal(got[name], w), name
        assert _diff(_hf_logits(back), _hf_logits(model)) < TOL
        assert hf_checkpoint.read_hf_config(folder) == open_source(ml).cfg


def test_reads_the_transformers_4_config_style(hf, tmp_path):
    """transformers < 5 writes rope_theta at the top level; without it Mixtral's base is 1e6
    (not Llama's 1e4), as transformers reads it."""
    model, folders = hf
    old = _edited(folders["single"], tmp_path / "old", rope_parameters=None, rope_theta=50000.0)
    assert cli_main(["convert", "hf-to-meshloom", str(old), str(tmp_path / "ml")]) == 0
    assert _diff(_meshloom_logits(tmp_path / "ml"), _hf_logits(model)) < TOL
    bare = _edited(folders["single"], tmp_path / "bare", rope_parameters=None)
    theirs = transformers.AutoConfig.from_pretrained(bare).rope_parameters["rope_theta"]
    assert hf_checkpoint.read_hf_config(bare).rope_theta == theirs == 1e6


def test_preset_config_round_trips_through_config_json():
    """mixtral-8x7b's config -> config.json -> the same config (no weights involved)."""
    cfg = families.config_from_preset("mixtral-8x7b")
    raw = mixtral_hf.hf_config(cfg, torch.bfloat16)
    assert mixtral_hf.config_from_hf(json.loads(json.dumps(raw))) == cfg
    # transformers reads it as the same shape.
    hf_cfg = transformers.MixtralConfig(**{k: v for k, v in raw.items()
                                           if k not in ("architectures", "torch_dtype")})
    assert (hf_cfg.num_local_experts, hf_cfg.intermediate_size, hf_cfg.num_key_value_heads,
            hf_cfg.rope_parameters["rope_theta"]) == (8, 14336, 8, 1e6)


def _train_job(run_dir, cache, overrides):
    r = train(tiny_config(run_dir, cache, "train.eval_every=0", "train.eval_sequences=0",
                          "train.sample_tokens=0", *overrides))
    return {"losses": r.losses}


def test_init_from_hf_starts_from_its_weights(hf, tmp_path, token_cache):
    """The first step's loss is transformers' loss on the same batch: training began from the
    HF experts and router."""
    from meshloom.data import BatchLoader, TokenDataset
    from meshloom.train import prepare_data

    model, folders = hf
    init = [f"model.init_from=hf:{folders['sharded']}", "train.steps=1"]
    losses = run_ranks(_train_job, 1, tmp_path / "run", token_cache, init)[0]["losses"]
    cfg = tiny_config(tmp_path / "run", token_cache, *init)
    data = TokenDataset(prepare_data(cfg), cfg.data.seq_len, "train", cfg.data.val_fraction)
    loader = BatchLoader(data, global_batch=cfg.train.global_batch,
                         micro_batch=cfg.train.global_batch, dp_rank=0, dp_size=1,
                         seed=cfg.train.seed)
    ((x, y),) = loader.micro_batches(0)
    with torch.no_grad():
        want = F.cross_entropy(_hf_logits(model, x).flatten(0, 1), y.flatten()).item()
    assert losses[0] == pytest.approx(want, rel=TOL)
    assert type(open_source(tmp_path / "run").cfg) is MixtralConfig


# ------------------------------------------------------------------------------ bad input


def _edited(folder, dst, drop=(), **changes):
    """A copy of a single-file HF folder with ``changes`` to its config.json and the tensors
    ``drop`` left out."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        tensors = load_file(str(dst / "model.safetensors"))
        for key in drop:
            tensors.pop(key)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _error(capsys, *argv: str) -> str:
    assert cli_main(["convert", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshloom: error: "), err
    return err


@pytest.mark.parametrize("changes,words", [
    (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1 is not supported"),
    (dict(num_experts_per_tok=13), "num_experts_per_tok=13 must be at most num_local_experts=12"),
    (dict(architectures=["MistralForCausalLM"]), "only MixtralForCausalLM"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
     "rope_type='yarn'"),
    (dict(num_local_experts=13), "gate.weight has shape (12, 64), the config implies (13, 64)"),
    (dict(intermediate_size=32), "experts.0.w1.weight has shape (48, 64), the config implies "
                                 "(32, 64)"),
])
def test_hf_refuses_what_meshloom_cannot_run(hf, tmp_path, capsys, changes, words):
    folder = _edited(hf[1]["single"], tmp_path / "edited", **changes)
    assert words in _error(capsys, "hf-to-meshloom", str(folder), str(tmp_path / "out"))


def test_a_missing_or_foreign_tensor_is_named(hf, tmp_path, capsys):
    single = hf[1]["single"]
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    folder = _edited(single, tmp_path / "gone", drop=[gone])
    assert f"missing, e.g. '{gone}'" in _error(capsys, "hf-to-meshloom", str(folder),
                                               str(tmp_path / "o1"))
    # A dense Mistral MLP (or transformers' in-memory fused experts) is not Mixtral's layout.
    from safetensors.torch import load_file, save_file

    dense = _edited(single, tmp_path / "dense")
    tensors = load_file(str(dense / "model.safetensors"))
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(48, 64)
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})
    assert "unexpected tensor 'model.layers.0.mlp.gate_proj.weight' (not a plain " \
        "MixtralForCausalLM)" in _error(capsys, "hf-to-meshloom", str(dense),
                                        str(tmp_path / "o2"))


@pytest.mark.parametrize("change,words", [
    (dict(capacity_factor=1.25), "model.capacity_factor=1.25 has no MixtralForCausalLM form"),
    (dict(shared_hidden=32), "model.shared_hidden=32"),
    (dict(router_score="sigmoid"), "model.router_score='sigmoid'"),
    (dict(n_experts=0), "model.n_experts=0"),
])
def test_export_refuses_what_mixtral_cannot_express(tmp_path, capsys, change, words):
    cfg = families.config_from_preset("mixtral-tiny", n_layers=1, **change)
    src = tmp_path / "src"
    src.mkdir()
    model = build_model(cfg, seed=0)
    write_weights_folder(src, cfg, ((n, p.detach()) for n, p in model.named_parameters()))
    assert words in _error(capsys, "meshloom-to-hf", str(src), str(tmp_path / "out"))


def test_a_dense_family_with_experts_is_refused_on_export():
    """Llama, Mistral and Qwen have no expert form in their HF architectures: one line."""
    from meshloom.models import llama_hf

    cfg = families.config_from_preset("tiny", n_experts=4)
    with pytest.raises(hf_checkpoint.HFCheckpointError,
                       match="model.n_experts=4 has no .* form .*mixtral"):
        llama_hf.hf_config(cfg, torch.float32)


def test_init_from_takes_the_runs_moe_training_settings(hf):
    """aux_loss_coef and capacity_factor are training settings, not shape: a run started from
    HF weights may set them; on dense weights they are refused by name."""
    from meshloom.config import ModelConfig
    from meshloom.weights import WeightsError, init_from_config

    folder = hf[1]["single"]
    cfg = init_from_config(ModelConfig(init_from=f"hf:{folder}", aux_loss_coef=0.05,
                                       capacity_factor=1.5), None)
    assert (cfg.aux_loss_coef, cfg.capacity_factor) == (0.05, 1.5)
    with pytest.raises(WeightsError, match="model.n_experts cannot be set beside it"):
        init_from_config(ModelConfig(init_from=f"hf:{folder}", n_experts=4), None)
