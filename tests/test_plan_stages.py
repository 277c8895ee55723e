"""The planner prices pipeline stages as the training code cuts them (plan/stages.py)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, tiny_config
from dist_harness import run_ranks

from meshloom.models.gpt2 import GPT2Config
from meshloom.models.llama import LlamaConfig
from meshloom.plan import PlanError
from meshloom.plan.formulas import FP32
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import rank_model_states
from meshloom.plan.models import from_dims, from_llama_config
from meshloom.plan.search import evaluate
from meshloom.plan.stages import meshloom_layer_costs, rank_layers, stage_layers
from meshloom.validation import model_config

LLAMAS = {
    "dense": LlamaConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=2, vocab_size=32000),
    "window": LlamaConfig(dim=128, n_layers=5, n_heads=4, vocab_size=1000, sliding_window=48),
    "qwen3": LlamaConfig(dim=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=64,
                         qk_norm=True, attention_bias=True, vocab_size=5000),
    "moe": LlamaConfig(dim=64, n_layers=4, n_heads=4, vocab_size=300, n_experts=8, top_k=2,
                       moe_hidden=96, shared_hidden=64, shared_gate=True),
}


@pytest.mark.parametrize("name", LLAMAS)
@pytest.mark.parametrize("seq", [64, 4096])
def test_planner_costs_are_what_meshloom_balances_with(name, seq):
    """The split the planner prices is meshloom's only if it feeds split_layers the very numbers
    the model reports (floats equal, not close: a tie decides a cut)."""
    cfg = LLAMAS[name]
    assert meshloom_layer_costs(from_llama_config(cfg), seq) == cfg.layer_costs(seq)
    gpt = GPT2Config(dim=96, n_layers=5, n_heads=4, vocab_size=50257, max_seq_len=1024)
    shape = from_dims("gpt", 96, 5, 4, 50257, ffn_hidden=gpt.hidden, positions=1024)
    assert meshloom_layer_costs(shape, seq) == gpt.layer_costs(seq)


def test_the_three_splits():
    bloom = from_dims("gpt", 14336, 70, 112, 250880)
    assert stage_layers(bloom, 12, 1, 2048, "even") == (6,) * 10 + (5, 5)
    assert stage_layers(bloom, 12, 1, 2048, "even_ends") == (5,) + (6,) * 10 + (5,)
    # meshloom balances FLOPs: the head (250880 x 14336) outweighs a block, so the last stage
    # gives up blocks to the others.
    balanced = stage_layers(bloom, 12, 1, 2048)
    assert sum(balanced) == 70 and balanced[-1] == 4 and max(balanced) == 6
    llama = from_llama_config(LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                          ffn_hidden=28672, vocab_size=128256))
    stages = stage_layers(llama, 2, 20, 8192)
    assert sorted(stages) == [1] + [2] * 38 + [3] and stages[-1] == 1
    assert rank_layers(stages, 2) == (41, 39)
    assert stage_layers(llama, 2, 20, 8192, "even") == (2,) * 40
    with pytest.raises(PlanError, match="need at least as many layers"):
        stage_layers(llama, 8, 12, 8192)
    with pytest.raises(PlanError, match="pp_split=.* must be one of"):
        parse_fix("pp_split=greedy")
    assert parse_fix("pp_split=even_ends") == {"pp_split": "even_ends"}


def test_the_busiest_rank_runs_the_blocks_it_is_given():
    """Two stages, a head of 1.4 blocks' FLOPs: meshloom gives the last stage 1 block of 4, so
    the busiest rank runs 3 blocks, where an even split's runs 2 and the head. (In time the
    head's one large GEMM is cheaper than its FLOPs say, so here the FLOP-balanced split is the
    slower one, and the plan says so.)"""
    shape = from_dims("llama", 1024, 4, 8, 16000, ffn_hidden=2048)  # head: 1.4 blocks
    assert stage_layers(shape, 2, 1, 1024) == (3, 1)
    lay, cl = Layout(pp=2, dp=1, micro_batch=1), make_cluster("h100", 2)
    runs = {split: evaluate(shape, lay, cl, 1024, 8, impl=Implementation(pp_split=split))
            for split in ("balanced", "even")}
    gemm = {k: c.timing.detail["compute_s"]["gemm"] for k, c in runs.items()}
    assert gemm["balanced"] == pytest.approx(gemm["even"] * 3 / 2, rel=1e-12)
    assert runs["balanced"].timing.step_time_s > runs["even"].timing.step_time_s
    # Memory: the first rank, with 3 blocks and 2 micro-batches of them in flight, is fullest.
    assert runs["balanced"].memory.rank == 0
    assert runs["balanced"].memory.total > runs["even"].memory.total


def _states(run_dir, cache, overrides):
    from meshloom.train import train
    cfg = tiny_config(run_dir, cache, "train.steps=1", "train.eval_every=0",
                      "train.eval_sequences=0", "train.sample_tokens=0", *overrides)
    summary = train(cfg).summary
    return dict(summary["model_state_bytes"]), summary["predicted_memory_per_gpu"]


def test_pipeline_ranks_hold_what_the_planner_says(tmp_path, token_cache):
    """A real 2-rank pipeline whose head outweighs a block: each rank's measured parameter,
    gradient and Adam bytes equal the planner's for the blocks meshloom gave it (3 and 1 of 4),
    and the run's own summary predicts the fuller rank."""
    dims = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=16"]
    got = run_ranks(_states, 2, tmp_path, token_cache,
                    ["parallel.pp=2", "parallel.dp_shard=1", *dims])
    cfg = tiny_config(tmp_path, str(tmp_path), *dims)
    shape = from_llama_config(model_config(cfg, 257))  # the byte tokenizer's vocabulary
    held = rank_layers(stage_layers(shape, 2, 1, cfg.data.seq_len), 2)
    assert held == (3, 1)  # not the even split: the check below tells the two apart
    lay = Layout(pp=2, dp=1)
    for rank, (states, predicted) in enumerate(got):
        want = rank_model_states(shape, lay, rank, FP32, held[rank])
        for key in ("params", "grads", "optimizer"):
            assert states[key] == want[key], (rank, key)
        fuller = max(range(2), key=lambda r: sum(
            rank_model_states(shape, lay, r, FP32, held[r]).values()))
        assert predicted["pipeline_rank"] == fuller


