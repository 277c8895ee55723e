"""Pipeline parallel in the training loop: parity with one process for pp 2 and 4 with every
schedule, 2-D with each data-parallel strategy and with tensor parallel, 3-D dp x pp x tp on 8
ranks, tied embeddings, activation counts, time-outs that name the stage, and checkpoints."""

from __future__ import annotations

import json
import os
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
from meshloom.parallel.pipeline_schedule import pipeline_microbatches
from meshloom.plan.formulas import dp_comm_bytes
from meshloom.train import train

STEPS = 4
MODEL = ["model.n_layers=8"]  # pp 4 x 2 virtual stages needs 8 blocks


def _job(run_dir, cache, overrides, resume=False):
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=2",
                      "train.sample_tokens=0", *MODEL, *WELL_CONDITIONED, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, resume=resume, keep_model=True)
    strat = r.strategy
    comm_bytes = dict(r.counter.bytes)  # before the gathers of full_state_dict()
    whole = strat.full_state_dict() if hasattr(strat, "full_state_dict") else \
        {k: v.detach().clone() for k, v in r.model.state_dict().items()}
    # The sharded strategy's flat sizes (elements, padded): what its collectives carry.
    units = getattr(strat, "units", [])
    holders = units or getattr(strat, "buckets", [])  # (DDP's buckets have no flat group)
    flat = {"psi": sum(h.group.padded for h in holders if hasattr(h, "group")),
            "root_psi": sum(u.group.padded for u in units if u.name == ""),
            "forward_only_psi": sum(u.group.padded for u in units
                                    if not u.backward_needs_params),
            "gathered": [u.name for u in units if u.gathered],
            "peak_gathered": getattr(strat, "peak_gathered_bytes", 0),
            "root_bytes": sum(u.nbytes for u in units if u.name == ""),
            "largest_unit": max((u.nbytes for u in units if u.name), default=0),
            "all_units": sum(u.nbytes for u in units)}
    return {"losses": r.losses, "eval": r.eval_losses, "state": whole, "flat": flat,
            "microbatches": pipeline_microbatches(cfg, strat.mesh.dims),
            "start": r.summary["start_step"], "bytes": comm_bytes, **probe}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, token_cache):
    return run_ranks(_job, 1, tmp_path_factory.mktemp("ref"), token_cache, [])[0]


def _merged_state(results, key="state"):
    """Every rank holds its stages' parameters (whole after gathering tp and dp shards)."""
    out = {}
    for r in results:
        for name, w in r[key].items():
            if name in out:
                torch.testing.assert_close(out[name], w, rtol=0, atol=0, msg=name)
            out[name] = w
    return out


def _assert_parity(reference, results):
    got = results[0]
    for step, (a, b) in enumerate(zip(reference["losses"], got["losses"], strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs single-process {a}"
    for step, a in reference["eval"].items():
        assert abs(got["eval"][step] - a) <= 1e-5 * abs(a), f"eval at {step}"
    assert all(r["losses"] == got["losses"] for r in results)  # every rank logs the same loss
    # What the optimizer was handed: AdamW would hide a wrong gradient scale from the losses.
    for r in results:
        assert_same_grad_norms(reference["norms"], r["norms"])
    assert_same_gradients(reference["grads"], _merged_state(results, "grads"))
    merged = _merged_state(results)
    for name, w in reference["state"].items():
        torch.testing.assert_close(merged[name], w, rtol=1e-5, atol=1e-6, msg=name)


def _pp(pp, schedule, v=1, *extra):
    ov = [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}", *extra]
    if v > 1:
        ov.append(f"parallel.pp_virtual_stages={v}")
    return ov


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1),
             ("interleaved_zb", 2)]
