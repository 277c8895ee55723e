"""The mixture-of-experts block on its own: routing against a per-token reference, the
load-balancing loss against the Switch formula, capacity dropping first come first served,
the grouped kernel against the loop, per-sequence routing groups, the auxiliary gradient, and
parameter counts of the published Mixtral models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from meshloom.config import ConfigError
from meshloom.models import families
from meshloom.models.moe import MoE, MoESettings, route, set_aux_grad_scale
from meshloom.validation import validate

DIM = 16


def _moe(seed: int = 0, **kw) -> MoE:
    cfg = MoESettings(**{"n_experts": 4, "top_k": 2, "hidden": 8, **kw})
    torch.manual_seed(seed)
    m = MoE(DIM, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def _per_token(m: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """Each token by itself: its top-k experts' SwiGLU outputs weighted by the (renormalised)
    scores, plus the (gated) shared expert. `keep[t][j]` False drops choice j of token t."""
    s = m.settings
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for t, v in enumerate(flat):
        logits = m.router(v)
        scores = logits.softmax(-1) if s.score == "softmax" else logits.sigmoid()
        w, idx = scores.topk(s.top_k)
        if s.normalize:
            w = w / w.sum()
        for j, (wj, e) in enumerate(zip(w, idx.tolist(), strict=True)):
            if keep is not None and not keep[t][j]:
                continue
            ex = m.experts
            h = F.silu(ex.w1[e] @ v) * (ex.w3[e] @ v)
            out[t] += wj * (ex.w2[e] @ h)
        if m.shared is not None:
            sh = m.shared(v)
            if m.shared_gate is not None:
                sh = sh * torch.sigmoid(m.shared_gate(v))
            out[t] += sh
    return out.view_as(x)


@pytest.mark.parametrize("kw", [{}, {"score": "sigmoid"}, {"normalize": False},
                                {"shared_hidden": 8, "shared_gate": True}, {"top_k": 1}])
def test_dropless_output_equals_each_token_routed_alone(kw):
    m = _moe(**kw)
    x = torch.randn(3, 5, DIM)
    torch.testing.assert_close(m(x), _per_token(m, x), rtol=1e-5, atol=1e-6)


def test_load_balancing_loss_is_the_switch_formula_per_sequence():
    """E * sum_i f_i * P_i per sequence (f: share of its s*k assignments on expert i, P: mean
    router probability), averaged over sequences; written out with loops here."""
    torch.manual_seed(1)
    b, s, E, k = 3, 7, 5, 2
    logits = torch.randn(b * s, E)
    r = route(logits, s, MoESettings(n_experts=E, top_k=k, hidden=4))
    probs = logits.softmax(-1)
    want = 0.0
    for q in range(b):
        rows = range(q * s, (q + 1) * s)
        chosen = [e for t in rows for e in probs[t].topk(k).indices.tolist()]
        f = [chosen.count(i) / (s * k) for i in range(E)]
        p = [float(probs[list(rows), i].mean()) for i in range(E)]
        want += E * sum(fi * pi for fi, pi in zip(f, p, strict=True)) / b
    assert float(r.aux.detach()) == pytest.approx(want, rel=1e-6)
    # Perfectly balanced routing with uniform probabilities gives exactly 1.
    uniform = torch.zeros(4 * 4, 4)
    uniform[torch.arange(16), torch.arange(16) % 4] = 1e-4  # ties broken, one expert each
    flat = route(uniform, 4, MoESettings(n_experts=4, top_k=1, hidden=4))
    assert float(flat.aux) == pytest.approx(1.0, rel=1e-3)


def test_capacity_keeps_the_first_assignments_of_each_sequence():
    """Every token prefers expert 0; with room for 3 per sequence, the first 3 tokens of each
    sequence keep it, the others lose it (and keep their second choice)."""
    cfg = MoESettings(n_experts=4, top_k=2, hidden=8, capacity_factor=1.0)
    b, s = 2, 6  # capacity ceil(1.0 * 6 * 2 / 4) = 3
    logits = torch.full((b * s, 4), -5.0)
    logits[:, 0] = 5.0
    t = torch.arange(b * s)
    logits[t, 1 + t % 3] = 2.0  # second choices spread: 2 per expert and sequence, room for all
    r = route(logits, s, cfg)
    assert cfg.capacity(s) == 3
    on_zero = sorted(r.token[: int(r.counts[0])].tolist())
    assert on_zero == [0, 1, 2, 6, 7, 8]
    assert int(r.dropped) == 2 * (s - 3)
    # And the block's output is the per-token reference with exactly those choices dropped.
    m = _moe(capacity_factor=1.0)
    x = torch.randn(2, 6, DIM)
    flat = m.router(x.reshape(-1, DIM)).float()
    top = flat.softmax(-1).topk(2).indices.tolist()
    used: dict[tuple[int, int], int] = {}
    keep = []
    for t, choices in enumerate(top):
        row = []
        for e in choices:
            key = (t // 6, e)
            used[key] = used.get(key, 0) + 1
            row.append(used[key] <= 3)
        keep.append(row)
    torch.testing.assert_close(m(x), _per_token(m, x, keep), rtol=1e-5, atol=1e-6)


def test_routing_groups_are_sequences():
    """A batch routed whole or in two halves: the same outputs and the same mean loss, which is
    what makes every data-parallel split route like one process."""
    m = _moe(capacity_factor=0.75)
    x = torch.randn(4, 6, DIM)
    whole = m(x)
    halves = torch.cat([m(x[:2]), m(x[2:])])
    torch.testing.assert_close(whole, halves, rtol=1e-6, atol=1e-7)
    flat = m.router(x.reshape(-1, DIM)).detach()
    r_all = route(flat, 6, m.settings)
    r_a, r_b = route(flat[:12], 6, m.settings), route(flat[12:], 6, m.settings)
    assert float(r_all.aux) == pytest.approx((float(r_a.aux) + float(r_b.aux)) / 2, rel=1e-6)
    assert int(r_all.dropped) == int(r_a.dropped) + int(r_b.dropped)


def _both_kernels(autocast: bool) -> tuple[list, list]:
    """Outputs and gradients (input, then each expert weight) of the loop and the grouped
    kernel on the same rows, an expert with no rows included."""
    m = _moe()
    x = torch.randn(10, DIM, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 2])
    outs, grads = [], []
    for kernel in ("loop", "grouped"):
        m.experts.kernel = kernel
        m.zero_grad()
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m.experts(x, counts)
        assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach().float())
        grads.append([x.grad.clone(), *(p.grad.clone() for p in m.experts.parameters())])
    return outs, grads


def test_grouped_kernel_equals_the_loop():
    """torch._grouped_mm (what CUDA runs) and the per-expert loop: same outputs and gradients."""
    outs, grads = _both_kernels(autocast=False)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_kernel_runs_in_autocast_dtype_like_the_loop():
    """Under autocast with fp32 parameters (meshloom's unsharded bf16) the grouped kernel casts
    its operands as autocast casts the loop's matmuls (torch._grouped_mm has no autocast rule
    of its own): bf16 output (checked in _both_kernels), fp32 gradients for the fp32 weights."""
    outs, grads = _both_kernels(autocast=True)
    assert all(g.dtype == torch.float32 for pair in grads for g in pair)
    # Both paths round the same bf16 operands; only their fp32 accumulation order may differ.
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_auxiliary_gradient_is_the_coefficient_times_the_loss_gradient():
    """The router's gradient equals that of (output . G + coef * scale * aux), aux written as
    an explicit loss term; the block's output is unchanged by it."""
    coef, scale = 0.3, 0.25
    m = _moe(aux_loss_coef=coef)
    x = torch.randn(2, 5, DIM)
    g = torch.randn(2, 5, DIM)
    set_aux_grad_scale(scale)
    try:
        (m(x) * g).sum().backward()
    finally:
        set_aux_grad_scale(1.0)
    got = m.router.weight.grad.clone()
    m.zero_grad()
    ref = _moe(aux_loss_coef=0.0)
    ref.load_state_dict(m.state_dict())
    aux = route(ref.router(x.reshape(-1, DIM)), 5, ref.settings).aux
    ((ref(x) * g).sum() + coef * scale * aux).backward()
    torch.testing.assert_close(got, ref.router.weight.grad, rtol=1e-5, atol=1e-7)
    assert float((got - ref.router.weight.grad).abs().max()) < \
        0.01 * float(ref.router.weight.grad.abs().max())


