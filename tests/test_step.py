"""The step interface of a parallelised model (parallel/step.py), the one thing the training loop
calls for every layout. Its contract, held against the plain definition (the global batch in one
piece, on one process): `forward_backward` returns the global mean loss, the same on every rank
and unscaled, and leaves the step's gradients complete and multiplied by the loss scale;
`eval_loss` returns the mean loss of the evaluation batches, touches no gradient and leaves the
model in training mode. Both implementations are held to it: gradient accumulation (one rank,
data parallel, context parallel) and the pipeline executor (one stage, and two)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_gradients
from dist_harness import run_ranks

from meshloom.models.families import build_model, config_from_preset

SEQ, GLOBAL, MICRO, EVAL = 16, 8, 2, 3  # 4 micro-batches a step on one data-parallel rank
SCALE = 4.0  # the loss scale: gradients carry it, the returned loss does not


def _model():
    return build_model(config_from_preset("tiny"), seed=0)


def _data() -> tuple[torch.Tensor, torch.Tensor, list]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 257, (GLOBAL + EVAL * MICRO, SEQ + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    evals = [(x[i:i + MICRO], y[i:i + MICRO]) for i in range(GLOBAL, len(x), MICRO)]
    return x[:GLOBAL], y[:GLOBAL], evals


def _job(layout: dict, one_stage_pipeline: bool = False) -> dict:
    from meshloom.comm import CommCounter
    from meshloom.config import ParallelConfig
    from meshloom.mesh import Mesh, ParallelDims
    from meshloom.parallel import LocalGrads, PipelineSpec, parallelize, plain_loss
    from meshloom.parallel.pipeline import PipelineRunner, PipelineStep
    from meshloom.parallel.pipeline_stage import PipelineStageModel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pp, cp = layout.get("pp", 1), layout.get("cp", 1)
    dims = ParallelDims(pp=pp, cp=cp, dp_shard=world // (pp * cp))
    mesh = Mesh(dims, rank, "cpu", CommCounter())
    x, y, evals = _data()
    local = GLOBAL // dims.dp  # this data-parallel rank's rows of the global batch
    rows = slice(mesh.coord("dp") * local, (mesh.coord("dp") + 1) * local)
    x, y = x[rows], y[rows]
    batches = [(x[i:i + MICRO], y[i:i + MICRO]) for i in range(0, local, MICRO)]
    model = _model()
    if one_stage_pipeline:  # the executor on a pipeline of one stage: all blocks, no transfers
        stage = PipelineStageModel(model, [0], [(0, len(model.pipeline_cut_points()))])
        runner = PipelineRunner(stage, mesh, schedule="1f1b", microbatches=len(batches),
                                virtual_stages=1, loss=plain_loss, timeout_s=60.0)
        model, step = stage, PipelineStep(runner, LocalGrads(stage, mesh), mesh)
    else:
        spec = PipelineSpec(len(batches), SEQ, timeout_s=60.0)
        par = parallelize(model, mesh, ParallelConfig(dp_shard=dims.dp_shard, **layout),
                          pipeline=spec)
        model, step = par.model, par.step
    model.train()
    loss = step.forward_backward(batches, torch.device("cpu"), loss_scale=SCALE)
    grads = {n: p.grad / SCALE for n, p in model.named_parameters() if p.grad is not None}
    held = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    eval_loss = step.eval_loss(evals, torch.device("cpu"))
    untouched = all(torch.equal(p.grad, held[n]) for n, p in model.named_parameters()
                    if p.grad is not None)
    result = {"loss": loss, "eval": eval_loss, "grads": grads, "training": model.training,
              "eval_touched_no_grad": untouched, "no_batches": step.eval_loss([], "cpu")}
    dist.destroy_process_group()
    return result


@pytest.fixture(scope="module")
def definition() -> dict:
    """The global batch in one piece: its mean loss and gradients; the evaluation batches'
    mean of means."""
    x, y, evals = _data()
    model = _model()
    from meshloom.parallel import plain_loss

    loss = plain_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        ev = sum(plain_loss(model(a), b).item() for a, b in evals) / len(evals)
    return {"loss": loss.item(), "eval": ev,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


CASES = {
    "accumulation": (1, {}, False),
    "pipeline-one-stage": (1, {}, True),
    "accumulation-dp2": (2, {}, False),
    "accumulation-cp2": (2, {"cp": 2}, False),
    "pipeline-pp2": (2, {"pp": 2, "pp_schedule": "1f1b"}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_is_the_global_batch(definition, case):
    world, layout, one_stage = CASES[case]
    results = run_ranks(_job, world, layout, one_stage)
    ref = definition["loss"]
    for r in results:
        assert r["loss"] == results[0]["loss"], "every rank returns the same global loss"
        assert abs(r["loss"] - ref) <= 1e-5 * ref, f"loss {r['loss']} vs the definition {ref}"
        assert abs(r["eval"] - definition["eval"]) <= 1e-5 * definition["eval"]
        assert r["training"] and r["eval_touched_no_grad"] and r["no_batches"] is None
        assert_same_gradients({n: definition["grads"][n] for n in r["grads"]}, r["grads"])
    held = set().union(*(r["grads"] for r in results))
    assert held == set(definition["grads"]), "the ranks together hold every gradient"
