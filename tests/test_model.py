import dataclasses
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshloom.models.generate import generate
from meshloom.models.llama import (
    PRESETS,
    Attention,
    Llama,
    LlamaConfig,
    build_model,
    config_from_preset,
    init_tensor,
    init_weights,
    llama3_frequencies,
    param_seed,
    rope_frequencies,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These ops are tiny; intra-op threads only add spin-wait stalls when the CPU is shared.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny(**overrides) -> LlamaConfig:
    return config_from_preset("tiny", **overrides)


def real_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() dedups a tied head


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("tie", [False, True])
def test_num_params_matches_built_model(tie):
    cfg = tiny(tie_embeddings=tie)
    model = build_model(cfg, seed=0)
    assert cfg.num_params() == real_count(model)
    assert cfg.num_params(include_embeddings=False) == real_count(model) - (
        model.tok_embeddings.weight.numel()
    )
    assert (model.output.weight is model.tok_embeddings.weight) == tie


@pytest.mark.parametrize("preset", ["llama3-1b", "llama3-8b"])
def test_num_params_on_meta(preset):
    cfg = config_from_preset(preset)
    with torch.device("meta"):
        model = Llama(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert cfg.num_params() == real_count(model)
    assert build_model(cfg, seed=0, device="meta").output.weight.is_meta


def test_llama3_sizes():
    assert config_from_preset("llama3-8b").num_params() == pytest.approx(8.03e9, rel=0.01)
    assert config_from_preset("llama3-70b").num_params() == pytest.approx(70.6e9, rel=0.01)
    assert 1e6 <= config_from_preset("demo").num_params() <= 3e6
    assert 8e6 <= config_from_preset("small").num_params() <= 12e6


def test_presets_validate_and_unknown_names():
    for name in PRESETS:
        config_from_preset(name).validate()
    with pytest.raises(ValueError, match="llama3-8b"):
        config_from_preset("gpt5")
    with pytest.raises(ValueError, match="n_hedas"):
        config_from_preset("tiny", n_hedas=3)


def test_ffn_hidden_rule():
    assert LlamaConfig(dim=64).hidden == 192  # int(512/3)=170 -> next multiple of 32
    # Llama-3-8B's published multiplier reproduces its explicit 14336.
    cfg = LlamaConfig(dim=4096, multiple_of=1024, ffn_dim_multiplier=1.3)
    assert cfg.hidden == 14336


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_heads=6, n_kv_heads=4, dim=96), "model.n_heads=6"),
        (dict(dim=100, n_heads=3), "model.dim=100"),
        (dict(dim=96, n_heads=32, n_kv_heads=None), "head_dim=3"),
        (dict(n_layers=0), "model.n_layers=0"),
        (dict(ffn_hidden=-1), "model.ffn_hidden=-1"),
    ],
)
def test_validate_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        LlamaConfig(**overrides).validate()


def test_flops_per_token():
    cfg = tiny()
    model = build_model(cfg, seed=0)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    s = 128
    assert cfg.flops_per_token(s) == 6 * matmul + 6 * cfg.n_layers * s * cfg.dim
    # Attention term is linear in the context; the parameter term does not depend on it.
    assert cfg.flops_per_token(2 * s) - cfg.flops_per_token(s) == 6 * cfg.n_layers * s * cfg.dim
    # A tied head still costs its matmul.
    assert tiny(tie_embeddings=True).flops_per_token(s) == cfg.flops_per_token(s) > 0


# ---------------------------------------------------------------- init


def test_init_deterministic_and_seeded():
    a, b, c = (build_model(tiny(), seed=s) for s in (1, 1, 2))
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(),
                                  c.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_param_seeds_distinct():
    with torch.device("meta"):
        template = [n for n, _ in Llama(tiny(n_layers=1)).named_parameters()]
    names = {n.replace("layers.0.", f"layers.{i}.") for n in template for i in range(1000)}
    for seed in (0, 1, 2**40 + 3):
        assert len({param_seed(seed, n) for n in names}) == len(names)


