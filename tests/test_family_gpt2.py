"""The GPT-2 family (models/gpt2.py, models/gpt2_hf.py): the same logits as transformers'
GPT2LMHeadModel (tied and untied head) and an exact round trip through HF's format; training
under every layout meshloom has reproduces the single-process run (losses, first-step gradients,
gradient norms, final weights); dropout acts in training mode only; the model honours the
contract. `pytest -m families_matrix` runs a larger matrix of layouts."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import (
    ROOT,
    WELL_CONDITIONED,
    assert_same_grad_norms,
    assert_same_gradients,
    gradient_probe,
    tiny_config,
)
from dist_harness import run_ranks

from meshloom.commands import main as cli_main
from meshloom.models import families, hf_checkpoint
from meshloom.models.contract import ModelContract
from meshloom.models.gpt2 import GPT2, PRESETS, GPT2Config, build_model
from meshloom.train import train

# ------------------------------------------------------------------ Hugging Face logits

HF_SHAPE = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=128,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
TOKENS = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", autouse=True)
def _single_threaded():
    """Comparisons in this process on one thread: GNU OpenMP hangs in ranks forked after a
    multi-threaded op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _hf_model(tied: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**HF_SHAPE, tie_word_embeddings=tied, bos_token_id=1,
                                  eos_token_id=1)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # zero biases and unit LayerNorms would hide a mixed-up mapping
        for _, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _load(folder) -> GPT2:
    cfg = hf_checkpoint.read_hf_config(folder)
    model = build_model(cfg, seed=123)
    weights = dict(hf_checkpoint.iter_hf_weights(folder, cfg))
    assert set(weights) == {n for n, _ in model.named_parameters()}
    model.load_state_dict(weights, strict=False)
    return model.eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hf_logits_and_round_trip(tmp_path, tied):
    hf = _hf_model(tied)
    hf.save_pretrained(tmp_path / "hf")
    ours = _load(tmp_path / "hf")
    assert ours.cfg.tie_embeddings is tied
    with torch.no_grad():
        want = hf(TOKENS).logits
        got = ours(TOKENS)
    assert float((got - want).abs().max()) <= 1e-5
    # meshloom -> HF -> meshloom: bit-exact, and transformers reads our folder.
    state = {n: p.detach().clone() for n, p in ours.named_parameters()}
    (tmp_path / "back").mkdir()
    hf_checkpoint.write_hf_folder(tmp_path / "back", ours.cfg, state, max_shard_bytes=20_000)
    again = _load(tmp_path / "back")
    for name, p in again.named_parameters():
        assert torch.equal(p, state[name]), name
    reread = type(hf).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert float((reread(TOKENS).logits - want).abs().max()) <= 1e-5


def test_convert_cli_both_ways(tmp_path):
    _hf_model(True).save_pretrained(tmp_path / "hf")
    assert cli_main(["convert", "hf-to-meshloom", str(tmp_path / "hf"),
                     str(tmp_path / "ml")]) == 0
    assert cli_main(["convert", "meshloom-to-hf", str(tmp_path / "ml"),
                     str(tmp_path / "hf2")]) == 0
    raw = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert raw["model_type"] == "gpt2" and raw["n_embd"] == 64
    a, b = _load(tmp_path / "hf"), _load(tmp_path / "hf2")
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_hf_config_refusals(tmp_path):
    from meshloom.models import gpt2_hf

    base = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300,
            "n_positions": 128}
    for change, words in ((dict(activation_function="relu"), "activation_function"),
                          (dict(add_cross_attention=True), "add_cross_attention"),
                          (dict(resid_pdrop=0.1, attn_pdrop=0.0), "differ")):
        with pytest.raises(ValueError, match=words):
            gpt2_hf.config_from_hf({**base, **change})


# ------------------------------------------------------------------ parity with one process

STEPS = 3
MODEL = ["model.preset=gpt2-tiny", "data.seq_len=32", "train.global_batch=8"]


