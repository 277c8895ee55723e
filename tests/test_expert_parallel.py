"""Expert parallel: parity with one process (losses, first-step gradients, every step's gradient
norm, final weights) for ep 2 and 4, with DDP, ZeRO-1/2/3, HSDP, tensor and pipeline parallel
and a 3-D product; the all-to-all bytes against the formula; the same tokens dropped under a
capacity factor; checkpoints in the experts' global shape, resumed at another ep."""

from __future__ import annotations

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

from meshloom.train import train

STEPS = 3
MOE = ["model.preset=mixtral-tiny", "model.aux_loss_coef=0.01"]
# Routing is a discrete choice: a layout must pick the same top-k experts as one process for
# every token, or a loss moves by far more than rounding. The closest top-k choices of these
# runs are ~1e-7 apart in router probability. Under AdamW's eps 1e-6 the layouts' weights drift
# apart by up to 5.7e-6 relative in 3 steps (summation order amplified by lr/eps), too close
# to that for comfort on another CPU; at eps 1e-3 they stay within 1.4e-7 (measured, ep 2 x
# tp 2 and ep 2 x cp 2), leaving the router logits ~100x inside the smallest gap. Gradients are
# still compared directly, so a wrong gradient scale is caught whatever eps hides.
ROUTING_CONDITIONED = ("train.eps=1e-3",)


def _job(run_dir, cache, overrides, resume=False):
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=0",
                      "train.eval_sequences=0", "train.sample_tokens=0", *ROUTING_CONDITIONED,
                      *MOE, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, resume=resume, keep_model=True)
    return {"losses": r.losses, "state": whole_weights(r.strategy, r.model),
            "bytes": dict(r.counter.bytes), "moe": r.moe,
            "mem": dict(r.summary["model_state_bytes"]), **probe}


_refs: dict = {}


def _reference(tmp_path_factory, cache, extra: tuple[str, ...] = ()):
    if extra not in _refs:
        _refs[extra] = run_ranks(_job, 1, tmp_path_factory.mktemp("ref"), cache, list(extra))[0]
    return _refs[extra]


