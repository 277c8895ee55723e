import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from meshloom.config import Config, load_config  # noqa: E402

# The test process forks ranks (dist_harness) after some tests compute in-process. GNU OpenMP
# does not survive a fork once it has started its worker threads: a forked rank then hangs in
# its first parallel op. One thread in the parent means no worker threads to inherit; each
# forked rank sets its own count.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> str:
    """One shared token cache for the whole session (the stdlib corpus, capped)."""
    return str(tmp_path_factory.mktemp("token-cache"))


def tiny_config(run_dir, cache_dir: str, *overrides: str) -> Config:
    """configs/tiny.toml with a test's run folder and overrides, on the CPU unless an override
    says otherwise: the ranks of a multi-rank test share one machine's cores, and on a machine
    with one GPU `run.device=auto` would put every rank on that GPU."""
    return load_config(ROOT / "configs" / "tiny.toml",
                       ["run.device=cpu", f"run.dir={run_dir}", f"data.cache_dir={cache_dir}",
                        *overrides])


def load_benchmark(name: str):
    """A script from benchmarks/ (a folder of scripts, not a package), imported as a module of
    that name: its ranks (fork-server children) import it again by name to find their
    function, so benchmarks/ goes on sys.path, which they inherit."""
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.append(folder)
    return importlib.import_module(name)


# ---------------------------------------------------------------- gradients, not only losses
# AdamW divides each update by the gradient's own scale: a layout that doubled every gradient
# trains to the same losses and weights (tried: DDP, ZeRO, pipeline and vocab-parallel loss
# with gradients doubled all passed the loss-and-weight tests). Parity tests therefore also
# compare what the optimizer is handed: the first step's averaged gradients, made whole, and
# every step's global gradient norm (which clipping uses).


@contextlib.contextmanager
def gradient_probe() -> Iterator[dict]:
    """Around `train()` in a rank: yields {"grads": the first optimizer step's gradients, whole
    and in global shape (a pipeline rank: its stages'), "norms": every step's global gradient
    norm}, both as the optimizer gets them (averaged, unscaled, before clipping). The whole
    gradients are gathered by the same code that gathers the layout's final weights."""
    import meshloom.train as loop

    seen: dict = {"grads": None, "norms": []}
    real_parallelize, real_clip = loop.parallelize, loop.clip_grads
    held: dict = {}

    def parallelize(model, mesh, *args, **kwargs):
        held["par"], held["mesh"] = real_parallelize(model, mesh, *args, **kwargs), mesh
        return held["par"]

    def clip_grads(params, max_norm, norm):
        seen["norms"].append(norm)
        if seen["grads"] is None:
            seen["grads"] = _whole_grads(held["par"], held["mesh"].counter, params)
        real_clip(params, max_norm, norm)

    loop.parallelize, loop.clip_grads = parallelize, clip_grads
    try:
        yield seen
    finally:
        loop.parallelize, loop.clip_grads = real_parallelize, real_clip
    # Loud, should the loop stop calling them by these names: the comparisons would be empty.
    assert seen["grads"] is not None, "gradient_probe: meshloom.train took no optimizer step " \
        "through its parallelize() and clip_grads()"


def whole_weights(strategy, model) -> dict[str, torch.Tensor]:
    """The layout's parameters made whole (collective), as the parity tests gather them."""
    if hasattr(strategy, "full_state_dict"):
        return strategy.full_state_dict()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def _whole_grads(par, counter, params) -> dict[str, torch.Tensor]:
    """Put each optimizer tensor's gradient where its value lives, spread it to the model as a
    step would (after_step), gather it like the weights, then put everything back exactly. The
    gathers are taken off the comm counter, so that tests of exact volume are unaffected."""
    counted = dict(counter.bytes), dict(counter.calls)
    kept = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            p.zero_()
        else:
            p.copy_(p.grad)
    par.grads.after_step()
    grads = whole_weights(par.grads, par.model)
    for p, value in zip(params, kept, strict=True):
        p.copy_(value)
    par.grads.after_step()
    for live, before in zip((counter.bytes, counter.calls), counted, strict=True):
        live.clear()
        live.update(before)
    return grads


def assert_same_gradients(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                          rel: float = 1e-5) -> None:
    """Every tensor of `ref` within rel x its own largest element: the same weights and data,
    only the order of the sums differs, so this holds on any machine; a gradient scaled by 2,
    or a partial one (a missed reduction), is off by the gradient's own size."""
    for name, g in ref.items():
        diff = float((got[name] - g).abs().max())
        bound = rel * float(g.abs().max())
        assert diff <= bound, f"gradient of {name}: max |diff| {diff:.3g} > {bound:.3g}"


def assert_same_grad_norms(ref: list[float], got: list[float], first: float = 1e-5,
                           later: float = 1e-4) -> None:
    """The global gradient norm of each step: the first from the same weights (`first`
    relative), later ones from weights that AdamW has moved apart by float noise (`later`)."""
    assert len(got) == len(ref)
    for step, (a, b) in enumerate(zip(ref, got, strict=True), 1):
        tol = first if step == 1 else later
        assert abs(a - b) <= tol * abs(a), f"step {step}: gradient norm {b} vs {a}"


# AdamW's update is lr * m / (sqrt(v) + eps). For an element whose gradient nearly cancels, the
# float noise of another summation order (a layout's) is amplified by up to lr / eps: 3e5 at the
# default eps 1e-8, which moved such an element of a final weight by 6.9e-6 after 4 steps of cp 2
# (losses within 1e-7). Parity runs use eps 1e-6, which bounds the amplification at 3e3: the same
# run's weights then differ by 1.4e-7 at most, and a weight tolerance of 1e-6 holds whatever
# order a machine sums in, while a real error (an update lost or doubled) is of the order of lr.
WELL_CONDITIONED = ("train.eps=1e-6",)