def test_published_mixtral_parameter_counts():
    big = families.config_from_preset("mixtral-8x7b")
    assert round(big.num_params() / 1e9, 1) == 46.7  # "46.7B total parameters"
    assert round(big.active_params() / 1e9, 1) == 12.9  # "12.9B active per token"
    dense = families.config_from_preset("tiny")
    assert dense.active_params() == dense.num_params()
    tiny = families.config_from_preset("mixtral-tiny")
    model = families.build_model(tiny, seed=0)
    assert sum(p.numel() for p in model.parameters()) == tiny.num_params()


@pytest.mark.parametrize("overrides,nproc,message", [
    (["model.top_k=9"], 1, "model.top_k=9 must be between 1 and model.n_experts=8"),
    (["model.router_score=relu"], 1, "model.router_score='relu' must be 'softmax' or"),
    (["model.capacity_factor=0"], 1, "model.capacity_factor=0.0 must be > 0"),
    (["parallel.ep=3", "train.global_batch=12", "train.eval_sequences=12"], 3,
     "parallel.ep=3 must divide model.n_experts=8"),
    (["parallel.ep=4"], 2, "parallel.ep=4 must be >= 1 and divide parallel.dp_shard x"),
])
def test_bad_moe_settings_are_one_line_errors(tmp_path, token_cache, overrides, nproc, message):
    cfg = tiny_config(tmp_path, token_cache, "model.preset=mixtral-tiny", *overrides)
    with pytest.raises(ConfigError, match=None) as e:
        validate(cfg, nproc)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_expert_parallel_needs_experts(tmp_path, token_cache):
    cfg = tiny_config(tmp_path, token_cache, "parallel.ep=2")
    with pytest.raises(ConfigError, match="parallel.ep=2 needs a mixture-of-experts model"):
        validate(cfg, 2)