def _assert_parity(ref, results):
    """Per-step losses within 1e-5; on every rank the gradient norms, and the first step's
    gradients and the final weights of what it holds (a pipeline rank: its stages), experts
    made whole; together the ranks hold every parameter."""
    for step, (a, b) in enumerate(zip(ref["losses"], results[0]["losses"], strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs single-process {a}"
    held = set()
    for r in results:
        assert_same_grad_norms(ref["norms"], r["norms"])
        assert_same_gradients({k: ref["grads"][k] for k in r["grads"]}, r["grads"])
        for name, w in r["state"].items():
            torch.testing.assert_close(w, ref["state"][name], rtol=1e-5, atol=1e-6, msg=name)
        held |= set(r["state"])
    assert held == set(ref["state"])


CASES = [
    (2, ["parallel.ep=2"]),
    (4, ["parallel.ep=4"]),
    (4, ["parallel.ep=2"]),  # the experts held twice: each pair of ep ranks is one ep group
    (2, ["parallel.ep=2", "train.micro_batch=4"]),  # two micro-batches per rank
    (4, ["parallel.ep=2", "parallel.zero_stage=1"]),
    (4, ["parallel.ep=2", "parallel.zero_stage=2", "train.micro_batch=2"]),
    (4, ["parallel.ep=2", "parallel.zero_stage=3"]),
    (4, ["parallel.ep=4", "parallel.zero_stage=3"]),
    # Two micro-batches: both ZeRO-3s (dense and experts) hold the next one's opening units
    (4, ["parallel.ep=2", "parallel.zero_stage=3", "train.micro_batch=2"]),
    # Selective recompute: the expert units' gathers stay outside the checkpointed block
    (4, ["parallel.ep=2", "parallel.zero_stage=3", "train.activation_checkpointing=selective"]),
    (4, ["parallel.ep=2", "parallel.pp=2", "parallel.pp_microbatches=2",
         "parallel.pp_schedule=zb_h1", "parallel.zero_stage=3",
         "train.activation_checkpointing=selective"]),
    # ...or, not resharding after forward, every unit (pipelined too: experts, pp and ZeRO-3)
    (4, ["parallel.ep=2", "parallel.zero_stage=3", "train.micro_batch=2",
         "parallel.reshard_after_forward=false"]),
    # ...or summing whole gradients over the micro-batches (both ZeRO-3s reduce once a step)
    (4, ["parallel.ep=2", "parallel.zero_stage=3", "train.micro_batch=2",
         "parallel.reduce_once=true"]),
    (4, ["parallel.ep=2", "parallel.pp=2", "parallel.pp_microbatches=2",
         "parallel.zero_stage=3", "parallel.reshard_after_forward=false"]),
    (4, ["parallel.ep=2", "parallel.zero_stage=2", "parallel.dp_replicate=2"]),  # HSDP
    (4, ["parallel.ep=2", "parallel.tp=2"]),
    (4, ["parallel.ep=2", "parallel.pp=2", "parallel.pp_microbatches=2"]),
    # The zero-bubble schedule defers the expert matmuls' weight gradients too; ZeRO-3 frees
    # the units its input pass leaves.
    (4, ["parallel.ep=2", "parallel.pp=2", "parallel.pp_microbatches=2",
         "parallel.pp_schedule=zb_h1", "parallel.zero_stage=3"]),
    (4, ["parallel.ep=2", "parallel.pp=2", "parallel.pp_microbatches=2",
         "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
         "parallel.zero_stage=2"]),
    # ...with the blocks recomputed: the expert units nested in them run their forward again
    # inside the input pass (it freed them just before their backward)
    (4, ["parallel.ep=2", "parallel.pp=2", "parallel.pp_microbatches=2",
         "parallel.pp_schedule=zb_h1", "parallel.zero_stage=3",
         "train.activation_checkpointing=full"]),
    # Interleaved and zero-bubble: a chunk's next input pass runs before its last weight pass
    (4, ["parallel.ep=2", "parallel.pp=2", "parallel.pp_microbatches=4",
         "parallel.pp_schedule=interleaved_zb", "parallel.pp_virtual_stages=2",
         "parallel.zero_stage=3"]),
    # Context parallel: sequences in chunks over cp, routed (aux loss) as whole sequences
    (2, ["parallel.cp=2"]),
    (4, ["parallel.ep=2", "parallel.cp=2"]),  # ep across the cp ranks of a sequence
    (4, ["parallel.ep=4", "parallel.cp=2", "parallel.zero_stage=2"]),
    # Sequence parallel: each tp rank routes its slice of the sequence
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
         "parallel.zero_stage=2"]),
    (8, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2"]),
    # 3-D: dp 2 x tp 2 x pp 2 with ZeRO-1, experts over the 2 data ranks
    (8, ["parallel.ep=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1",
         "parallel.pp_microbatches=2"]),
]


@pytest.mark.parametrize("world,overrides", CASES, ids=[" ".join(o) for _, o in CASES])
def test_parity(tmp_path, tmp_path_factory, token_cache, world, overrides):
    ref = _reference(tmp_path_factory, token_cache)
    results = run_ranks(_job, world, tmp_path, token_cache, overrides)
    _assert_parity(ref, results)


def test_all_to_all_bytes_match_the_formula(tmp_path, token_cache):
    """Dropless, each MoE layer moves every assignment (tokens x top_k rows of dim fp32 values)
    to its expert and back, forward and again backward: over the ep group 4 x A x dim x 4
    bytes per layer and step, A the group's assignments; the split sizes travel apart."""
    results = run_ranks(_job, 2, tmp_path, token_cache, ["parallel.ep=2"])
    tokens_per_rank = 16 // 2 * 64  # global batch 16 over 2 data ranks, 64 tokens each
    assignments = 2 * tokens_per_rank * 2  # both ranks, top 2
    layers, dim = 4, 64
    sent = sum(r["bytes"][("ep", "all_to_all")] for r in results)
    assert sent == STEPS * layers * 4 * assignments * dim * 4
    # Split sizes: one int64 per (rank, expert) pair each way, forward only.
    splits = sum(r["bytes"][("ep", "all_to_all_splits")] for r in results)
    assert splits == STEPS * layers * 2 * 8 * 8
    assert results[0]["moe"][0]["tokens_dropped"] == 0


@pytest.mark.parametrize("layout", [
    ["parallel.ep=4"], ["parallel.ep=2", "parallel.cp=2"],
    ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]],
    ids=["ep4", "ep2-cp2", "ep2-tp2-sp"])
def test_capacity_drops_the_same_tokens(tmp_path, tmp_path_factory, token_cache, layout):
    """With a capacity factor the ep run drops exactly the single-process run's assignments
    (the same count every step, the same expert loads) and keeps parity; under context
    parallel too, where a sequence's earlier chunks on other ranks come first."""
    cap = ("model.capacity_factor=1.0",)
    ref = _reference(tmp_path_factory, token_cache, cap)
    results = run_ranks(_job, 4, tmp_path, token_cache, [*layout, *cap])
    assert all(m["tokens_dropped"] > 0 for m in ref["moe"])
    for r in results:
        for got, want in zip(r["moe"], ref["moe"], strict=True):
            assert got["tokens_dropped"] == want["tokens_dropped"]
            assert got["expert_load"] == want["expert_load"]
            assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-6)
    _assert_parity(ref, results)


def _steps_job(run_dir, cache, overrides, steps, resume):
    cfg = tiny_config(run_dir, cache, f"train.steps={steps}", "train.eval_every=0",
                      "train.eval_sequences=0", "train.sample_tokens=0", *ROUTING_CONDITIONED,
                      *MOE, *overrides)
    r = train(cfg, resume=resume, keep_model=True)
    return {"losses": r.losses, "state": whole_weights(r.strategy, r.model)}