def test_init_independent_of_layout():
    full = build_model(tiny(), seed=3)
    # A "stage" holding only some parameters (the rest stay on meta) gets the same values.
    with torch.device("meta"):
        part = Llama(tiny())
    part.layers[1].to_empty(device="cpu")
    part.output.to_empty(device="cpu")
    init_weights(part, seed=3)
    for name, p in part.named_parameters():
        if not p.is_meta:
            assert torch.equal(p, full.get_parameter(name)), name
    # Fewer layers: the same draws; only the depth-scaled residual projections change scale.
    shallow = build_model(tiny(n_layers=2), seed=3)
    for name, p in shallow.named_parameters():
        ref = full.get_parameter(name)
        if name.endswith(("wo.weight", "w2.weight")):
            torch.testing.assert_close(p * math.sqrt(2 * 2), ref * math.sqrt(2 * 4))
        else:
            assert torch.equal(p, ref), name


def test_init_scheme_and_tied_head():
    cfg = tiny(tie_embeddings=True, init_std=0.05)
    model = build_model(cfg, seed=0)
    assert torch.equal(model.output.weight, init_tensor("tok_embeddings.weight",
                                                        (cfg.vocab_size, cfg.dim), cfg, 0))
    assert torch.equal(model.norm.weight, torch.ones(cfg.dim))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.05, rel=0.05)
    w2 = torch.cat([layer.feed_forward.w2.weight.flatten() for layer in model.layers])
    assert w2.std().item() == pytest.approx(0.05 / math.sqrt(8), rel=0.05)