CASES = [(pp, _pp(pp, s, v, "parallel.dp_shard=1")) for pp in (2, 4) for s, v in SCHEDULES]
CASES += [
    (4, _pp(2, "1f1b", 1, "parallel.dp_replicate=2", "parallel.dp_shard=1")),
    (4, _pp(2, "interleaved_zb", 2, "parallel.dp_replicate=2", "parallel.dp_shard=1")),
    (4, _pp(2, "interleaved_1f1b", 2, "parallel.dp_shard=2", "parallel.zero_stage=1")),
    (4, _pp(2, "zb_h1", 1, "parallel.dp_shard=2", "parallel.zero_stage=2")),
    (4, _pp(2, "interleaved_1f1b", 2, "parallel.dp_shard=2", "parallel.zero_stage=2")),
    (4, _pp(2, "1f1b", 1, "parallel.dp_shard=2", "parallel.zero_stage=3")),
    (4, _pp(2, "gpipe", 1, "parallel.dp_shard=2", "parallel.zero_stage=3")),
    # The weight pass runs after the input pass has freed the unit's gradient scope.
    (4, _pp(2, "zb_h1", 1, "parallel.dp_shard=2", "parallel.zero_stage=3")),
    # ...and with the blocks recomputed inside the input pass (their forward hooks fire again)
    (4, _pp(2, "zb_h1", 1, "parallel.dp_shard=2", "parallel.zero_stage=3",
            "train.activation_checkpointing=full")),
    # Chunks run out of model order: the root's gather, the last block's prefetch, too.
    (4, _pp(2, "interleaved_1f1b", 2, "parallel.dp_shard=2", "parallel.zero_stage=3")),
    # 3-D: each with the replicas, tensor or context parallel beside the shards
    (8, _pp(2, "zb_h1", 1, "parallel.dp_shard=2", "parallel.dp_replicate=2",
            "parallel.zero_stage=3")),
    (8, _pp(2, "interleaved_1f1b", 2, "parallel.dp_shard=2", "parallel.tp=2",
            "parallel.zero_stage=3")),
    (8, _pp(2, "zb_h1", 1, "parallel.dp_shard=2", "parallel.cp=2", "parallel.zero_stage=3")),
    (8, _pp(2, "interleaved_1f1b", 2, "parallel.dp_shard=2", "parallel.cp=2",
            "parallel.zero_stage=2")),
    # Weight passes of both chunks deferred past other chunks' input passes: each chunk's
    # lane reduces on its own last weight pass.
    (4, _pp(2, "interleaved_zb", 2, "parallel.dp_shard=2", "parallel.zero_stage=2")),
    (4, _pp(2, "interleaved_zb", 2, "parallel.dp_shard=2", "parallel.zero_stage=3",
            "train.activation_checkpointing=full")),
    (8, _pp(2, "interleaved_zb", 2, "parallel.dp_shard=2", "parallel.tp=2",
            "parallel.zero_stage=3")),
    # Every unit held gathered from the step's first forward to its last backward.
    (4, _pp(2, "interleaved_1f1b", 2, "parallel.dp_shard=2", "parallel.zero_stage=3",
            "parallel.reshard_after_forward=false")),
    # Whole gradients summed over the micro-batches, reduced by each chunk's last backward
    # (its last weight pass under the zero-bubble schedules).
    (4, _pp(2, "1f1b", 1, "parallel.dp_shard=2", "parallel.zero_stage=3",
            "parallel.reduce_once=true")),
    (4, _pp(2, "zb_h1", 1, "parallel.dp_shard=2", "parallel.zero_stage=3",
            "parallel.reduce_once=true")),
    (4, _pp(2, "interleaved_1f1b", 2, "parallel.dp_shard=2", "parallel.zero_stage=3",
            "parallel.reduce_once=true")),
    (4, _pp(2, "interleaved_zb", 2, "parallel.dp_shard=2", "parallel.zero_stage=3",
            "parallel.reduce_once=true")),
]


