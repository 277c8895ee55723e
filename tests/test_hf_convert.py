"""Hugging Face import/export: a converted model computes the same logits as transformers'
LlamaForCausalLM (fp32, within 1e-5) in both directions, from any file layout, with plain or
llama3/linear-scaled RoPE; training starts from HF weights in any parallel layout; bad input
is one line and exit status 2."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from dist_harness import run_ranks

from meshloom import checkpoint
from meshloom.commands import main as cli_main
from meshloom.config import ConfigError
from meshloom.data import BatchLoader, TokenDataset
from meshloom.models import hf_checkpoint, llama_hf
from meshloom.models.llama import LlamaConfig, build_model, rope_frequencies
from meshloom.placement import tp_split
from meshloom.train import prepare_data, train
from meshloom.validation import model_config, validate
from meshloom.weights import load_init_weights, open_source, write_weights_folder

transformers = pytest.importorskip("transformers")

TOL = 1e-5
HF_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
                rope_theta=50000.0, rms_norm_eps=1e-5)
QUICK = ("train.eval_every=0", "train.eval_sequences=0", "train.sample_tokens=0")
TOKENS = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", autouse=True)
def _single_threaded():
    """The comparisons in this process run on one thread: once a process has run a
    multi-threaded op, GNU OpenMP hangs in the ranks forked from it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _hf_model(tied: bool, **changes):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**HF_SHAPE, **changes}, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norm gains of ones would hide a mixed-up norm
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _save_tokenizer(path) -> None:
    """A three-word tokenizer.json; "</s>" (id 1) is what meshloom takes for end of text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{tied: (model, {"single": folder, "sharded": folder})}, saved by transformers."""
    out = {}
    for tied in (False, True):
        model = _hf_model(tied)
        root = tmp_path_factory.mktemp(f"hf-tied{int(tied)}")
        model.save_pretrained(root / "single")
        model.save_pretrained(root / "sharded", max_shard_size="20KB")
        assert (root / "sharded" / hf_checkpoint.INDEX).is_file()
        for folder in ("single", "sharded"):
            _save_tokenizer(root / folder / "tokenizer.json")
        out[tied] = (model, {"single": root / "single", "sharded": root / "sharded"})
    return out


@torch.no_grad()
def _hf_logits(model, tokens=TOKENS) -> torch.Tensor:
    return model(tokens).logits


@torch.no_grad()
def _meshloom_logits(path, tokens=TOKENS, **changes) -> torch.Tensor:
    """Logits of a meshloom model built from a weights, checkpoint or run folder (with
    ``changes`` to its config)."""
    model = build_model(dataclasses.replace(open_source(path).cfg, **changes), seed=123).eval()
    load_init_weights(model, f"meshloom:{path}")
    return model(tokens)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_meshloom_logits_match(hf, tmp_path, tied, layout):
    model, folders = hf[tied]
    dst = tmp_path / "weights"
    assert cli_main(["convert", "hf-to-meshloom", str(folders[layout]), str(dst)]) == 0
    assert open_source(dst).cfg.tie_embeddings is tied
    assert open_source(dst).cfg.norm_eps == 1e-5 and open_source(dst).cfg.rope_theta == 50000
    assert _diff(_meshloom_logits(dst), _hf_logits(model)) < TOL


def test_reads_the_transformers_4_config_style(hf, tmp_path):
    """transformers < 5 writes rope_theta and rope_scaling at the top level."""
    model, folders = hf[False]
    old = _edited_copy(folders["single"], tmp_path / "old", rope_theta=50000.0, rope_scaling=None,
                       rope_parameters=None)
    assert cli_main(["convert", "hf-to-meshloom", str(old), str(tmp_path / "weights")]) == 0
    assert _diff(_meshloom_logits(tmp_path / "weights"), _hf_logits(model)) < TOL


