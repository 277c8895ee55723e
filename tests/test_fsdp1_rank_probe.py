"""benchmarks/fsdp1_rank_probe.py, the one-GPU test of the allocator guess on the planner's worst
llm-foundry row (docs/plan-validation.md): the parts that run without a GPU, so the probe is
ready when one is lent, and proof that its step computes a real step's gradients."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, load_benchmark

TINY = (32, 3, 4, 64, 53)  # hidden, layers, heads, ffn, vocab: flat sizes not multiples of dp


def reference_grads(probe, rank, tokens, targets) -> list[torch.Tensor]:
    """Each unit's gradient shard as a plain autograd pass over the same gathered weights
    computes it: the whole model at once, no recompute, summed over the dp copies the
    reduce-scatter would sum."""
    flats = [rank.gather(i).requires_grad_() for i in range(len(rank.units))]
    root = probe.views(flats[-1][:probe.numel(rank.units[-1])], rank.units[-1])
    x = F.embedding(tokens, root["wte"]) + root["wpe"][: tokens.shape[1]]
    for i in range(rank.d.layers):
        x = probe.block_forward(x, probe.views(flats[i], rank.units[i]), rank.d.heads)
    logits = F.linear(F.layer_norm(x, (rank.d.hidden,), root["lnf_w"], root["lnf_b"]),
                      root["wte"])
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    out = []
    for f in flats:
        g = F.pad(f.grad, (0, probe.padded(f.numel(), rank.dp) - f.numel()))
        out.append(g.view(rank.dp, -1).sum(0))
    return out


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_probe_step_gives_a_real_steps_gradients(prefetch):
    """Recompute, per-unit backward and the local reduce-scatter together give each unit the
    gradient shard that autograd over the whole model gives, in fp32; a second micro-batch
    accumulates onto the first."""
    probe = load_benchmark("fsdp1_rank_probe")
    d = probe.Dims(*TINY)
    rank = probe.Rank(d, 12, 3, "full", torch.device("cpu"), torch.float32, seed=4)
    g = torch.Generator().manual_seed(9)
    tokens, targets = (torch.randint(0, d.vocab, (1, 12), generator=g) for _ in range(2))
    want = reference_grads(probe, rank, tokens, targets)
    rank.micro_batch(tokens, targets, prefetch=prefetch)
    assert len(rank.grads) == d.layers + 1
    for got, ref in zip(rank.grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    rank.micro_batch(tokens, targets, prefetch=prefetch)
    for got, ref in zip(rank.grads, want, strict=True):
        torch.testing.assert_close(got, 2 * ref, rtol=1e-5, atol=1e-6)


def test_modes_hold_what_the_runs_rank_holds():
    """`full`: fp32 shards, fp32 gradient shards and two fp32 moments (16 bytes a parameter
    over dp, padded as FSDP1 pads); `light`: the shards alone. An optimizer step moves the
    parameters in `full` and clears the gradients."""
    probe = load_benchmark("fsdp1_rank_probe")
    d, seq, dp = probe.Dims(*TINY), 12, 3
    params = sum(probe.padded(probe.numel(u), dp) for u in
                 [probe.block_params(d)] * d.layers + [probe.root_params(d, seq)])
    assert params // dp * dp == params
    full = probe.Rank(d, seq, dp, "full", torch.device("cpu"), torch.float32)
    light = probe.Rank(d, seq, dp, "light", torch.device("cpu"), torch.float32)
    assert full.held_bytes() == 16 * params // dp
    assert light.held_bytes() == 4 * params // dp and light.grads is None
    # MPT-30B's own count: 12h^2 + 13h a block, as llm-foundry's NumParams column gives it.
    h = 7168
    assert probe.numel(probe.block_params(probe.Dims())) == 12 * h * h + 13 * h
    before = [s.clone() for s in full.shards]
    for gr in full.grads:
        gr.fill_(0.5)
    full.optimizer_step()
    assert all(not torch.equal(a, b) for a, b in zip(before, full.shards, strict=True))
    assert all(not gr.any() for gr in full.grads)


def test_the_command_writes_each_config_from_its_own_process(tmp_path):
    """One length, two modes on the CPU at toy size: a row each with its timings and losses,
    the planner's compute for the same micro-batch beside them."""
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp1_rank_probe.py"),
                           "--device", "cpu", "--dtype", "fp32", "--dims",
                           ",".join(map(str, TINY)), "--dp", "2", "--seqs", "16",
                           "--modes", "full,expandable", "--micro-batches", "2",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    full, expandable = result["rows"]
    assert (full["mode"], expandable["mode"]) == ("full", "expandable")
    for row in (full, expandable):
        assert row["seq"] == 16 and "error" not in row
        assert len(row["micro_batch_s"]) == 2 and all(t > 0 for t in row["micro_batch_s"])
        assert all(0 < loss < 10 for loss in row["losses"]) and row["allocator_after"] is None
    # `expandable` is `full` under other allocator settings: the same state, the same steps
    assert expandable["held_gb"] == full["held_gb"] > 0
    assert expandable["losses"] == full["losses"]
    plan = result["planned"]["16"]
    assert plan["micro_batch_s"] == pytest.approx(sum(plan["compute_s_per_micro_batch"].values()))


@pytest.mark.parametrize("args,says", [
    (["--dims", "32,2,5,64,53"], "error: hidden 32 is not a multiple of heads 5"),
    (["--modes", "full,heavy"], "error: unknown mode(s) ['heavy']: one of full, light, "
                                "expandable"),
    (["--seqs", "4k"], "must be integers, --dims five of them")])
def test_bad_arguments_get_one_line(args, says):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp1_rank_probe.py"),
                           "--device", "cpu", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(says)
