"""Tensor parallel in the training loop: parity with one process (tp 2 and 4, with and without
sequence parallel, and 2-D with sharded or replicated data parallel), exact comm volume per layer,
and checkpoints of tensor-parallel slices."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import (
    WELL_CONDITIONED,
    assert_same_grad_norms,
    assert_same_gradients,
    gradient_probe,
    tiny_config,
)
from dist_harness import run_ranks

from meshloom import checkpoint
from meshloom.train import train

STEPS = 4
# tp 4 needs 4 KV heads; every case (and the reference) uses the same model.
MODEL = ["model.n_kv_heads=4"]


def _job(run_dir, cache, overrides, resume=False):
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=2",
                      "train.sample_tokens=0", *MODEL, *WELL_CONDITIONED, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, resume=resume, keep_model=True)
    comm_bytes, calls = dict(r.counter.bytes), dict(r.counter.calls)  # before the gathers below
    strat = r.strategy
    whole = strat.full_state_dict() if hasattr(strat, "full_state_dict") else \
        {k: v.detach().clone() for k, v in r.model.state_dict().items()}
    return {"losses": r.losses, "eval": r.eval_losses, "state": whole, "bytes": comm_bytes,
            "calls": calls, "start": r.summary["start_step"], **probe}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, token_cache):
    return run_ranks(_job, 1, tmp_path_factory.mktemp("ref"), token_cache, [])[0]


def _assert_parity(reference, results):
    got = results[0]
    for step, (a, b) in enumerate(zip(reference["losses"], got["losses"], strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs single-process {a}"
    for step, a in reference["eval"].items():
        assert abs(got["eval"][step] - a) <= 1e-5 * abs(a), f"eval at {step}"
    # What the optimizer was handed: AdamW would hide a wrong gradient scale from the losses.
    for r in results:
        assert_same_grad_norms(reference["norms"], r["norms"])
        assert_same_gradients(reference["grads"], r["grads"])
    # Every rank gathers the same whole weights as the single process (AdamW at the eps of
    # conftest.WELL_CONDITIONED, so that a near-cancelling gradient's float noise stays small).
    for r in results:
        assert set(r["state"]) == set(reference["state"])
        for name, w in reference["state"].items():
            torch.testing.assert_close(r["state"][name], w, rtol=1e-5, atol=1e-6, msg=name)


CASES = [
    (2, ["parallel.tp=2"]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    # one sequence a micro-batch: SP's collectives take the tensors as they lie (comm._leading)
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch=1"]),
    (4, ["parallel.tp=4"]),
    (4, ["parallel.tp=4", "parallel.sequence_parallel=true", "train.micro_batch=8"]),
    (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=3"]),
    (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=3",
         "parallel.sequence_parallel=true", "train.micro_batch=4"]),
    (4, ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=1"]),
    (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=2", "train.micro_batch=4"]),
]


@pytest.mark.parametrize("world,overrides", CASES, ids=[" ".join(o) for _, o in CASES])
def test_tp_parity(tmp_path, token_cache, reference, world, overrides):
    _assert_parity(reference, run_ranks(_job, world, tmp_path, token_cache, overrides))


def test_tied_embeddings_tp(tmp_path, token_cache):
    tied = ["model.tie_embeddings=true"]
    ref = run_ranks(_job, 1, tmp_path / "ref", token_cache, tied)[0]
    got = run_ranks(_job, 2, tmp_path / "tp", token_cache,
                    [*tied, "parallel.tp=2", "parallel.sequence_parallel=true"])
    _assert_parity(ref, got)


# ---------------------------------------------------------------- one micro-batch, by hand

B, S = 2, 16


def _micro_batch_job(world, n_layers, sp, n_kv_heads=4, recompute="none", compiled=False):
    """One forward + backward of one micro-batch: the loss, whole gradients and comm record
    (the forward's apart), and the graph breaks when the blocks are compiled."""
    import os

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from meshloom.comm import CommCounter
    from meshloom.config import ParallelConfig
    from meshloom.mesh import Mesh, ParallelDims
    from meshloom.models.llama import build_model, config_from_preset
    from meshloom.parallel import parallelize

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = Mesh(ParallelDims(tp=world), rank, "cpu", CommCounter())
    cfg = config_from_preset("tiny", n_layers=n_layers, n_kv_heads=n_kv_heads)
    model = build_model(cfg, 0)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.vocab_size, (B, S), generator=g) for _ in range(2))
    par = parallelize(model, mesh, ParallelConfig(tp=world, dp_shard=1, sequence_parallel=sp),
                      activation_checkpointing=recompute, compile_blocks=compiled,
                      compile_backend="aot_eager")
    logits = par.model(x)
    forward = dict(mesh.counter.calls)
    loss = par.loss(logits, y)
    loss.backward()
    par.grads.finish()
    record = {"bytes": dict(mesh.counter.bytes), "calls": dict(mesh.counter.calls),
              "forward_calls": forward, "graph_breaks": sum(counters["graph_break"].values())}
    named = dict(model.named_parameters())
    grads = {n: p.grad for n, p in named.items()}
    if par.tp is not None:
        grads = par.tp.gather_full(grads, named)
    return {"loss": loss.item(), "grads": grads, **record, "dim": cfg.dim}