def test_rope_permutation_is_what_makes_them_match(hf, tmp_path, monkeypatch):
    """Without permuting wq/wk rows the logits are far off: the comparison above has teeth."""
    model, folders = hf[False]
    monkeypatch.setattr(llama_hf, "hf_to_meshloom_rows", lambda w, heads: w)
    dst = tmp_path / "weights"
    assert cli_main(["convert", "hf-to-meshloom", str(folders["single"]), str(dst)]) == 0
    assert _diff(_meshloom_logits(dst), _hf_logits(model)) > 1e-3


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_back_to_transformers(hf, tmp_path, tied):
    model, folders = hf[tied]
    ml, sharded, single = tmp_path / "ml", tmp_path / "sharded", tmp_path / "single"
    assert cli_main(["convert", "hf-to-meshloom", str(folders["sharded"]), str(ml)]) == 0
    assert cli_main(["convert", "meshloom-to-hf", str(ml), str(sharded),
                     "--max-shard-size", "30KB"]) == 0
    assert cli_main(["convert", "meshloom-to-hf", str(ml), str(single)]) == 0

    assert (ml / "tokenizer.json").is_file()  # carried along both ways
    index = json.loads((sharded / hf_checkpoint.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert sorted(p.name for p in single.glob("*.safetensors")) == ["model.safetensors"]
    want = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    for folder in (sharded, single):
        back = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
        assert back.config.tie_word_embeddings is tied
        assert back.config.eos_token_id == 1 and (folder / "tokenizer.json").is_file()
        got = back.state_dict()
        for name, w in want.items():  # permuting there and back is exact
            assert torch.equal(got[name], w), name
        assert _diff(_hf_logits(back), _hf_logits(model)) < TOL


# ------------------------------------------------------------------------------ RoPE scaling

# theta 1000 and head_dim 16 give wavelengths 6.3, 14.9, 35.3, 83.8, 198.7, ...: with these
# llama3 values (16 < w < 128 blends) two pairs keep their frequency, two blend and four are
# divided (checked in test_llama3_scaling_covers_all_three_regimes). The sequence runs past
# original_max_position_embeddings, as in long-context use.
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 128}
LINEAR = {"rope_type": "linear", "factor": 4.0}
SCALED_SHAPE = dict(rope_theta=1000.0, max_position_embeddings=256)
LONG = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """{rope_type: (model, folder)}: transformers models with RoPE scaling, saved by it."""
    out = {}
    for scaling in (LLAMA3, LINEAR):
        model = _hf_model(False, **SCALED_SHAPE, rope_scaling=dict(scaling))
        folder = tmp_path_factory.mktemp(f"hf-{scaling['rope_type']}")
        model.save_pretrained(folder)
        out[scaling["rope_type"]] = (model, folder)
    return out


def test_llama3_scaling_covers_all_three_regimes():
    cfg = LlamaConfig(dim=64, n_heads=4, rope_theta=1000.0, rope_scaling=LLAMA3)
    plain = rope_frequencies(dataclasses.replace(cfg, rope_scaling=None))
    freqs = rope_frequencies(cfg)
    kept = freqs == plain
    divided = torch.isclose(freqs, plain / LLAMA3["factor"], rtol=1e-12, atol=0)
    blended = (freqs < plain) & (freqs > plain / LLAMA3["factor"])
    assert kept.tolist() == [True] * 2 + [False] * 6
    assert blended.tolist() == [False] * 2 + [True] * 2 + [False] * 4
    assert divided.tolist() == [False] * 4 + [True] * 4


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_rope_scaling_logits_match(scaled, tmp_path, kind):
    model, folder = scaled[kind]
    dst = tmp_path / "weights"
    assert cli_main(["convert", "hf-to-meshloom", str(folder), str(dst)]) == 0
    assert open_source(dst).cfg.rope_scaling == (LLAMA3 if kind == "llama3" else LINEAR)
    want = _hf_logits(model, LONG)
    assert _diff(_meshloom_logits(dst, LONG), want) < TOL
    # The control: the same weights with plain RoPE are far off, so the match has teeth.
    assert _diff(_meshloom_logits(dst, LONG, rope_scaling=None), want) > 1e-3


def test_rope_scaling_in_the_transformers_4_config_style(scaled, tmp_path):
    """Top-level rope_theta and rope_scaling, the type spelt "type" (older configs), and a key
    transformers ignores for llama3 (ignored here too)."""
    model, folder = scaled["llama3"]
    legacy = {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    old = _edited_copy(folder, tmp_path / "old", rope_parameters=None, rope_theta=1000.0,
                       rope_scaling={"type": "llama3", **legacy, "attention_factor": 1.0})
    assert cli_main(["convert", "hf-to-meshloom", str(old), str(tmp_path / "weights")]) == 0
    assert open_source(tmp_path / "weights").cfg.rope_scaling == LLAMA3
    assert _diff(_meshloom_logits(tmp_path / "weights", LONG), _hf_logits(model, LONG)) < TOL


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_rope_scaling_round_trip_back_to_transformers(scaled, tmp_path, kind):
    model, folder = scaled[kind]
    ml, back_dir = tmp_path / "ml", tmp_path / "back"
    assert cli_main(["convert", "hf-to-meshloom", str(folder), str(ml)]) == 0
    assert cli_main(["convert", "meshloom-to-hf", str(ml), str(back_dir)]) == 0
    written = json.loads((back_dir / "config.json").read_text())
    want = LLAMA3 if kind == "llama3" else LINEAR
    assert written["rope_scaling"] == want  # what transformers 4.x reads
    assert written["rope_parameters"] == {**want, "rope_theta": 1000.0}  # and 5.x
    back = transformers.LlamaForCausalLM.from_pretrained(back_dir).eval()
    assert back.config.rope_parameters["rope_type"] == kind
    assert _diff(_hf_logits(back, LONG), _hf_logits(model, LONG)) < TOL
    # And the exported folder reads back into the same meshloom config.
    assert hf_checkpoint.read_hf_config(back_dir) == open_source(ml).cfg


def test_init_from_scaled_hf_keeps_the_scaling_in_checkpoints(scaled, tmp_path, token_cache):
    """A run started from a llama3-scaled model records the scaling in its checkpoint: the
    checkpoint (read without the HF folder), its export and `meshloom generate`'s model config
    all keep it."""
    from meshloom.inference import Request, prepare

    model, folder = scaled["llama3"]
    src = tmp_path / "hf"
    shutil.copytree(folder, src)
    run_ranks(_train_job, 1, tmp_path / "run", token_cache,
              [f"model.init_from=hf:{src}", "train.steps=1"])
    assert prepare(Request(path=str(tmp_path / "run"), prompt="x")).model_cfg.rope_scaling \
        == LLAMA3
    shutil.rmtree(src)  # from here on nothing may read the HF folder
    assert open_source(tmp_path / "run").cfg.rope_scaling == LLAMA3
    # generate builds the model from the checkpoint's record, not from model.init_from.
    assert prepare(Request(path=str(tmp_path / "run"), prompt="x")).model_cfg.rope_scaling \
        == LLAMA3
    assert cli_main(["convert", "meshloom-to-hf", str(tmp_path / "run"), str(tmp_path / "back")]) \
        == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_scaling"] == LLAMA3
    # A checkpoint written before rope_scaling existed has no such key: plain RoPE.
    ckpt = checkpoint.latest_checkpoint(tmp_path / "run")
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["model"]["rope_scaling"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert open_source(tmp_path / "run").cfg.rope_scaling is None


def test_weights_folder_without_rope_scaling_still_loads(tmp_path):
    """A meshloom.json written before rope_scaling existed: plain RoPE."""
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=2)
    write_weights_folder(tmp_path, cfg, build_model(cfg, seed=0).named_parameters())
    meta = json.loads((tmp_path / "meshloom.json").read_text())
    assert meta["model"].pop("rope_scaling") is None
    (tmp_path / "meshloom.json").write_text(json.dumps(meta))
    assert open_source(tmp_path).cfg == cfg


def _train_job(run_dir, cache, overrides):
    cfg = tiny_config(run_dir, cache, *QUICK, *overrides)
    r = train(cfg, keep_model=True)
    # Each rank's parameters with where they sit in the global tensor (tensor-parallel slices).
    params = {n: (p.detach().clone(), tp_split(p)) for n, p in r.model.named_parameters()}
    return {"losses": r.losses, "params": params, "start": r.summary["start_step"]}


def _whole(rank_params: list[dict]) -> dict[str, torch.Tensor]:
    """Whole parameters from every rank's (slice, TPSplit) of them."""
    out = {}
    for params in rank_params:
        for name, (t, split) in params.items():
            if split is None:
                out[name] = t
                continue
            full = out.setdefault(name, torch.zeros(split.global_shape))
            keep = min(t.shape[split.dim], split.global_shape[split.dim] - split.offset)
            full.narrow(split.dim, split.offset, keep).copy_(t.narrow(split.dim, 0, keep))
    return out


@pytest.mark.parametrize("world,overrides", [(1, []), (2, ["parallel.tp=2"])],
                         ids=["1proc", "tp2"])
def test_training_checkpoint_to_transformers(tmp_path, token_cache, world, overrides):
    """A run's checkpoint (in tp=2 each tensor is saved in pieces) -> HF: transformers computes
    what the trained meshloom model computes."""
    results = run_ranks(_train_job, world, tmp_path / "run", token_cache,
                        ["train.steps=2", *overrides])
    whole = _whole([r["params"] for r in results])
    model = build_model(open_source(tmp_path / "run").cfg, seed=5).eval()
    model.load_state_dict(whole, strict=False)
    assert sorted(whole) == sorted(n for n, _ in model.named_parameters())
    tokens = TOKENS % 257
    assert cli_main(["convert", "meshloom-to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert back.config.eos_token_id == 256  # the byte tokenizer's
    with torch.no_grad():
        assert _diff(_hf_logits(back, tokens), model(tokens)) < TOL
        # The same checkpoint as model.init_from=meshloom:RUN gives the same model.
        assert _diff(_meshloom_logits(tmp_path / "run", tokens), model(tokens)) == 0


def _first_batch(cfg):
    data = TokenDataset(prepare_data(cfg), cfg.data.seq_len, "train", cfg.data.val_fraction)
    loader = BatchLoader(data, global_batch=cfg.train.global_batch,
                         micro_batch=cfg.train.global_batch, dp_rank=0, dp_size=1,
                         seed=cfg.train.seed)
    ((x, y),) = loader.micro_batches(0)
    return x, y


@pytest.mark.parametrize("tied,world,overrides", [(False, 1, []), (True, 2, ["parallel.tp=2"])],
                         ids=["1proc-untied", "tp2-tied"])
def test_init_from_hf_starts_from_its_weights(hf, tmp_path, token_cache, tied, world, overrides):
    """The first step's loss is the HF model's loss on the same batch: training began from the
    HF weights (whatever the layout slices them into)."""
    model, folders = hf[tied]
    init = [f"model.init_from=hf:{folders['sharded']}", "train.steps=1", *overrides]
    results = run_ranks(_train_job, world, tmp_path / "run", token_cache, init)
    x, y = _first_batch(tiny_config(tmp_path / "run", token_cache, *init))
    with torch.no_grad():
        want = F.cross_entropy(_hf_logits(model, x).flatten(0, 1), y.flatten()).item()
    assert results[0]["losses"][0] == pytest.approx(want, rel=TOL)
    assert open_source(tmp_path / "run").cfg.vocab_size == 300  # the HF vocabulary wins


def _resume_summary(cfg):
    return train(cfg, resume=True).summary


def test_resume_does_not_reload_hf_weights(hf, tmp_path, token_cache):
    _, folders = hf[False]
    src = tmp_path / "hf"
    shutil.copytree(folders["single"], src)
    init = [f"model.init_from=hf:{src}"]
    first = run_ranks(_train_job, 1, tmp_path / "run", token_cache, [*init, "train.steps=1"])[0]
    (src / "model.safetensors").unlink()  # a re-read would fail now
    cfg = tiny_config(tmp_path / "run", token_cache, *QUICK, *init, "train.steps=2")
    resumed = run_ranks(_resume_summary, 1, cfg)[0]
    assert resumed["start_step"] == 1 and first["start"] == 0
    assert checkpoint.latest_checkpoint(tmp_path / "run").name == "step_0000002"


# ------------------------------------------------------------------------------ bad input


def _cli_error(capsys, *argv: str) -> str:
    try:
        code = cli_main(["convert", *argv])
    except SystemExit as e:  # argparse's errors exit from inside the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshloom: error: "), err
    return err


def _edited_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_input_is_one_line_and_exit_2(hf, tmp_path, capsys):
    single = hf[False][1]["single"]
    out = str(tmp_path / "out")
    assert "no such folder" in _cli_error(capsys, "hf-to-meshloom", str(tmp_path / "nope"), out)
    assert "no such folder" in _cli_error(capsys, "meshloom-to-hf", str(tmp_path / "nope"), out)
    gpt2 = _edited_copy(single, tmp_path / "gpt2", model_type="bert")
    assert "model_type='bert'" in _cli_error(capsys, "hf-to-meshloom", str(gpt2), out)
    for i, kind in enumerate(("dynamic", "yarn", "longrope")):
        scaled = _edited_copy(single, tmp_path / f"scaled{i}", rope_parameters={
            "rope_type": kind, "rope_theta": 5e5, "factor": 8.0})
        assert f"rope_type='{kind}'" in _cli_error(capsys, "hf-to-meshloom", str(scaled), out)
    legacy = _edited_copy(single, tmp_path / "legacy", rope_scaling={"type": "yarn", "factor": 8})
    assert "rope_scaling.rope_type='yarn'" in _cli_error(capsys, "hf-to-meshloom", str(legacy),
                                                         out)
    incomplete = _edited_copy(single, tmp_path / "incomplete", rope_scaling={
        "rope_type": "llama3", "factor": 8.0})
    assert "low_freq_factor" in _cli_error(capsys, "hf-to-meshloom", str(incomplete), out)
    bias = _edited_copy(single, tmp_path / "bias", attention_bias=True)
    assert "attention_bias" in _cli_error(capsys, "hf-to-meshloom", str(bias), out)
    wrong = _edited_copy(single, tmp_path / "wrong", intermediate_size=96)
    assert "has shape" in _cli_error(capsys, "hf-to-meshloom", str(wrong), out)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(single / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not opened")
    assert "only safetensors" in _cli_error(capsys, "hf-to-meshloom", str(pickled), out)
    assert "not a Hugging Face" in _cli_error(capsys, "hf-to-meshloom", str(tmp_path), out)
    garbage = _edited_copy(single, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    assert "safetensors" in _cli_error(capsys, "hf-to-meshloom", str(garbage), out)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    # The destination must be new (or empty), and sizes must parse.
    assert "not an empty folder" in _cli_error(capsys, "hf-to-meshloom", str(single), str(gpt2))
    assert "5 parsecs" in _cli_error(capsys, "meshloom-to-hf", str(single), out,
                                     "--max-shard-size", "5 parsecs")
    assert "neither" in _cli_error(capsys, "meshloom-to-hf", str(single), out)


def test_init_from_config_errors_name_the_key(hf, tmp_path, token_cache):
    single = hf[False][1]["single"]

    def check(*overrides: str, world: int = 1) -> str:
        with pytest.raises(ConfigError) as e:
            validate(tiny_config(tmp_path / "run", token_cache, *overrides), world,
                     check_data=False)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert check(f"model.init_from={single}").startswith("model.init_from: ")  # no hf: prefix
    assert "no such folder" in check(f"model.init_from=hf:{tmp_path / 'nope'}")
    assert "model.dim" in check(f"model.init_from=hf:{single}", "model.dim=128")
    gpt2 = _edited_copy(single, tmp_path / "gpt2", model_type="bert")
    assert "model_type" in check(f"model.init_from=hf:{gpt2}")
    assert "parallel.tp" in check(f"model.init_from=hf:{single}", "parallel.tp=3", world=3)
    assert "data.seq_len" in check(f"model.init_from=hf:{single}", "data.seq_len=256")
    # The HF folder's own tokenizer fits; the vocabulary stays the checkpoint's.
    cfg = tiny_config(tmp_path / "run", token_cache, f"model.init_from=hf:{single}",
                      f"data.tokenizer={single}")
    validate(cfg, 1)
    assert model_config(cfg, 3).vocab_size == 300
    small = _edited_copy(single, tmp_path / "small", vocab_size=200)
    with pytest.raises(ConfigError, match="exceeds the checkpoint's vocab_size=200"):
        validate(tiny_config(tmp_path / "run", token_cache, f"model.init_from=hf:{small}"), 1)