@pytest.mark.parametrize("world,overrides", CASES, ids=[" ".join(o) for _, o in CASES])
def test_pp_parity(tmp_path, token_cache, reference, world, overrides):
    results = run_ranks(_job, world, tmp_path, token_cache, overrides)
    _assert_parity(reference, results)
    stage = next((int(o.split("=")[1]) for o in overrides if "zero_stage" in o), 0)
    if stage >= 2:  # (ZeRO-3's evaluation forwards gather too: its gathers are checked below)
        _assert_sharded_comm(results, stage, 2, ops=("reduce_scatter", "all_reduce") + (
            ("all_gather",) if stage == 2 else ()),
            reshard="parallel.reshard_after_forward=false" not in overrides,
            n_replicate=2 if "parallel.dp_replicate=2" in overrides else 1,
            reduce_once="parallel.reduce_once=true" in overrides)


def _assert_sharded_comm(results, stage: int, n_shard: int, ops: tuple[str, ...],
                         reshard: bool = True, n_replicate: int = 1,
                         reduce_once: bool = False) -> None:
    """Every rank's data-parallel payload per step is the formula's for its stages' flat size:
    ZeRO-2/3 reduce-scatter each gradient once a micro-batch, whatever the schedule (a chunk's
    backward reduces its own chunk's buckets or units: interleaved 1F1B and the zero-bubble
    input pass used to reduce zeros for the others too). ZeRO-3 gathers each block for every
    micro-batch's forward and backward, the embedding for its forward only; without resharding
    after forward, every unit once a step. `reduce_once`: ZeRO-3 reduce-scatters once a step."""
    for r in results:
        f, m = r["flat"], r["microbatches"]
        per_step = dp_comm_bytes(f["psi"], stage, micro_batches=m, n_shard=n_shard,
                                 n_replicate=n_replicate, root_psi=f["root_psi"],
                                 forward_only_psi=f["forward_only_psi"],
                                 reshard_after_forward=reshard, reduce_once=reduce_once)
        # (over the data-parallel axes: tp's and cp's collectives are not the formula's)
        got = {k: v for k, v in r["bytes"].items()
               if k[1] in ops and k[0] in ("dp_shard", "dp_replicate")}
        assert got == {k: STEPS * v for k, v in per_step.items() if k[1] in ops}, (m, f)


@pytest.mark.parametrize("schedule,v,reshard", [("1f1b", 1, True), ("gpipe", 1, True),
                                                ("interleaved_1f1b", 2, True),
                                                ("zb_h1", 1, True), ("1f1b", 1, False),
                                                ("zb_h1", 1, False),
                                                ("interleaved_zb", 2, True)])
def test_pp_zero3_comm_volume(tmp_path, token_cache, schedule, v, reshard):
    ov = _pp(2, schedule, v, "parallel.dp_shard=2", "parallel.zero_stage=3",
             "train.eval_sequences=0", f"parallel.reshard_after_forward={str(reshard).lower()}")
    results = run_ranks(_job, 4, tmp_path, token_cache, ov)
    _assert_sharded_comm(results, 3, 2, ops=("reduce_scatter", "all_reduce", "all_gather"),
                         reshard=reshard)
    # No unit outlives its step gathered: the optimizer changes the shards under it.
    assert all(not r["flat"]["gathered"] for r in results)
    # At most the root and a unit with its prefetch gathered at once, whatever the schedule
    # (the zero-bubble input pass used to hold its whole chunk until the weight pass); every
    # unit when held for the step.
    for f in (r["flat"] for r in results):
        if reshard:
            assert 0 < f["peak_gathered"] <= f["root_bytes"] + 2 * f["largest_unit"], f
        else:
            assert f["peak_gathered"] == f["all_units"], f


TP_CASES = [
    (4, _pp(2, "1f1b", 1, "parallel.tp=2", "parallel.dp_shard=1")),
    (4, _pp(2, "zb_h1", 1, "parallel.tp=2", "parallel.dp_shard=1",
            "parallel.sequence_parallel=true")),
    (8, _pp(2, "1f1b", 1, "parallel.tp=2", "parallel.dp_shard=2")),  # 3-D: dp 2 x pp 2 x tp 2
    (4, _pp(2, "interleaved_zb", 2, "parallel.tp=2", "parallel.dp_shard=1",
            "parallel.sequence_parallel=true")),
    (8, _pp(2, "interleaved_1f1b", 2, "parallel.tp=2", "parallel.dp_shard=2",
            "parallel.zero_stage=1")),
]


