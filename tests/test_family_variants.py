"""Mistral, Qwen2 and Qwen3 (models/mistral.py, models/qwen.py: the Llama decoder with a sliding
window, q/k/v biases, q/k norms and a head width of its own): logits equal transformers' (fp32,
within 1e-5) and convert back bit-exactly; the window really restricts attention (against a
hand-written mask, with and without the KV cache); every family trains in the parallel layouts
step for step like one process (losses, first-step gradients, gradient norms, final weights);
context parallel refuses a window shorter than the sequence; the planner counts them exactly.

The default run covers each layout once (spread over the families); the whole families x layouts
matrix runs with `-m families_matrix` (pyproject's addopts deselect it otherwise).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import (
    assert_same_grad_norms,
    assert_same_gradients,
    gradient_probe,
    tiny_config,
    whole_weights,
)
from dist_harness import run_ranks

from meshloom.commands import main as cli_main
from meshloom.config import ConfigError
from meshloom.models import families, hf_checkpoint, llama_hf
from meshloom.models.llama import Attention, LlamaConfig, build_model
from meshloom.models.mistral import MistralConfig
from meshloom.models.qwen import Qwen2Config, Qwen3Config
from meshloom.plan.models import PRESETS as PLAN_PRESETS
from meshloom.plan.models import from_hf_config
from meshloom.train import train
from meshloom.validation import model_config, validate
from meshloom.weights import load_init_weights, open_source

TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _single_threaded():
    """One thread in this process: GNU OpenMP hangs in ranks forked after a threaded op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- Hugging Face, per family

transformers = pytest.importorskip("transformers")

HF_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
                rope_theta=50000.0, rms_norm_eps=1e-5)
TOKENS = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
# model_type -> (transformers config, model class, settings beyond HF_SHAPE, meshloom config):
# a window of 8 over 48 tokens; Qwen3's heads of 32 over a hidden of 64 / 4 heads.
HF_FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8), MistralConfig),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), Qwen2Config),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32), Qwen3Config),
}


def _hf_model(model_type: str):
    config_cls, model_cls, extra, _ = HF_FAMILIES[model_type]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**HF_SHAPE, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norm gains of ones and zero biases would hide a mix-up of them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict:
    """model_type -> (transformers model, its saved folder)."""
    out = {}
    for model_type in HF_FAMILIES:
        model = _hf_model(model_type)
        folder = tmp_path_factory.mktemp(model_type) / "hf"
        model.save_pretrained(folder)
        out[model_type] = (model, folder)
    return out


@torch.no_grad()
def _meshloom_logits(path, tokens=TOKENS) -> torch.Tensor:
    model = build_model(open_source(path).cfg, seed=123).eval()
    load_init_weights(model, f"meshloom:{path}")
    return model(tokens)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("model_type", list(HF_FAMILIES))
def test_hf_logits_match_and_round_trip_is_exact(hf, tmp_path, model_type):
    model, folder = hf[model_type]
    ml, back_dir = tmp_path / "ml", tmp_path / "back"
    assert cli_main(["convert", "hf-to-meshloom", str(folder), str(ml)]) == 0
    cfg = open_source(ml).cfg
    assert type(cfg) is HF_FAMILIES[model_type][3]
    assert families.family_of(cfg).name == model_type
    with torch.no_grad():
        want = model(TOKENS).logits
    assert _diff(_meshloom_logits(ml), want) < TOL

    assert cli_main(["convert", "meshloom-to-hf", str(ml), str(back_dir)]) == 0
    written = json.loads((back_dir / "config.json").read_text())
    assert written["model_type"] == model_type
    back = getattr(transformers, HF_FAMILIES[model_type][1]).from_pretrained(back_dir).eval()
    got = back.state_dict()
    for name, w in model.state_dict().items():  # permuting there and back is exact
        assert torch.equal(got[name], w), name
    with torch.no_grad():
        assert _diff(back(TOKENS).logits, want) < TOL
    assert hf_checkpoint.read_hf_config(back_dir) == cfg


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_biases_and_norms_must_follow_the_rope_permutation(hf, tmp_path, monkeypatch,
                                                           model_type):
    """Leaving the q/k biases (Qwen2) or the q/k norm gains (Qwen3) in HF's order breaks the
    logits: the comparison above checks their permutation."""
    model, folder = hf[model_type]
    real = llama_hf._heads_of
    monkeypatch.setattr(llama_hf, "_heads_of",
                        lambda name, cfg: None if name.endswith(("bias", "norm.weight"))
                        else real(name, cfg))
    assert cli_main(["convert", "hf-to-meshloom", str(folder), str(tmp_path / "ml")]) == 0
    with torch.no_grad():
        assert _diff(_meshloom_logits(tmp_path / "ml"), model(TOKENS).logits) > 1e-3