class _Wrapper(nn.Module):
    """Mimics activation checkpointing's wrapper, which adds a segment to parameter names."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._checkpoint_wrapped_module = inner

    def forward(self, *args):
        return self._checkpoint_wrapped_module(*args)


def test_init_ignores_wrapper_segments():
    ref = build_model(tiny(), seed=5)
    model = build_model(tiny(), seed=0)
    model.layers[0] = _Wrapper(model.layers[0])
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    init_weights(model, seed=5)
    torch.testing.assert_close(model(torch.arange(8)[None]), ref(torch.arange(8)[None]),
                               rtol=0, atol=0)


def test_build_model_dtype_keeps_rope_precise():
    model = build_model(tiny(), seed=0, dtype=torch.bfloat16)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.freqs_cis.dtype == torch.complex64
    assert "freqs_cis" not in model.state_dict()
    assert model(torch.randint(0, 257, (1, 8))).dtype == torch.bfloat16


# ---------------------------------------------------------------- RoPE scaling

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # Llama 3.1's values


def test_llama3_frequencies_hand_checked():
    """Llama 3.1's values: wavelengths below 8192/4 = 2048 keep f, above 8192/1 get f/8, and
    between them s = (8192/w - 1) / 3 blends: w = 4096 gives s = 1/3, f' = (2/3)f/8 + (1/3)f
    = (5/12)f. At both edges the blend meets its neighbour (s = 1 at 2048, s = 0 at 8192)."""
    wavelengths = torch.tensor([6.0, 1000.0, 2048.0, 4096.0, 8192.0, 10000.0, 1e6],
                               dtype=torch.float64)
    f = 2 * math.pi / wavelengths
    got = llama3_frequencies(f, 8.0, 1.0, 4.0, 8192)
    want = f * torch.tensor([1, 1, 1, 5 / 12, 1 / 8, 1 / 8, 1 / 8], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_rope_frequencies_follow_the_config():
    cfg = tiny(rope_theta=500000.0)  # head_dim 16
    plain = 500000.0 ** -(torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert torch.equal(rope_frequencies(cfg), plain)
    linear = tiny(rope_theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(rope_frequencies(linear), plain / 4, rtol=1e-15, atol=0)
    scaled = tiny(rope_theta=500000.0, rope_scaling=LLAMA31)
    torch.testing.assert_close(rope_frequencies(scaled),
                               llama3_frequencies(plain, 8.0, 1.0, 4.0, 8192), rtol=0, atol=0)


def test_rope_table_without_scaling_is_unchanged():
    """rope_scaling=None is the plain table e^{i pos theta^(-2j/d)}, bit for bit; a scaled one
    turns position p by p * f'_j."""
    model = build_model(tiny(), seed=0)
    inv_freq = 10000.0 ** -(torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    angles = torch.outer(torch.arange(256, dtype=torch.float64), inv_freq)
    assert torch.equal(model.freqs_cis, torch.polar(torch.ones_like(angles), angles).to(
        torch.complex64))
    scaled = build_model(tiny(rope_scaling=LLAMA31), seed=0)
    angles = torch.outer(torch.arange(256, dtype=torch.float64),
                         llama3_frequencies(inv_freq, 8.0, 1.0, 4.0, 8192))
    assert torch.equal(scaled.freqs_cis, torch.polar(torch.ones_like(angles), angles).to(
        torch.complex64))
    assert not torch.equal(scaled.freqs_cis, model.freqs_cis)


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn' is not supported"),
        ({"rope_type": "linear"}, "linear needs factor > 0"),
        ({"rope_type": "linear", "factor": 0}, "linear needs factor > 0"),
        ({**LLAMA31, "high_freq_factor": 1.0}, "high_freq_factor > low_freq_factor"),
        ({**LLAMA31, "beta_fast": 32}, "unknown key 'beta_fast'"),
        ("llama3", "is not a table"),
    ],
)
def test_validate_rope_scaling(scaling, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        LlamaConfig(rope_scaling=scaling).validate()
    assert str(e.value).startswith("model.rope_scaling: ")


def test_rope_scaling_survives_json():
    """Checkpoints and weights folders store the config as JSON; the field must round-trip."""
    cfg = tiny(rope_scaling=LLAMA31)
    assert LlamaConfig(**json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    assert LlamaConfig(**json.loads(json.dumps(dict(vars(cfg))))) == cfg


# ---------------------------------------------------------------- forward


def naive_attention(attn: Attention, x: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """Explicit-softmax GQA with complex-number RoPE: shares no code with the module."""
    b, s, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(b, s, n_heads, hd)
    k = (x @ attn.wk.weight.T).view(b, s, n_kv, hd)
    v = (x @ attn.wv.weight.T).view(b, s, n_kv, hd)
    inv_freq = 10000.0 ** -(torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rot = torch.polar(torch.ones(s, hd // 2, dtype=torch.float64),
                      torch.outer(torch.arange(s, dtype=torch.float64), inv_freq))
    rot = rot.to(torch.complex64)[None, :, None, :]

    def rope(t):
        return torch.view_as_real(torch.view_as_complex(t.reshape(b, s, -1, hd // 2, 2)) * rot
                                  ).reshape(t.shape)

    q, k = rope(q), rope(k)
    rep = n_heads // n_kv
    k = k[:, :, [h // rep for h in range(n_heads)]]
    v = v[:, :, [h // rep for h in range(n_heads)]]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
    return out @ attn.wo.weight.T


def test_gqa_attention_matches_naive():
    cfg = tiny(n_heads=4, n_kv_heads=2)
    model = build_model(cfg, seed=0)
    attn = model.layers[0].attention
    x = torch.randn(2, 10, cfg.dim)
    got = attn(x, model.rope(10))
    torch.testing.assert_close(got, naive_attention(attn, x, 4, 2), rtol=1e-4, atol=1e-5)


def test_tensor_parallel_style_head_slicing():
    cfg = tiny(n_heads=4, n_kv_heads=2)
    model = build_model(cfg, seed=0)
    full = model.layers[0].attention
    x = torch.randn(2, 12, cfg.dim)
    rope = model.rope(12)
    hd, q_half, kv_half = cfg.head_dim, 2 * cfg.head_dim, cfg.head_dim
    total = torch.zeros_like(x)
    for rank in range(2):
        shard = Attention(cfg)
        with torch.no_grad():
            shard.wq = nn.Linear(cfg.dim, q_half, bias=False)
            shard.wk = nn.Linear(cfg.dim, kv_half, bias=False)
            shard.wv = nn.Linear(cfg.dim, kv_half, bias=False)
            shard.wo = nn.Linear(q_half, cfg.dim, bias=False)
            shard.wq.weight.copy_(full.wq.weight[rank * q_half:(rank + 1) * q_half])
            shard.wk.weight.copy_(full.wk.weight[rank * kv_half:(rank + 1) * kv_half])
            shard.wv.weight.copy_(full.wv.weight[rank * kv_half:(rank + 1) * kv_half])
            shard.wo.weight.copy_(full.wo.weight[:, rank * q_half:(rank + 1) * q_half])
        assert shard.head_dim == hd
        total += shard(x, rope)
    torch.testing.assert_close(total, full(x, rope), rtol=1e-5, atol=1e-6)


def test_causality():
    model = build_model(tiny(), seed=0).eval()
    tokens = torch.randint(0, 257, (2, 16))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 257
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_positions():
    model = build_model(tiny(), seed=0)
    tokens = torch.randint(0, 257, (2, 16))
    ref = model(tokens)
    assert torch.equal(model(tokens, positions=torch.arange(16)), ref)
    assert torch.equal(model(tokens, positions=torch.arange(16).expand(2, 16)), ref)
    # RoPE is relative: a uniform shift of all positions leaves the logits unchanged...
    torch.testing.assert_close(model(tokens, positions=torch.arange(16) + 37), ref,
                               rtol=1e-4, atol=1e-4)
    # ...while positions that change relative distances do change them.
    assert not torch.allclose(model(tokens[:, :8], positions=torch.arange(8) * 2), ref[:, :8])
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 257, dtype=torch.long))


def test_parallel_metadata():
    model = Llama(tiny())
    names = dict(model.named_modules())
    assert model.pipeline_cut_points() == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert model.fsdp_units() == ["tok_embeddings", *model.pipeline_cut_points(), ""]
    assert model.get_submodule(model.fsdp_units()[-1]) is model
    assert "tok_embeddings" not in Llama(tiny(tie_embeddings=True)).fsdp_units()
    for pattern in Llama.TP_PLAN:
        target = pattern.replace("*", "0")
        assert target in names, pattern
    assert isinstance(model.get_submodule("layers.0.attention.wq"), nn.Linear)


# ---------------------------------------------------------------- generate


def test_generate():
    model = build_model(tiny(), seed=0).train()
    prompt = torch.randint(0, 257, (3, 5))
    greedy = generate(model, prompt, 6, temperature=0)
    assert model.training
    assert greedy.shape == (3, 11) and torch.equal(greedy[:, :5], prompt)
    assert torch.equal(generate(model, prompt, 6, temperature=0), greedy)
    topk1 = generate(model, prompt, 6, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(topk1, greedy)
    sample = [generate(model, prompt, 6, temperature=1.5,
                       generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(sample[0], sample[1])
    # Cropping the context keeps long generations inside max_seq_len.
    assert generate(model, prompt, 4, temperature=0, max_seq_len=3).shape == (3, 9)


def test_generate_stops_at_eos():
    model = build_model(tiny(), seed=0)
    prompt = torch.randint(0, 257, (2, 4))
    greedy = generate(model, prompt, 8, temperature=0)
    eos = int(greedy[0, 4])  # row 0 finishes at once
    out = generate(model, prompt, 8, temperature=0, eos_id=eos)
    hits = [(row[4:] == eos).nonzero() for row in greedy]
    ends = [4 + int(h[0]) + 1 if len(h) else greedy.shape[1] for h in hits]
    assert out.shape[1] == max(ends)
    for row, end in enumerate(ends):
        assert torch.equal(out[row, :end], greedy[row, :end])
        assert (out[row, end:] == eos).all()  # finished rows are padded with eos


# ---------------------------------------------------------------- training


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = build_model(tiny(), seed=0)
    tokens = torch.randint(0, 257, (2, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(50):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(257), rel=0.1)
    assert losses[-1] < 0.5 * losses[0]