@pytest.mark.parametrize("world,overrides", TP_CASES, ids=[" ".join(o) for _, o in TP_CASES])
def test_pp_with_tensor_parallel(tmp_path, token_cache, reference, world, overrides):
    _assert_parity(reference, run_ranks(_job, world, tmp_path, token_cache, overrides))


@pytest.mark.parametrize("extra", [["parallel.dp_shard=1"],
                                   ["parallel.dp_shard=2", "parallel.zero_stage=1"]])
def test_pp_tied_embeddings_stay_in_sync(tmp_path, token_cache, extra):
    tied = ["model.tie_embeddings=true"]
    ref = run_ranks(_job, 1, tmp_path / "ref", token_cache, tied)[0]
    world = 2 * (2 if "parallel.dp_shard=2" in extra else 1)
    got = run_ranks(_job, world, tmp_path / "pp", token_cache, [*tied, *_pp(2, "1f1b"), *extra])
    # The table's gradient is the sum of the two stages' parts, added in another order than one
    # process adds them: well conditioned (conftest.WELL_CONDITIONED), the usual bounds hold.
    _assert_parity(ref, got)
    first, last = got[0]["state"], got[world - 1]["state"]
    # The last stage's copy of the table is the first stage's, bit for bit, after 4 steps.
    assert torch.equal(first["tok_embeddings.weight"], last["output.weight"])
    # One all-reduce of the table's fp32 gradient per step between the two ends, as the planner
    # prices it (timing.tied_table_sync: one call a step, V x h x the gradient's bytes).
    table = first["tok_embeddings.weight"]
    for r in (got[0], got[world - 1]):
        assert r["bytes"][("pp_ends", "all_reduce_tied")] == STEPS * table.numel() * 4


def test_pp_activation_counts_and_timeline(tmp_path, token_cache):
    """Counted by the executor: 1F1B's first stage holds at most p micro-batches'
    activations, GPipe's holds all m, interleaved_zb's every rank p micro-batches of its
    layers (interleaved 1F1B's first rank would hold 11 chunks here), each rank as the
    planner's walk of the same lists says; every rank writes the last step's timeline."""
    from meshloom.plan.memory import in_flight

    peaks = {}
    for schedule, v, kinds in (("1f1b", 1, 2), ("gpipe", 1, 2), ("interleaved_zb", 2, 3)):
        run = tmp_path / schedule
        run_ranks(_job, 4, run, token_cache, [*_pp(4, schedule, v), "parallel.dp_shard=1",
                                              "parallel.pp_microbatches=8"])
        files = sorted((run / "pipeline").glob("timeline_rank*.json"))
        data = [json.loads(f.read_text()) for f in files]
        assert len(data) == 4
        peaks[schedule] = [d["peak_alive"] for d in sorted(data, key=lambda d: d["pp_rank"])]
        # F and B (or F, I and W) of 8 micro-batches in each of the rank's v chunks
        assert all(len(d["spans"]) == kinds * 8 * v for d in data)
    assert peaks["1f1b"] == [4, 3, 2, 1]
    assert peaks["gpipe"] == [8, 8, 8, 8]
    assert peaks["interleaved_zb"] == [8, 8, 8, 8]  # chunk activations, v = 2 a micro-batch
    first, last = in_flight("interleaved_zb", 4, 8, 2)  # in units of a rank's whole share
    assert (peaks["interleaved_zb"][0] / 2, peaks["interleaved_zb"][-1] / 2) == (first, last)


# ---------------------------------------------------------------- time-outs