def _job(run_dir, cache, overrides):
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=0",
                      "train.eval_sequences=0", "train.sample_tokens=0", *MODEL,
                      *WELL_CONDITIONED, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, keep_model=True)
    strat = r.strategy
    whole = strat.full_state_dict() if hasattr(strat, "full_state_dict") else \
        {k: v.detach().clone() for k, v in r.model.state_dict().items()}
    return {"losses": r.losses, "state": whole, **probe}


def _merged(results, key):
    """A pipeline rank holds its stages' tensors: merge them (equal where two ranks hold one)."""
    out = {}
    for r in results:
        for name, w in r[key].items():
            if name in out:
                torch.testing.assert_close(out[name], w, rtol=0, atol=0, msg=name)
            out[name] = w
    return out


def _assert_parity(ref, results, tied: bool):
    for r in results:
        for step, (a, b) in enumerate(zip(ref["losses"], r["losses"], strict=True), 1):
            assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs single-process {a}"
        assert_same_grad_norms(ref["norms"], r["norms"])
    grads, state = _merged(results, "grads"), _merged(results, "state")
    ref_grads, ref_state = dict(ref["grads"]), dict(ref["state"])
    if tied:  # the head *is* the token table: some strategies list it under both names
        for d in (grads, state, ref_grads, ref_state):
            d.pop("output.weight", None)
    assert set(grads) == set(ref_grads) and set(state) == set(ref_state)
    # The key bias adds q.b_k to every score of a query alike, which softmax cancels: its true
    # gradient is 0, so both runs hold only rounding noise there. Compared against the scale of
    # the query bias's gradient instead of its own.
    zero = {n for n in ref_grads if n.endswith("attn.k_proj.bias")}
    assert_same_gradients({n: g for n, g in ref_grads.items() if n not in zero}, grads)
    for name in zero:
        scale = float(ref_grads[name.replace("k_proj", "q_proj")].abs().max())
        assert float(grads[name].abs().max()) <= 1e-5 * scale, name
    for name, w in ref_state.items():
        torch.testing.assert_close(state[name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert ref["losses"][-1] < ref["losses"][0]  # it trained


_REFS: dict = {}


def _reference(tmp_path_factory, cache, extra: tuple[str, ...]) -> dict:
    if extra not in _REFS:
        _REFS[extra] = run_ranks(_job, 1, tmp_path_factory.mktemp("ref"), cache, list(extra))[0]
    return _REFS[extra]


def _pp(schedule: str, *extra: str) -> list[str]:
    ov = ["parallel.pp=2", f"parallel.pp_schedule={schedule}", *extra]
    return ov + (["parallel.pp_virtual_stages=2"] if schedule == "interleaved_1f1b" else [])


UNTIED = ("model.tie_embeddings=false",)
# Every strategy once, on 2 ranks where it can be (4 for HSDP), plus one 3-D product.
CASES = {
    "ddp": (2, [], ()),
    "zero1": (2, ["parallel.zero_stage=1"], ()),
    "zero2": (2, ["parallel.zero_stage=2"], ()),
    "zero3": (2, ["parallel.zero_stage=3"], ()),
    "hsdp": (4, ["parallel.dp_replicate=2", "parallel.zero_stage=3"], ()),
    "tp2": (2, ["parallel.tp=2", "parallel.dp_shard=1"], UNTIED),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true"],
               ()),
    "pp2-gpipe": (2, _pp("gpipe", "parallel.dp_shard=1"), ()),
    "pp2-1f1b": (2, _pp("1f1b", "parallel.dp_shard=1"), UNTIED),
    "pp2-interleaved": (2, _pp("interleaved_1f1b", "parallel.dp_shard=1"), ()),
    "cp2": (2, ["parallel.cp=2", "parallel.dp_shard=1"], ()),
    # Tied: the last stage's tensor-parallel slice of the table's copy must stay a duplicate
    # (counted once in the gradient norm; it was not, for any family, before placement's
    # carry_tags).
    "dp2xtp2xpp2": (8, _pp("1f1b", "parallel.tp=2", "parallel.dp_shard=2"), ()),
}
# A larger matrix: the strategies combined, untied heads, accumulation, zero-bubble.
MATRIX = {
    "zero3-accum": (2, ["parallel.zero_stage=3", "train.micro_batch=2"], UNTIED),
    "zero3-untied": (2, ["parallel.zero_stage=3"], UNTIED),
    "hsdp-zero2": (4, ["parallel.dp_replicate=2", "parallel.zero_stage=2"], ()),
    "tp2-tied": (2, ["parallel.tp=2", "parallel.dp_shard=1"], ()),
    "tp2-sp-untied": (2, ["parallel.tp=2", "parallel.dp_shard=1",
                          "parallel.sequence_parallel=true"], UNTIED),
    "tp4-sp": (4, ["parallel.tp=4", "parallel.dp_shard=1", "parallel.sequence_parallel=true"],
               ()),
    "tp2xzero3-sp": (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=3",
                         "parallel.sequence_parallel=true"], ()),
    "tp2xddp": (4, ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"], ()),
    "pp2-zb": (2, _pp("zb_h1", "parallel.dp_shard=1"), ()),
    "pp2xzero3": (4, _pp("gpipe", "parallel.dp_shard=2", "parallel.zero_stage=3"), UNTIED),
    "pp2xtp2-sp": (4, _pp("1f1b", "parallel.tp=2", "parallel.dp_shard=1",
                          "parallel.sequence_parallel=true"), UNTIED),
    "cp2-untied": (2, ["parallel.cp=2", "parallel.dp_shard=1"], UNTIED),
    "cp2xtp2": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.dp_shard=1"], ()),
    "cp2xzero3": (4, ["parallel.cp=2", "parallel.dp_shard=2", "parallel.zero_stage=3"], ()),
    "cp2xpp2": (4, ["parallel.cp=2", *_pp("1f1b", "parallel.dp_shard=1")], ()),
    "pp2xtp2-untied": (4, _pp("1f1b", "parallel.tp=2", "parallel.dp_shard=1"), UNTIED),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_one_process(tmp_path_factory, token_cache, name):
    world, overrides, extra = CASES[name]
    ref = _reference(tmp_path_factory, token_cache, extra)
    overrides = [*extra, *overrides]
    _assert_parity(ref, run_ranks(_job, world, tmp_path_factory.mktemp(name), token_cache,
                                  overrides), tied=not extra)


@pytest.mark.families_matrix
@pytest.mark.parametrize("name", list(MATRIX))
def test_parity_matrix(tmp_path_factory, token_cache, name):
    world, overrides, extra = MATRIX[name]
    ref = _reference(tmp_path_factory, token_cache, extra)
    _assert_parity(ref, run_ranks(_job, world, tmp_path_factory.mktemp(name), token_cache,
                                  [*extra, *overrides]), tied=not extra)


# ------------------------------------------------------------------ dropout


def test_dropout_in_training_mode_only():
    cfg = GPT2Config(**{**PRESETS["gpt2-tiny"], "dropout": 0.2})
    model = build_model(cfg, seed=0).train()
    x = TOKENS[:, :16] % cfg.vocab_size
    torch.manual_seed(0)
    assert not torch.equal(model(x), model(x))  # fresh masks each call
    model.eval()
    c = model(x)
    assert torch.equal(model(x), c)
    # Eval mode is the dropout-free model: the same weights with dropout 0 give the same logits.
    plain = build_model(dataclasses.replace(cfg, dropout=0.0), seed=0)
    assert torch.equal(plain.eval()(x), c)
    plain.train()
    assert torch.equal(plain(x), c)  # dropout 0: training mode draws nothing
    # Every site drops: each one alone changes the training-mode output.
    sites = {"embedding": lambda m: setattr(m, "cfg", cfg),
             "attention probabilities": lambda m: setattr(m.layers[0].attn, "attn_dropout", 0.2),
             "attention output": lambda m: setattr(m.layers[0].attn, "resid_dropout", 0.2),
             "mlp output": lambda m: setattr(m.layers[0].mlp, "resid_dropout", 0.2)}
    for site, switch_on in sites.items():
        m = build_model(dataclasses.replace(cfg, dropout=0.0), seed=0).train()
        switch_on(m)
        assert not torch.equal(m(x), c), site


# ------------------------------------------------------------------ the contract


def test_contract_counts_and_init():
    cfg = families.config_from_preset("gpt2-tiny")
    model = build_model(cfg, seed=0)
    assert isinstance(model, ModelContract)
    assert model.pieces().tied == ("wte.weight", "output.weight")
    assert model.output.weight is model.wte.weight
    n = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == n
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    assert untied.num_params() == n + cfg.vocab_size * cfg.dim
    assert cfg.num_params(include_embeddings=False) == n - (cfg.vocab_size + 256) * cfg.dim
    # The published sizes (tied head): 124M, 355M, 774M, 1558M; and the planner's count.
    from meshloom.plan.models import PRESETS as SHAPES
    for name, millions in (("gpt2", 124), ("gpt2-medium", 355), ("gpt2-large", 774),
                           ("gpt2-xl", 1558)):
        c = families.config_from_preset(name)
        assert round(c.num_params() / 1e6) == millions, name
        assert c.num_params() == SHAPES[name].params, name
    blocks, head = cfg.layer_costs(32)
    assert len(blocks) == cfg.n_layers and sum(blocks) + head == cfg.flops_per_token(32)
    assert model.pipeline_cut_points() == [f"layers.{i}" for i in range(cfg.n_layers)]
    for unit in model.fsdp_units():
        model.get_submodule(unit)
    # Init: layout-independent (per name), GPT-2's scheme.
    again = build_model(cfg, seed=0)
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters(),
                                 strict=True):
        assert torch.equal(p, q), name
        if name.endswith(".bias"):
            assert not p.any(), name
    resid = model.layers[0].mlp.proj.weight.std().item()
    plain = model.layers[0].mlp.fc.weight.std().item()
    assert abs(resid / plain - 1 / math.sqrt(2 * cfg.n_layers)) < 0.1
    assert torch.equal(model.layers[1].ln_2.weight, torch.ones(cfg.dim))
    other = build_model(cfg, seed=1)
    assert not torch.equal(other.wpe.weight, model.wpe.weight)


def test_embed_uses_absolute_positions_and_cache():
    """A chunk's positions (context parallel) pick its rows of wpe; cached decoding gives the
    uncached logits."""
    model = build_model(families.config_from_preset("gpt2-tiny"), seed=0).eval()
    x = TOKENS[:1, :20] % 257
    whole = model.embed(x, None)
    chunk = model.embed(x[:, 8:], torch.arange(8, 20))
    torch.testing.assert_close(chunk, whole[:, 8:], rtol=0, atol=0)
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(20)
        first = model(x[:, :12], cache=cache)
        rest = [model(x[:, i:i + 1], cache=cache) for i in range(12, 20)]
    got = torch.cat([first, *rest], dim=1)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_config_refusals_and_presets():
    with pytest.raises(ValueError, match="model.rope_theta is not a setting of the gpt2"):
        families.config_from_preset("gpt2-tiny", rope_theta=1.0)
    with pytest.raises(ValueError, match="model.dim=65 must be divisible"):
        families.config_from_preset("gpt2-tiny", dim=65)
    with pytest.raises(ValueError, match="model.dropout"):
        families.config_from_preset("gpt2-tiny", dropout=1.0)
    assert families.presets()["gpt2-xl"].name == "gpt2"
    cfg = families.config_from_preset("gpt2-tiny", dropout=0.1)
    assert families.config_from_dict(families.config_to_dict(cfg)) == cfg
    # Ring attention has no attention dropout: context parallel with dropout is refused.
    from meshloom.mesh import ParallelDims
    assert "ring attention applies no" in cfg.layout_problem(ParallelDims.resolve(2, cp=2), 64)
    assert cfg.layout_problem(ParallelDims.resolve(2), 64) is None
    assert families.config_from_preset("gpt2-tiny").layout_problem(
        ParallelDims.resolve(2, cp=2), 64) is None


# ------------------------------------------------------------------ the CPU config


def test_small_cpu_config_trains_under_zero3(tmp_path, token_cache):
    """configs/gpt2_small_cpu.toml, 2 steps under dp_shard 2 ZeRO-3 (2 real ranks)."""
    results = run_ranks(_small_cpu_job, 2, tmp_path, token_cache)
    assert len(results[0]) == 2 and results[0] == results[1]
    assert all(math.isfinite(x) for x in results[0])


def _small_cpu_job(run_dir, cache):
    from meshloom.config import load_config

    cfg = load_config(ROOT / "configs" / "gpt2_small_cpu.toml",
                      [f"run.dir={run_dir}", f"data.cache_dir={cache}", "train.steps=2",
                       "train.eval_every=0", "train.eval_sequences=0", "train.sample_tokens=0"])
    assert cfg.parallel.zero_stage == 3 and cfg.parallel.dp_shard == 2
    return train(cfg).losses


# ------------------------------------------------------------------ the planner's configs


@pytest.mark.parametrize("model", ["gpt2-xl", "megatron-1.7b"])
def test_plan_writes_a_gpt2_config_that_validates(tmp_path, model, capsys):
    """`meshloom plan --write-config` for a GPT shape: a GPT-2 preset by name, any other GPT
    shape written out; the config passes validation and builds the planned model, whatever the
    tokenizer's vocabulary."""
    from meshloom.config import load_config
    from meshloom.plan.models import PRESETS as SHAPES
    from meshloom.validation import model_config, validate

    path = tmp_path / "plan.toml"
    assert cli_main(["plan", "--model", model, "--gpus", "2", "--gpu", "titan-rtx-24g",
                     "--seq", "1024", "--global-batch", "8", "--write-config", str(path)]) == 0
    cfg = load_config(path)
    validate(cfg, 2, check_data=False)
    built = model_config(cfg, vocab_size=257)  # the byte tokenizer's vocabulary
    assert families.family_of(built).name == "gpt2"
    assert built.num_params() == SHAPES[model].params


# ------------------------------------------------------------------ from HF weights, generate


def _hf_train_job(run_dir, cache, overrides):
    cfg = tiny_config(run_dir, cache, "train.eval_every=0", "train.eval_sequences=0",
                      "train.sample_tokens=0", "train.steps=1", *overrides)
    return train(cfg).losses


def test_init_from_hf_then_generate(tmp_path, token_cache, capfd):
    """`model.init_from=hf:DIR` under tp 2 with sequence parallel starts from the HF weights
    (the first loss is transformers' on the same batch), and `meshloom generate` runs the
    checkpoint with the KV cache, on one process and under tp 2, greedy tokens alike."""
    from meshloom.data import BatchLoader, TokenDataset
    from meshloom.train import prepare_data

    model = _hf_model(True)
    model.save_pretrained(tmp_path / "hf")
    init = [f"model.init_from=hf:{tmp_path / 'hf'}", "parallel.tp=2", "parallel.dp_shard=1",
            "parallel.sequence_parallel=true"]
    losses = run_ranks(_hf_train_job, 2, tmp_path / "run", token_cache, init)[0]
    cfg = tiny_config(tmp_path / "run", token_cache, *init)
    data = TokenDataset(prepare_data(cfg), cfg.data.seq_len, "train", cfg.data.val_fraction)
    loader = BatchLoader(data, global_batch=cfg.train.global_batch,
                         micro_batch=cfg.train.global_batch, dp_rank=0, dp_size=1,
                         seed=cfg.train.seed)
    ((x, y),) = loader.micro_batches(0)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1),
                                                 y.flatten()).item()
    assert losses[0] == pytest.approx(want, rel=1e-5)
    outs = []
    for tp in ("1", "2"):
        capfd.readouterr()
        assert cli_main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "def ",
                         "--max-new-tokens", "8", "--temperature", "0", "--tp", tp,
                         "--json"]) == 0
        outs.append(json.loads(capfd.readouterr().out.strip().splitlines()[-1]))
    assert [o["tp"] for o in outs] == [1, 2] and len(outs[0]["new_ids"]) == 8
    assert outs[0]["new_ids"] == outs[1]["new_ids"]
