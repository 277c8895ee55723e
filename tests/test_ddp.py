"""Our DDP: parity with one process, exact comm volume, overlap, accumulation without comm."""

from __future__ import annotations

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

from meshloom.train import train

STEPS = 6


def _job(run_dir, cache, overrides):
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=3",
                      *WELL_CONDITIONED, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, keep_model=True)
    return {"losses": r.losses, "eval": r.eval_losses, "grad_bytes": r.grad_bytes, **probe,
            "state": {k: v.detach().clone() for k, v in r.model.state_dict().items()},
            "bytes": dict(r.counter.bytes), "calls": dict(r.counter.calls),
            "n_params": sum(p.numel() for p in r.model.parameters())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, token_cache):
    return run_ranks(_job, 1, tmp_path_factory.mktemp("ref"), token_cache, [])[0]


def _assert_parity(ref, got, rel=1e-5):
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True), 1):
        assert abs(a - b) <= rel * abs(a), f"step {step}: loss {b} vs single-process {a}"
    for step, a in ref["eval"].items():
        assert abs(got["eval"][step] - a) <= rel * abs(a), f"eval loss at step {step}"
    # What the optimizer was handed: AdamW would hide a wrong gradient scale from the losses.
    assert_same_grad_norms(ref["norms"], got["norms"])
    assert_same_gradients(ref["grads"], got["grads"])
    for name, w in ref["state"].items():
        torch.testing.assert_close(got["state"][name], w, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world,overrides", [
    (2, []),
    (2, ["train.micro_batch=2"]),            # 4 accumulation micro-batches per rank
    (4, []),
    (4, ["train.micro_batch=1", "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
])
def test_ddp_matches_single_process(tmp_path, token_cache, reference, world, overrides):
    results = run_ranks(_job, world, tmp_path, token_cache, overrides)
    _assert_parity(reference, results[0])
    # Every replica ends bit-identical: they applied the same averaged gradients.
    for r in results[1:]:
        for name, w in results[0]["state"].items():
            assert torch.equal(r["state"][name], w), f"replicas diverged at {name}"


def test_ddp_comm_volume_equals_gradient_bytes(tmp_path, token_cache):
    """Per optimizer step, the gradient all-reduce payload is exactly the gradient bytes, also
    with accumulation (no communication on the other micro-batches)."""
    for overrides in ([], ["train.micro_batch=2"]):
        res = run_ranks(_job, 2, tmp_path / str(len(overrides)), token_cache, overrides)[0]
        param_bytes = res["n_params"] * 4  # fp32
        assert res["grad_bytes"] == param_bytes
        assert res["bytes"][("dp", "all_reduce")] == STEPS * param_bytes
        # Parameters are broadcast once at start so replicas begin identical.
        assert res["bytes"][("dp", "broadcast")] == param_bytes


def test_single_process_moves_no_bytes(reference):
    assert ("dp", "all_reduce") not in reference["bytes"]
    assert ("dp", "broadcast") not in reference["bytes"]