@pytest.mark.parametrize("first,then", [
    ((2, ["parallel.ep=2"]), (1, [])),
    ((1, []), (4, ["parallel.ep=4", "parallel.zero_stage=3"])),
    ((4, ["parallel.ep=2", "parallel.zero_stage=1"]), (2, ["parallel.ep=2"])),
], ids=["ep2->ep1", "ep1->ep4-zero3", "ep2-zero1->ep2-ddp"])
def test_checkpoint_resumes_at_another_ep(tmp_path, token_cache, first, then):
    """Experts are saved in their global [E, ...] shape: 2 steps at one layout, 2 more resumed
    at another, equal to 4 uninterrupted steps (losses of steps 3-4, final weights)."""
    ref = run_ranks(_steps_job, 1, tmp_path / "ref", token_cache, [], 4, False)[0]
    run = tmp_path / "run"
    run_ranks(_steps_job, first[0], run, token_cache, first[1], 2, False)
    got = run_ranks(_steps_job, then[0], run, token_cache, then[1], 4, True)[0]
    assert len(got["losses"]) == 2
    for a, b in zip(ref["losses"][2:], got["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (got["losses"], ref["losses"])
    for name, w in ref["state"].items():
        torch.testing.assert_close(got["state"][name], w, rtol=1e-5, atol=1e-6, msg=name)


def _lopsided_rank():
    """Every token of both ranks routed to experts 0 and 1, which ep rank 0 holds: rank 1's
    experts get no row, forward or backward."""
    import copy

    from torch import nn

    from meshloom.config import ParallelConfig
    from meshloom.mesh import init_mesh
    from meshloom.models.moe import MoE, MoESettings
    from meshloom.parallel.expert import apply_expert_parallel

    mesh = init_mesh(ParallelConfig(ep=2))
    torch.manual_seed(0)
    holder = nn.Module()
    holder.moe = MoE(8, MoESettings(n_experts=4, top_k=2, hidden=8))
    with torch.no_grad():
        for p in holder.moe.parameters():
            p.normal_(0, 0.3)
        holder.moe.router.weight.zero_()
        holder.moe.router.weight[0, 0], holder.moe.router.weight[1, 0] = 10.0, 9.0
    local = copy.deepcopy(holder.moe)
    torch.manual_seed(1 + mesh.rank)
    x = torch.randn(2, 6, 8)
    x[..., 0] = 1.0
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    apply_expert_parallel(holder, mesh)
    outs = [local(xs[0]), holder.moe(xs[1])]
    for out in outs:
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [o.detach() for o in outs], [t.grad for t in xs], mesh.rank


def test_a_rank_whose_experts_get_no_token_still_joins_every_all_to_all():
    """Forward and backward complete (before the fix, the rank with no rows skipped the
    backward all-to-all of its empty input and the others waited for it forever), with the
    outputs and input gradients of the experts computed locally."""
    for (local, ep), (g_local, g_ep), _ in run_ranks(_lopsided_rank, 2, timeout=60):
        torch.testing.assert_close(ep, local, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g_ep, g_local, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world,overrides,shards", [
    (4, ["parallel.ep=2"], (1, 1)),  # DDP: whole dense parameters, half the experts
    (4, ["parallel.ep=4"], (1, 1)),
    (4, ["parallel.ep=2", "parallel.zero_stage=1"], (4, 2)),  # optimizer over dp / edp_shard
    (4, ["parallel.ep=2", "parallel.zero_stage=3"], (4, 2)),  # everything sharded
])
def test_memory_per_rank_is_the_formula(tmp_path, token_cache, world, overrides, shards):
    """What each rank holds after the last step, from the live tensors (fp32, AdamW's two
    moments): dense parameters as without experts, experts / ep; ZeRO shards the dense part
    over dp_shard and the experts over edp_shard = dp_shard / ep (up to each flat buffer's
    padding to a multiple of the shard count)."""
    from meshloom.models import families

    cfg = families.config_from_preset("mixtral-tiny")
    total = cfg.num_params()
    experts = 3 * cfg.n_experts * cfg.moe_hidden * cfg.dim * cfg.n_layers
    dense = total - experts
    ep = int(next(o for o in overrides if o.startswith("parallel.ep=")).split("=")[1])
    stage = int(next((o.split("=")[1] for o in overrides if "zero_stage" in o), 0))
    dense_shards, expert_shards = shards
    local_dense, local_experts = dense / dense_shards, experts / ep / expert_shards
    whole = 4 * (dense + experts / ep)
    want = {"params": whole if stage < 3 else 4 * (local_dense + local_experts),
            "grads": whole if stage < 2 else 4 * (local_dense + local_experts),
            "optimizer": 8 * (local_dense + local_experts) if stage else 2 * whole}
    results = run_ranks(_job, world, tmp_path, token_cache, overrides)
    slack = 64 * 4 * 8 * (1 + 2 * cfg.n_layers)  # padding of the flat buffers, generously
    for r in results:
        for key, value in want.items():
            got = r["mem"][key]
            assert value <= got <= value + (slack if stage else 0), (key, got, value)
