"""Activation checkpointing (none / full / selective): the same losses and gradients as without
it in every layout, bit for bit, and what each mode reruns in backward."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import assert_same_grad_norms, assert_same_gradients, gradient_probe, tiny_config
from dist_harness import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from meshloom.models.llama import Llama, config_from_preset
from meshloom.parallel.activation_checkpointing import apply_block_options

STEPS = 2


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str, model: torch.nn.Module | None = None,
                  tokens: torch.Tensor | None = None) -> Counter:
    """ATen ops that run during backward after one forward (default: a tiny Llama)."""
    torch.manual_seed(0)
    if model is None:
        model, tokens = Llama(config_from_preset("tiny")), torch.randint(0, 257, (2, 64))
    apply_block_options(model, mode)
    loss = model(tokens).float().logsumexp(-1).mean()
    with _Count() as count:
        loss.backward()
    return count.ops


def _all_modes() -> list[Counter]:
    return [_backward_ops(m) for m in ("none", "selective", "full")]


def _moe_backward_ops(mode: str) -> Counter:
    """`_backward_ops` of a tiny mixture-of-experts Llama whose experts run the grouped GEMM
    (what CUDA runs; the CPU would loop over plain matmuls)."""
    from meshloom.models.llama import LlamaConfig
    from meshloom.models.moe import moe_blocks

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                              max_seq_len=32, n_experts=4, top_k=2, moe_hidden=32))
    for _, moe in moe_blocks(model):
        moe.experts.kernel = "grouped"
    return _backward_ops(mode, model, torch.randint(0, 64, (2, 16)))


def _moe_modes() -> list[Counter]:
    return [_moe_backward_ops(m) for m in ("none", "selective", "full")]


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_grouped_mm"), reason="torch < 2.8")
def test_selective_keeps_the_experts_grouped_gemm_outputs():
    """Selective recompute saves the experts' grouped GEMM outputs as it saves every matmul's:
    backward runs no more of them than without checkpointing, while full reruns all three per
    block (w2's output too: the combine weights' gradient reads it)."""
    none, sel, full = run_ranks(_moe_modes, 1)[0]
    gmm = none["_grouped_mm"]
    assert gmm > 0 and sel["_grouped_mm"] == gmm
    assert full["_grouped_mm"] == gmm + 3 * 2
    assert sel["mm"] == none["mm"]


def test_what_each_mode_recomputes():
    """full reruns each block's forward in backward (its matmuls too); selective reruns the
    attention core and the elementwise ops but no matmul; none reruns nothing. (Run in a forked
    rank: computing in the test process first would leave thread pools that hang later forks.)"""
    none, sel, full = run_ranks(_all_modes, 1)[0]
    layers = config_from_preset("tiny").n_layers
    attn = "_scaled_dot_product_flash_attention_for_cpu"
    assert none[attn] == 0 and sel[attn] == layers and full[attn] == layers
    mm = none["mm"]
    assert sel["mm"] == mm  # no matmul recomputed
    # q, k, v, o, w1, w3 per block once more; w2's output is never needed for backward, and
    # the non-reentrant checkpoint stops its rerun once it has every saved tensor.
    assert full["mm"] == mm + 6 * layers
    assert sel["rsqrt"] > none["rsqrt"]  # the norms are recomputed


def _gpt2_dropout_modes() -> list[Counter]:
    """`_backward_ops` of a tiny GPT-2 with attention dropout, which CPU's SDPA runs on its math
    path: the scores and the weighted values are batched matmuls, not a fused kernel."""
    from meshloom.models.gpt2 import PRESETS, GPT2Config, build_model

    cfg = GPT2Config(**{**PRESETS["gpt2-tiny"], "dropout": 0.1})
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    return [_backward_ops(m, build_model(cfg, seed=0).train(), tokens)
            for m in ("none", "selective", "full")]


def test_selective_reruns_a_math_path_attention_core():
    """Where SDPA falls back to its math path, selective reruns its two batched matmuls with the
    softmax and dropout, as it reruns a fused kernel, instead of keeping the scores (quadratic in
    the sequence; test_plan_memory_census.py checks the bytes); the projections are still kept."""
    none, sel, full = run_ranks(_gpt2_dropout_modes, 1)[0]
    from meshloom.models.gpt2 import PRESETS
    layers = PRESETS["gpt2-tiny"]["n_layers"]
    assert none["bmm"] > 0 and none["_scaled_dot_product_flash_attention_for_cpu"] == 0
    assert sel["bmm"] == full["bmm"] == none["bmm"] + 2 * layers  # scores and weighted values
    assert sel["addmm"] == none["addmm"] and full["addmm"] > none["addmm"]


def _gpt2_dropout_grads() -> list[dict]:
    """Each mode's gradients after one forward and backward of the dropout GPT-2 from the same
    seed: the rerun draws the forward's masks again (the checkpoint restores the RNG state)."""
    from meshloom.models.gpt2 import PRESETS, GPT2Config, build_model

    cfg = GPT2Config(**{**PRESETS["gpt2-tiny"], "dropout": 0.1})
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    grads = []
    for mode in ("none", "selective", "full"):
        model = build_model(cfg, seed=0).train()
        apply_block_options(model, mode)
        torch.manual_seed(0)
        model(tokens).float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    return grads