def _edited(folder, dst, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in folder.glob("*.safetensors"):
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("model_type,changes,words", [
    ("qwen2", dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
    ("qwen3", dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("qwen2", dict(layer_types=["full_attention", "sliding_attention"]),
     "'sliding_attention' is not supported"),
    ("mistral", dict(architectures=["LlamaForCausalLM"]), "only MistralForCausalLM"),
    ("mistral", dict(sliding_window=0), "sliding_window=0 must be a positive integer"),
])
def test_hf_refuses_what_meshloom_cannot_run(hf, tmp_path, capsys, model_type, changes, words):
    folder = _edited(hf[model_type][1], tmp_path / "edited", **changes)
    assert cli_main(["convert", "hf-to-meshloom", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_export_refuses_an_option_the_architecture_lacks(tmp_path, capsys):
    """A Llama with a sliding window has no LlamaForCausalLM form (nor a Qwen2 without
    biases a Qwen2ForCausalLM one): one line, exit 2."""
    from meshloom.weights import write_weights_folder

    for preset, change, words in (("tiny", dict(sliding_window=8), "model.sliding_window=8"),
                                  ("qwen2-tiny", dict(attention_bias=False),
                                   "model.attention_bias=False")):
        cfg = families.config_from_preset(preset, **change)
        src = tmp_path / preset
        src.mkdir()
        model = build_model(cfg, seed=0)
        write_weights_folder(src, cfg, ((n, p.detach()) for n, p in model.named_parameters()))
        assert cli_main(["convert", "meshloom-to-hf", str(src), str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err


# ---------------------------------------------------------------- the sliding window


def _masked_reference(attn: Attention, x: torch.Tensor, rope: torch.Tensor,
                      window: int | None) -> torch.Tensor:
    """Attention written out with an explicit softmax and a hand-built mask (query i sees key
    j iff j <= i and i - j < window); the projections and RoPE are the module's own."""
    from meshloom.models.llama import apply_rope

    b, s, _ = x.shape
    hd = attn.head_dim
    q = apply_rope(attn.wq(x).unflatten(-1, (-1, hd)), rope)
    k = apply_rope(attn.wk(x).unflatten(-1, (-1, hd)), rope)
    v = attn.wv(x).unflatten(-1, (-1, hd))
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    allowed = [[j <= i and (window is None or i - j < window) for j in range(s)]
               for i in range(s)]
    scores = scores.masked_fill(~torch.tensor(allowed), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).flatten(2)
    return attn.wo(out)


@torch.no_grad()
def test_the_window_changes_attention_as_a_hand_written_mask_does():
    cfg = families.config_from_preset("mistral-tiny", sliding_window=5)
    model = build_model(cfg, seed=0)
    attn = model.layers[0].attention
    x = torch.randn(2, 20, cfg.dim, generator=torch.Generator().manual_seed(0))
    rope = model.rope(20)
    windowed = attn(x, rope)
    torch.testing.assert_close(windowed, _masked_reference(attn, x, rope, 5),
                               rtol=1e-5, atol=1e-6)
    full = _masked_reference(attn, x, rope, None)
    # The first 5 queries see the same keys either way; every later one loses some.
    torch.testing.assert_close(windowed[:, :5], full[:, :5], rtol=1e-5, atol=1e-6)
    assert (windowed[:, 5:] - full[:, 5:]).abs().amax(dim=(0, 2)).min() > 1e-4
    # A window as long as the sequence is full causal attention.
    attn.sliding_window = 20
    torch.testing.assert_close(attn(x, rope), full, rtol=1e-5, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("preset", ["mistral-tiny", "qwen2-tiny", "qwen3-tiny"])
def test_kv_cache_decoding_equals_the_full_forward(preset):
    """Prefill, a few tokens at once, then one at a time, past the window (mistral-tiny: 32):
    the same logits as one forward over the whole sequence."""
    model = build_model(families.config_from_preset(preset), seed=0).eval()
    tokens = torch.randint(0, 257, (2, 45), generator=torch.Generator().manual_seed(3))
    want = model(tokens)
    cache = model.new_cache(64)
    got = [model(tokens[:, :30], cache=cache), model(tokens[:, 30:36], cache=cache)]
    got += [model(tokens[:, i:i + 1], cache=cache) for i in range(36, 45)]
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- configs, counts, refusals


@pytest.mark.parametrize("preset", [p for p, f in families.presets().items()
                                    if f.name in ("mistral", "qwen2", "qwen3")])
def test_presets_count_exactly(preset):
    """meshloom's count, the planner's and the built model's agree for every new preset."""
    cfg = families.config_from_preset(preset)
    model = build_model(cfg, seed=0, device="meta")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert PLAN_PRESETS[preset].params == cfg.num_params()
    blocks, head = model.layer_costs(64)
    assert sum(blocks) + head == model.flops_per_token(64)


@pytest.mark.parametrize("preset", ["mistral-7b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen3-0.6b",
                                    "qwen3-8b"])
def test_real_shapes_match_transformers(tmp_path, preset):
    """The real-size presets, exported as config.json and built by transformers on the meta
    device: the same parameter count as meshloom's and the planner's (from that file)."""
    cfg = families.config_from_preset(preset)
    hf_cfg = llama_hf.hf_config(cfg, torch.bfloat16)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    auto = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(auto)
    assert type(model).__name__ == hf_cfg["architectures"][0]
    assert model.num_parameters() == cfg.num_params() == from_hf_config(tmp_path).params
    assert hf_checkpoint.read_hf_config(tmp_path) == cfg


def test_planner_reads_transformers_configs(tmp_path):
    for model_type in HF_FAMILIES:
        model = _hf_model(model_type)
        model.config.save_pretrained(tmp_path / model_type)
        assert from_hf_config(tmp_path / model_type).params == model.num_parameters()


def test_stored_configs_rebuild_their_family():
    for preset, cls in (("mistral-tiny", MistralConfig), ("qwen2-tiny", Qwen2Config),
                        ("qwen3-tiny", Qwen3Config), ("tiny", LlamaConfig)):
        cfg = families.config_from_preset(preset)
        back = families.config_from_dict(json.loads(json.dumps(families.config_to_dict(cfg))))
        assert type(back) is cls and back == cfg


def test_context_parallel_refuses_a_window_shorter_than_the_sequence(tmp_path, token_cache):
    base = ("model.preset=mistral-tiny", "parallel.cp=2", "parallel.dp_shard=1")
    cfg = tiny_config(tmp_path, token_cache, *base)  # window 32 < data.seq_len 64
    with pytest.raises(ConfigError) as e:
        validate(cfg, 2)
    message = str(e.value)
    assert "model.sliding_window=32" in message and "parallel.cp=2" in message
    assert "\n" not in message
    for ok in (("model.sliding_window=64",), ("parallel.cp=1", "parallel.dp_shard=2")):
        validate(tiny_config(tmp_path, token_cache, *base, *ok), 2)


# ---------------------------------------------------------------- parity with one process

STEPS = 3
QUICK = (f"train.steps={STEPS}", "train.eval_every=0", "train.eval_sequences=0",
         "train.sample_tokens=0", "train.global_batch=8", "train.warmup_steps=1")
# conftest.WELL_CONDITIONED's reasoning, one step further: AdamW amplifies the float noise of an
# element whose gradient nearly cancels by up to lr / eps. At eps 1e-6, Qwen3 under cp 2 moved
# one element of a wo by 1.15e-6 after 3 steps (losses within 1e-7, gradients within 1e-5); at
# eps 1e-4 by 5e-8. eps 1e-5 keeps that noise under the weight tolerance on any machine, while
# a real error (an update lost or doubled) is still of the order of lr = 3e-3.
CONDITIONED = ("train.eps=1e-5",)
LAYOUTS = {  # name -> (world, overrides)
    "ddp": (2, []),
    "zero1": (2, ["parallel.zero_stage=1"]),
    "zero2": (2, ["parallel.zero_stage=2"]),
    "zero3": (2, ["parallel.zero_stage=3"]),
    "hsdp": (4, ["parallel.zero_stage=3", "parallel.dp_replicate=2"]),
    "tp": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    "tp_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1"]),
    "pp_gpipe": (2, ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.dp_shard=1"]),
    "pp_1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.dp_shard=1"]),
    "pp_interleaved": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                           "parallel.pp_virtual_stages=2", "parallel.dp_shard=1"]),
    "cp": (2, ["parallel.cp=2", "parallel.dp_shard=1"]),
    "dp_tp_pp": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2",
                     "parallel.zero_stage=1"]),
}
FAMILY_PRESETS = {"mistral": "mistral-tiny", "qwen2": "qwen2-tiny", "qwen3": "qwen3-tiny"}
# Every layout once, spread over the families, in the default run: Qwen3's q/k norms under
# tensor parallel (their gradients are summed over tp), Qwen2's biases split with their columns,
# Mistral's window (32 < 64 tokens) wherever it can run, and under cp with a window of 64.
# Qwen2's tied table in the 3-D layout: a pipeline stage's copy of it, sliced by tp, must stay
# a copy (counted once in the grad norm; found by this matrix, fixed in tensor_plan.py).
DEFAULT_CASES = [("qwen3", "tp"), ("qwen3", "tp_sp"), ("qwen3", "zero3"), ("qwen3", "pp_1f1b"),
                 ("qwen3", "cp"), ("qwen3", "ddp"),
                 ("qwen2", "zero1"), ("qwen2", "hsdp"), ("qwen2", "tp"), ("qwen2", "pp_gpipe"),
                 ("qwen2", "cp"), ("qwen2", "dp_tp_pp"),
                 ("mistral", "zero2"), ("mistral", "tp_sp"), ("mistral", "pp_interleaved"),
                 ("mistral", "cp")]


def _model_overrides(family: str, layout: str) -> tuple[str, ...]:
    ov = (f"model.preset={FAMILY_PRESETS[family]}",)
    if family == "mistral" and any(o.startswith("parallel.cp=") for o in LAYOUTS[layout][1]):
        ov += ("model.sliding_window=64",)  # as long as the sequence: ring attention is exact
    return ov


def _job(run_dir, cache, overrides):
    cfg = tiny_config(run_dir, cache, *QUICK, *CONDITIONED, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, keep_model=True)
    tied = families.tied_head(model_config(cfg))  # the embedding's table, compared as such
    state = whole_weights(r.strategy, r.model)
    return {"losses": r.losses, "norms": probe["norms"],
            "state": {n: w for n, w in state.items() if n != tied},
            "grads": {n: g for n, g in probe["grads"].items() if n != tied}}


@pytest.fixture(scope="module")
def references(tmp_path_factory, token_cache):
    """Single-process runs, by model overrides, computed on first use."""
    done: dict = {}

    def get(model: tuple[str, ...]) -> dict:
        if model not in done:
            folder = tmp_path_factory.mktemp("ref")
            done[model] = run_ranks(_job, 1, folder, token_cache, list(model))[0]
        return done[model]
    return get


def _check_parity(ref: dict, results: list[dict]) -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], results[0]["losses"], strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs single-process {a}"
    merged: dict = {}  # pipeline ranks each hold their stages' parameters
    for r in results:
        merged.update(r["state"])
        assert_same_grad_norms(ref["norms"], r["norms"])
        assert_same_gradients({n: ref["grads"][n] for n in r["grads"]}, r["grads"])
    assert set(ref["grads"]) <= set().union(*(r["grads"] for r in results))
    assert set(merged) == set(ref["state"])
    for name, w in ref["state"].items():
        torch.testing.assert_close(merged[name], w, rtol=1e-5, atol=1e-6, msg=name)
    # The steps really trained (a layout that dropped every update would match a flat line).
    assert ref["losses"][-1] < ref["losses"][0] - 0.01


def _run_case(tmp_path, token_cache, references, family: str, layout: str) -> None:
    model = _model_overrides(family, layout)
    world, overrides = LAYOUTS[layout]
    results = run_ranks(_job, world, tmp_path, token_cache, [*model, *overrides])
    _check_parity(references(model), results)


@pytest.mark.parametrize("family,layout", DEFAULT_CASES,
                         ids=[f"{f}-{lay}" for f, lay in DEFAULT_CASES])
def test_parity(tmp_path, token_cache, references, family, layout):
    _run_case(tmp_path, token_cache, references, family, layout)


MATRIX = [(f, lay) for f in FAMILY_PRESETS for lay in LAYOUTS]


@pytest.mark.families_matrix
@pytest.mark.parametrize("family,layout", MATRIX, ids=[f"{f}-{lay}" for f, lay in MATRIX])
def test_parity_matrix(tmp_path, token_cache, references, family, layout):
    _run_case(tmp_path, token_cache, references, family, layout)


def test_every_layout_and_family_is_in_the_default_run():
    assert {lay for _, lay in DEFAULT_CASES} == set(LAYOUTS)
    assert {f for f, _ in DEFAULT_CASES} == set(FAMILY_PRESETS)