@pytest.mark.parametrize("world,sp", [(2, False), (2, True), (4, False)])
def test_tp_gradients_equal_single_process(world, sp):
    ref = run_ranks(_micro_batch_job, 1, 1, 2, False)[0]
    for got in run_ranks(_micro_batch_job, world, world, 2, sp):
        assert abs(got["loss"] - ref["loss"]) <= 1e-6 * ref["loss"]
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5,
                                       atol=1e-5 * float(g.abs().max()), msg=name)


@pytest.mark.parametrize("sp", [False, True])
def test_tp_comm_volume_per_layer_is_exact(sp):
    """Per transformer layer per micro-batch: without SP 2 all-reduces of b*s*h activations
    forward (after wo and w2) and 2 backward (at the attention and MLP inputs); with SP each
    all-reduce becomes an all-gather plus a reduce-scatter, each of the same b*s*h payload (on
    the wire an all-reduce is exactly such a pair). Outside the layers: the embedding's output
    forward and the head's input backward (one more of each kind), the loss's three reductions
    of b*s numbers, and under SP one batched sum of the norm gains' partial gradients. The
    planner's step counts the same calls: the layers' (`collectives`) and the two ends'
    (`embedding_and_head`, timing.end_collectives)."""
    from meshloom.models.llama import config_from_preset
    from meshloom.plan.hardware import make_cluster
    from meshloom.plan.layout import Layout
    from meshloom.plan.models import from_llama_config
    from meshloom.plan.search import evaluate

    act = B * S * 64 * 4  # b*s*h fp32 bytes (tiny: dim 64)
    ops = ["all_gather", "reduce_scatter"] if sp else ["all_reduce"]
    per_op = {}
    for n_layers in (2, 4):
        r = run_ranks(_micro_batch_job, 2, 2, n_layers, sp)[0]
        b, c = r["bytes"], r["calls"]
        for op in ops:
            calls = 4 * n_layers + 2  # (2 forward + 2 backward) per layer, + embedding and head
            assert c[("tp", op)] == calls, (op, c)
            assert b[("tp", op)] == calls * act, (op, b)
            per_op[(n_layers, op)] = b[("tp", op)]
        shape = from_llama_config(config_from_preset("tiny", n_layers=n_layers, n_kv_heads=4))
        planned = evaluate(shape, Layout(tp=2, sp=sp, micro_batch=B), make_cluster("h100", 2),
                           S, B, "fp32").timing.detail["comm_s"]["tp"]["calls"]
        assert planned["embedding_and_head"]["calls"] == 2 * len(ops)
        assert planned["collectives"]["calls"] + planned["embedding_and_head"]["calls"] == \
            sum(c[("tp", op)] for op in ops)
        assert b[("tp", "all_reduce_loss")] == 3 * B * S * 4
        assert c[("tp", "all_reduce_loss")] == 3
        if sp:
            assert c[("tp", "all_reduce_sp_grads")] == 1
            assert b[("tp", "all_reduce_sp_grads")] == (2 * n_layers + 1) * 64 * 4
            assert ("tp", "all_reduce") not in b
        else:
            assert ("tp", "all_gather") not in b and ("tp", "reduce_scatter") not in b
        assert {a for a, _ in b} == {"tp"}
    # Two more layers add 2 x (2 forward + 2 backward) collectives of b*s*h of each kind.
    for op in ops:
        assert per_op[(4, op)] - per_op[(2, op)] == 2 * 4 * act


@pytest.mark.parametrize("sp,recompute", [(False, "none"), (True, "none"), (True, "selective"),
                                          (True, "full")])