def test_recompute_draws_the_same_dropout_masks():
    none, sel, full = run_ranks(_gpt2_dropout_grads, 1)[0]
    for name, g in none.items():
        assert torch.equal(sel[name], g), f"selective: {name}"
        assert torch.equal(full[name], g), f"full: {name}"


def _job(run_dir, cache, overrides, explicit_ring=False):
    """Rank 0's losses, and every rank's first-step gradients and gradient norms.
    `explicit_ring`: context parallel's ring multiplies blocks itself (the path of devices
    without CPU's fused attention kernel)."""
    from meshloom.train import train
    if explicit_ring:
        import meshloom.parallel.context as context

        context._fused_cpu = lambda q: False
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=0",
                      "train.eval_sequences=0", "train.sample_tokens=0", *overrides)
    with gradient_probe() as probe:
        losses = train(cfg).losses
    return {"losses": losses, **probe}


LAYOUTS = {
    "1 process": (1, []),
    "zero-2 accum": (2, ["parallel.zero_stage=2", "train.micro_batch=4"]),
    "tp 2 + sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp 2 zb_h1": (2, ["parallel.pp=2", "parallel.pp_schedule=zb_h1",
                       "parallel.pp_microbatches=4"]),
    "cp 2": (2, ["parallel.cp=2"]),
    "dp_shard 2 x tp 2 zero-3": (4, ["parallel.tp=2", "parallel.zero_stage=3"]),
}


def _assert_same_run(base: list[dict], got: list[dict], mode: str) -> None:
    want = base[0]["losses"]
    assert got[0]["losses"] == want, f"{mode}: {got[0]['losses']} vs {want}"
    # Recomputing reruns the same kernels on the same inputs: the gradients (which AdamW would
    # hide from the losses if they were scaled) are bit-identical too.
    for b, g in zip(base, got, strict=True):
        assert g["norms"] == b["norms"], mode
        for name, w in b["grads"].items():
            assert torch.equal(g["grads"][name], w), f"{mode}: gradient of {name}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_same_losses_with_checkpointing(tmp_path, token_cache, name):
    world, ov = LAYOUTS[name]
    base = run_ranks(_job, world, tmp_path / "none", token_cache, ov)
    for mode in ("full", "selective"):
        got = run_ranks(_job, world, tmp_path / mode, token_cache,
                        [*ov, f"train.activation_checkpointing={mode}"])
        _assert_same_run(base, got, mode)


def test_selective_reruns_the_explicit_ring_exactly(tmp_path, token_cache):
    """Selective recompute reruns the whole ring, its per-block matmuls included (their score
    blocks are not kept: tests/test_plan_memory_census.py), to the same bits."""
    ov = ["parallel.cp=2"]
    base = run_ranks(_job, 2, tmp_path / "none", token_cache, ov, True)
    got = run_ranks(_job, 2, tmp_path / "selective", token_cache,
                    [*ov, "train.activation_checkpointing=selective"], True)
    _assert_same_run(base, got, "selective")


def _saved_bytes(model: torch.nn.Module) -> int:
    sizes: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: sizes.append(t.numel() * t.element_size()) or t, lambda t: t):
        model(torch.randint(0, 257, (2, 64))).float().logsumexp(-1).mean()
    return sum(sizes)


def _saved_bytes_compiled() -> dict[str, int]:
    """Bytes autograd keeps for backward after one forward of a tiny Llama with compiled blocks,
    per mode. (Eager selective checkpointing keeps its matmul outputs in the checkpoint's own
    storage, out of the saved-tensor hooks' sight; compiled, they are the graph's saved tensors.)"""
    out = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = Llama(config_from_preset("tiny"))
        apply_block_options(model, mode, True, "aot_eager")
        out[mode] = _saved_bytes(model)
    return out


def test_selective_stays_selective_when_compiled():
    """Compiled blocks keep each mode's memory: selective saves less than none and clearly more
    than full. (Compiling the block inside the checkpoint made it one opaque op that selective
    could only rerun whole, i.e. full: on an H100 compiled+selective then had full's time and
    memory, and here both saved the same bytes.)"""
    saved = run_ranks(_saved_bytes_compiled, 1)[0]
    assert 2 * saved["full"] < saved["selective"] < saved["none"], saved


@pytest.mark.parametrize("world,ov", [
    (1, ["train.compile_backend=inductor", "train.activation_checkpointing=selective"]),
    (2, ["train.compile_backend=aot_eager", "parallel.tp=2",
         "train.activation_checkpointing=full"]),
], ids=["inductor 1 process + selective", "aot_eager tp 2 + full"])
def test_compiled_blocks_same_losses(tmp_path, token_cache, world, ov):
    """`train.compile` compiles each block's forward (inside the checkpoint); the losses stay
    those of the eager run (under tp with the collectives inside the graph)."""
    layout = [o for o in ov if o.startswith("parallel.")]
    base = run_ranks(_job, world, tmp_path / "eager", token_cache, layout)[0]
    got = run_ranks(_job, world, tmp_path / "compiled", token_cache, [*ov, "train.compile=true"],
                    timeout=300)[0]
    assert got["losses"] == pytest.approx(base["losses"], rel=1e-5)
    assert_same_grad_norms(base["norms"], got["norms"])
    assert_same_gradients(base["grads"], got["grads"])
