"""The optimizer step as the training loop takes it: the gradient norm in one multi-tensor pass,
and, with a fused AdamW, clipping and the non-finite skip inside the optimizer kernel
(optim.guarded_step) instead of host-side passes. On CPU the fused AdamW is PyTorch's CPU
kernel, which reads grad_scale and found_inf as the CUDA one does."""

from __future__ import annotations

import pytest
import torch
from conftest import WELL_CONDITIONED, tiny_config
from dist_harness import run_ranks

from meshloom.config import TrainConfig
from meshloom.optim import (
    build_optimizer,
    clip_grads,
    grad_norm,
    grad_norm_tensor,
    guarded_step,
    guards_in_kernel,
)
from meshloom.train import train


def _params(seed: int = 0, scale: float = 10.0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(7, 5, generator=g)),
              torch.nn.Parameter(torch.randn(5, generator=g))]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=g)
    return params


def _optimizer(params, impl: str = "fused") -> torch.optim.AdamW:
    return build_optimizer(params[:1], params[1:], TrainConfig(optimizer_impl=impl))


def _state(opt: torch.optim.AdamW, params) -> list[torch.Tensor]:
    return [t.clone() for p in params for t in (p.detach(), opt.state[p]["exp_avg"],
                                                 opt.state[p]["exp_avg_sq"],
                                                 opt.state[p]["step"])]


@pytest.mark.parametrize("max_norm,grad_scale", [(1.0, 10.0), (1e4, 10.0), (0.0, 10.0)])
def test_clip_in_the_kernel_matches_clipping_first(max_norm, grad_scale):
    """Three steps with fresh gradients: clipped (norm above max_norm), not clipped (below),
    and no clipping at all (max_norm 0), against clip_grads then step."""
    a, b = _params(scale=grad_scale), _params(scale=grad_scale)
    opt_a, opt_b = _optimizer(a), _optimizer(b)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * grad_scale
                 for p in a]
        for p, q, g in zip(a, b, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        norm_t = grad_norm_tensor(a)
        norm, skipped = guarded_step(opt_a, norm_t, max_norm, True)()
        assert not skipped and norm == pytest.approx(float(torch.linalg.vector_norm(
            torch.cat([g.flatten() for g in grads]))), rel=1e-6)
        clip_grads(b, max_norm, grad_norm(b))
        opt_b.step()
    for x, y in zip(_state(opt_a, a), _state(opt_b, b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    assert opt_a.grad_scale is None and opt_a.found_inf is None


@pytest.mark.parametrize("bad", ["nan_grad", "inf_grad", "nan_loss"])
def test_a_non_finite_step_changes_nothing(bad):
    params = _params()
    opt = _optimizer(params)
    guarded_step(opt, grad_norm_tensor(params), 1.0, True)()  # a first, real step
    before = _state(opt, params)
    if bad != "nan_loss":
        params[0].grad[1, 2] = float("nan") if bad == "nan_grad" else float("inf")
    norm, skipped = guarded_step(opt, grad_norm_tensor(params), 1.0, bad != "nan_loss")()
    assert skipped
    for x, y in zip(_state(opt, params), before, strict=True):
        assert torch.equal(x, y)  # weights, both moments and the step count


def test_agree_makes_a_rank_with_good_gradients_skip():
    """What another rank's bad gradients do through `agree` (the all-reduced maximum)."""
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = _optimizer(params)
    _, skipped = guarded_step(opt, grad_norm_tensor(params), 1.0, True,
                              agree=lambda flag: flag.fill_(1.0))()
    assert skipped
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    assert all(not torch.is_nonzero(opt.state[p]["step"]) for p in params)


def test_guarded_step_needs_a_fused_optimizer():
    params = _params()
    foreach = _optimizer(params, "foreach")
    assert guards_in_kernel(_optimizer(params)) and not guards_in_kernel(foreach)
    with pytest.raises(ValueError, match="fused AdamW"):
        guarded_step(foreach, grad_norm_tensor(params), 1.0, True)


def test_norm_of_mixed_dtypes_is_taken_in_fp32():
    params = _params()
    params[1] = torch.nn.Parameter(params[1].detach().bfloat16())
    params[1].grad = torch.randn(params[1].shape, dtype=torch.bfloat16)
    want = torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in params]))
    got = grad_norm_tensor(params)
    assert got.dtype == torch.float32 and got.ndim == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert grad_norm_tensor([torch.nn.Parameter(torch.ones(2))]) is None  # no gradients
    assert grad_norm([]) == 0.0


def _losses(run_dir, cache, impl: str) -> list[float]:
    # The two AdamW implementations compute in different orders: WELL_CONDITIONED bounds how
    # much AdamW amplifies that, whatever order a machine's kernels take.
    cfg = tiny_config(run_dir, cache, "train.steps=4", "train.eval_every=0",
                      "train.sample_tokens=0", "train.grad_clip=0.05", *WELL_CONDITIONED, impl)
    return train(cfg).losses


def test_training_with_the_clip_in_the_kernel_matches_the_host_clip(tmp_path, token_cache):
    """Two ranks, a clip far below the gradients' norm (it acts every step): the fused
    in-kernel path trains as the host-side path does."""
    fused = run_ranks(_losses, 2, tmp_path / "fused", token_cache,
                      "train.optimizer_impl=fused")[0]
    foreach = run_ranks(_losses, 2, tmp_path / "foreach", token_cache,
                        "train.optimizer_impl=foreach")[0]
    assert fused == pytest.approx(foreach, rel=1e-4)
    assert fused[0] == foreach[0]  # nothing but the optimizer differs


def test_unknown_optimizer_impl_is_named(capsys):
    from conftest import ROOT

    from meshloom.commands import main as cli_main

    tiny = str(ROOT / "configs" / "tiny.toml")
    assert cli_main(["layout", tiny, "--set", "train.optimizer_impl=fuse"]) == 2
    err = capsys.readouterr().err
    assert "train.optimizer_impl: unknown implementation 'fuse'" in err
    assert "did you mean 'fused'" in err and len(err.strip().splitlines()) == 1