def test_compiled_tp_block_is_one_graph(sp, recompute):
    """`train.compile` under tp: each block compiles whole, its collectives traced into the
    graph (the comm counter called through an opaque op), no graph break, the eager loss and
    gradients, and the same comm record: every collective counted once per run. Recompute is
    what the planner charges: selective keeps the collectives' outputs (the compiler never
    reruns a collective), full reruns each block's forward collectives in backward."""
    from meshloom.models.llama import config_from_preset
    from meshloom.plan.implementation import Implementation
    from meshloom.plan.layout import Layout
    from meshloom.plan.models import from_llama_config
    from meshloom.plan.reruns import tp_reruns

    n_layers = 2
    shape = from_llama_config(config_from_preset("tiny", n_layers=n_layers, n_kv_heads=4))
    eager = run_ranks(_micro_batch_job, 2, 2, n_layers, sp)
    got = run_ranks(_micro_batch_job, 2, 2, n_layers, sp, 4, recompute, True, timeout=600)
    for e, g in zip(eager, got, strict=True):
        assert g["graph_breaks"] == 0
        assert abs(g["loss"] - e["loss"]) <= 1e-6 * e["loss"]
        for name, w in e["grads"].items():
            torch.testing.assert_close(g["grads"][name], w, rtol=1e-5,
                                       atol=1e-5 * float(w.abs().max()), msg=name)
        assert g["forward_calls"] == e["forward_calls"]
        # Full reruns each layer's two forward collectives of each kind, b*s*h each: what the
        # planner charges a compiled block (in all-reduces: a gather + scatter pair is one).
        rerun = int(tp_reruns(shape, Layout(tp=2, sp=sp, recompute=recompute),
                              Implementation(compile=True))) * n_layers
        calls, nbytes = dict(e["calls"]), dict(e["bytes"])
        for op in (["all_gather", "reduce_scatter"] if sp else ["all_reduce"]):
            calls[("tp", op)] += rerun
            nbytes[("tp", op)] += rerun * B * S * 64 * 4
        assert (g["calls"], g["bytes"]) == (calls, nbytes)


# ---------------------------------------------------------------- checkpoints

RESUME = ["run.checkpoint_every=2", "run.keep_checkpoints=5"]
LAYOUTS = {
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "fsdp2xtp2": (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=3"]),
    "ddp2xtp2": (4, ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp_resume_is_exact(tmp_path, token_cache, layout):
    world, ov = LAYOUTS[layout]
    full = run_ranks(_job, world, tmp_path / "full", token_cache, [*ov, *RESUME])
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / f"step_{STEPS:07d}")
    resumed = run_ranks(_job, world, tmp_path / "cut", token_cache, [*ov, *RESUME], True)
    assert resumed[0]["start"] == 2
    assert resumed[0]["losses"] == full[0]["losses"][2:]  # bit-identical
    for name, w in full[0]["state"].items():
        assert torch.equal(resumed[0]["state"][name], w), name


def test_tp_checkpoint_holds_global_shapes_and_loads_in_one_process(tmp_path, token_cache):
    """Slices are saved as parts of the global tensors (the padded vocabulary row is not saved),
    so a dp_shard 2 x tp 2 checkpoint resumes in a single process and continues like the
    uninterrupted run."""
    import torch.distributed.checkpoint as dcp

    world, ov = LAYOUTS["fsdp2xtp2"]
    full = run_ranks(_job, world, tmp_path / "full", token_cache, [*ov, *RESUME])
    ckpt = checkpoint.checkpoint_root(tmp_path / "full") / "step_0000002"
    md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert tuple(md["model/tok_embeddings.weight"].size) == (257, 64)
    assert tuple(md["optim/output.weight/exp_avg"].size) == (257, 64)
    assert tuple(md["model/layers.0.attention.wo.weight"].size) == (64, 64)
    assert tuple(md["model/layers.0.ffn_norm.weight"].size) == (64,)
    assert checkpoint.read_meta(ckpt)["layout"]["tp"] == 2

    shutil.copytree(tmp_path / "full", tmp_path / "one")
    shutil.rmtree(tmp_path / "one" / "checkpoints" / f"step_{STEPS:07d}")
    one = run_ranks(_job, 1, tmp_path / "one", token_cache, RESUME, True)[0]
    assert one["start"] == 2
    for step, (a, b) in enumerate(zip(full[0]["losses"][2:], one["losses"], strict=True), 3):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs {a}"