def _mismatch_job(world):
    import torch.distributed as dist

    from meshloom.comm import CommCounter
    from meshloom.config import ParallelConfig
    from meshloom.mesh import Mesh, ParallelDims
    from meshloom.models.llama import build_model, config_from_preset
    from meshloom.parallel import PipelineSpec, parallelize
    from meshloom.parallel.pipeline import PipelineError
    from meshloom.parallel.pipeline_schedule import Action

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = Mesh(ParallelDims(pp=2), rank, "cpu", CommCounter())
    model = build_model(config_from_preset("tiny"), 0)
    par = parallelize(model, mesh, ParallelConfig(pp=2, dp_shard=1),
                      pipeline=PipelineSpec(microbatches=2, seq_len=16, timeout_s=2.0))
    if rank == 1:  # a wrong schedule: stage 1 receives micro-batch 1 twice
        par.pipeline.actions.insert(0, Action("RECV_F", 1, 1))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 257, (2, 16), generator=g),) * 2 for _ in range(2)]
    try:
        par.pipeline.train_step(batches, par.grads, torch.device("cpu"),
                                torch.autocast("cpu", enabled=False))
    except PipelineError as e:  # raised only by the receive's own time-out (PeerTimeout)
        return type(e).__name__, str(e)
    return None, ""


def test_mismatched_send_and_receive_fail_in_bounded_time_naming_the_stage():
    # Bounded by the pipeline's own 2 s receive time-out: a PipelineError is raised only by it,
    # and a rank that hung instead would run into the harness's 60 s (no wall-clock bound here).
    res = run_ranks(_mismatch_job, 2, 2, timeout=60)
    kind1, msg1 = res[1]
    assert kind1 == "PipelineError"
    assert "pipeline stage 1" in msg1 and "activations of micro-batch 1 from stage 0" in msg1
    kind0, msg0 = res[0]  # stage 0 then waits for a gradient that never comes
    assert kind0 == "PipelineError"
    assert "pipeline stage 0" in msg0 and "gradients of micro-batch 1 from stage 1" in msg0


# ---------------------------------------------------------------- checkpoints

RESUME = ["run.checkpoint_every=2", "run.keep_checkpoints=5"]


@pytest.mark.parametrize("overrides,world", [
    (_pp(2, "1f1b", 1, "parallel.dp_replicate=2", "parallel.dp_shard=1"), 4),
    (_pp(2, "interleaved_1f1b", 2, "parallel.tp=2", "parallel.dp_shard=1"), 4),
    (_pp(2, "1f1b", 1, "parallel.dp_shard=2", "parallel.zero_stage=3"), 4),
    (_pp(2, "zb_h1", 1, "parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=1"), 8),
])
def test_pp_resume_is_exact(tmp_path, token_cache, overrides, world):
    full = run_ranks(_job, world, tmp_path / "full", token_cache, [*overrides, *RESUME])
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / f"step_{STEPS:07d}")
    resumed = run_ranks(_job, world, tmp_path / "cut", token_cache, [*overrides, *RESUME], True)
    assert resumed[0]["start"] == 2
    assert resumed[0]["losses"] == full[0]["losses"][2:]  # bit-identical
    assert _merged_state(resumed).keys() == _merged_state(full).keys()
    for name, w in _merged_state(full).items():
        assert torch.equal(_merged_state(resumed)[name], w), name


def test_pp_checkpoint_resumes_in_one_process(tmp_path, token_cache):
    ov = _pp(2, "1f1b", 1, "parallel.dp_shard=1")
    full = run_ranks(_job, 2, tmp_path / "full", token_cache, [*ov, *RESUME])
    shutil.copytree(tmp_path / "full", tmp_path / "one")
    shutil.rmtree(tmp_path / "one" / "checkpoints" / f"step_{STEPS:07d}")
    assert checkpoint.read_meta(checkpoint.latest_checkpoint(tmp_path / "one"))["layout"]["pp"] == 2
    one = run_ranks(_job, 1, tmp_path / "one", token_cache, RESUME, True)[0]
    assert one["start"] == 2
    for a, b in zip(full[0]["losses"][2:], one["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