def test_sequence_and_context_parallel_need_an_even_tp_with_experts(tmp_path, token_cache):
    """Each tp rank's slice of its cp rank's two zigzag chunks must lie in one chunk."""
    from meshloom.mesh import ParallelDims
    from meshloom.parallel.expert import check_ep_config

    cfg = tiny_config(tmp_path, token_cache, "model.preset=mixtral-tiny",
                      "parallel.sequence_parallel=true")
    model = families.config_from_preset("mixtral-tiny")
    odd = check_ep_config(cfg, ParallelDims(tp=3, cp=2, dp_shard=1), model)
    assert odd is not None and "parallel.tp=3 must be even" in odd
    assert check_ep_config(cfg, ParallelDims(tp=2, cp=2, dp_shard=1), model) is None
    assert check_ep_config(cfg, ParallelDims(tp=3, cp=1, dp_shard=1), model) is None


def test_combine_is_index_add_keeping_only_the_index():
    """The combine (`_Combine`) gives index_add's output and gradient exactly, and keeps only
    the token index for backward (autograd's index_add also keeps the rows)."""
    from meshloom.models.moe import _Combine

    rows = torch.randn(7, DIM, requires_grad=True)
    token = torch.tensor([0, 2, 2, 3, 5, 5, 1])
    g = torch.randn(6, DIM)
    got = _Combine.apply(rows, token, 6)
    (got_grad,) = torch.autograd.grad(got, rows, g)
    ref = torch.zeros(6, DIM).index_add(0, token, rows)
    (ref_grad,) = torch.autograd.grad(ref, rows, g)
    assert torch.equal(got, ref) and torch.equal(got_grad, ref_grad)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        _Combine.apply(rows, token, 6)
    assert [t.dtype for t in kept] == [torch.int64]


def test_rows_travel_in_the_autocast_dtype():
    """Under autocast the dispatched rows are cast before the dispatcher (expert parallel's
    all-to-all then moves bf16, not fp32), with the same outputs as casting inside."""
    m = _moe()
    seen = []
    local = m.dispatcher

    def record(x, counts, experts):
        seen.append(x.dtype)
        return local(x, counts, experts)

    x = torch.randn(2, 5, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m.dispatcher = record
        out = m(x)
        # fp32 rows, as before the cast moved out of the experts: the same result.
        m.dispatcher = lambda x, counts, experts: local(x.float(), counts, experts)
        ref = m(x)
    m.dispatcher = local
    assert seen == [torch.bfloat16] and torch.equal(out, ref)