def test_bloom_row_uses_its_scripts_split():
    runs = json.loads((ROOT / "benchmarks" / "published" / "runs.json").read_text())["runs"]
    bloom = next(r for r in runs if r["id"].startswith("bloom-"))
    assert bloom["implementation"] == {"pp_split": "even_ends"}
    rows = json.loads((ROOT / "benchmarks" / "results" / "planner" / "validation.json")
                      .read_text())["rows"]
    row = next(r for r in rows if r["id"] == bloom["id"])
    assert "pp_split=even_ends" in row["fix"]
    assert all("pp_split=even" in r["fix"] for r in rows if r["set"] == "megatron-2021-a100")


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1),
                                         ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                                         ("interleaved_zb", 2), ("interleaved_zb", 3)])
def test_alive_layers_is_the_walk_of_every_action(schedule, v):
    """The memory peak per rank, with its shortcuts (GPipe's peak as m times one micro-batch's,
    the other schedules' walk cut after the warm-up), equals walking every action of the full
    schedule with uneven stages."""
    import random

    from meshloom.parallel.pipeline_schedule import compute_lists
    from meshloom.plan.memory import alive_layers

    rng = random.Random(7)
    for pp in (2, 3, 4, 6):
        for m in sorted({pp, 2 * pp, 5 * pp, 12 * pp}):
            stages = tuple(rng.randint(0, 4) for _ in range(pp * v))
            ranks = tuple(range(pp))
            want = []
            for acts in compute_lists(schedule, pp, m, v, ranks=ranks):
                alive = peak = 0
                for act in acts:
                    alive += {"F": 1, "B": -1, "W": -1}.get(act.kind, 0) * stages[act.stage]
                    peak = max(peak, alive)
                want.append(peak)
            assert alive_layers(schedule, pp, m, v, stages, ranks) == tuple(want), (pp, m)
