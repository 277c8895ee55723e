"""Context parallel in the training loop: parity with one process for cp 2 and 4, dp 2 x cp 2
(DDP and ZeRO-1/2/3), tp 2 x cp 2, pp 2 x cp 2 and the 4-D dp x pp x tp x cp layout on 16
ranks (each rank trains on its zigzag slice of every sequence)."""

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

STEPS = 4
MODEL = ["model.n_kv_heads=4"]


def _job(run_dir, cache, overrides):
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=2",
                      "train.sample_tokens=8", *MODEL, *WELL_CONDITIONED, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, keep_model=True)
    strat = r.strategy
    whole = strat.full_state_dict() if hasattr(strat, "full_state_dict") else \
        {k: v.detach().clone() for k, v in r.model.state_dict().items()}
    return {"losses": r.losses, "eval": r.eval_losses, "state": whole,
            "sample": r.summary["sample"], "bytes": dict(r.counter.bytes), **probe}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, token_cache):
    return run_ranks(_job, 1, tmp_path_factory.mktemp("ref"), token_cache, [])[0]


CASES = [
    (2, ["parallel.cp=2", "parallel.dp_shard=1"]),
    (4, ["parallel.cp=4", "parallel.dp_shard=1"]),
    (4, ["parallel.cp=2", "parallel.dp_shard=2"]),
    (4, ["parallel.cp=2", "parallel.tp=2", "parallel.dp_shard=1"]),
    (4, ["parallel.cp=2", "parallel.dp_shard=2", "parallel.zero_stage=1"]),
    (4, ["parallel.cp=2", "parallel.dp_shard=2", "parallel.zero_stage=2"]),
    (4, ["parallel.cp=2", "parallel.dp_shard=2", "parallel.zero_stage=3"]),
    (4, ["parallel.cp=2", "parallel.pp=2", "parallel.dp_shard=1"]),
    # 4-D: dp 2 x pp 2 x tp 2 x cp 2 on 16 ranks.
    (16, ["parallel.cp=2", "parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2",
          "parallel.pp_schedule=zb_h1"]),
]


@pytest.mark.parametrize("world,overrides", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_cp_parity(tmp_path, token_cache, reference, world, overrides):
    results = run_ranks(_job, world, tmp_path, token_cache, overrides)
    got = results[0]
    for step, (a, b) in enumerate(zip(reference["losses"], got["losses"], strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs single-process {a}"
    for step, a in reference["eval"].items():
        assert abs(got["eval"][step] - a) <= 1e-5 * abs(a), f"eval at {step}"
    merged = {}  # pipeline ranks each hold their stages' parameters
    for r in results:
        merged.update(r["state"])
        # What the optimizer was handed: AdamW would hide a wrong gradient scale from the losses.
        assert_same_grad_norms(reference["norms"], r["norms"])
        assert_same_gradients({n: reference["grads"][n] for n in r["grads"]}, r["grads"])
    assert set(reference["grads"]) <= set().union(*(r["grads"] for r in results))
    for name, w in reference["state"].items():
        # Each token's gradient reaches a weight from another rank, summed in another order than
        # one process sums it: well conditioned (conftest.WELL_CONDITIONED), it stays float noise.
        torch.testing.assert_close(merged[name], w, rtol=1e-5, atol=1e-6, msg=name)
    # The K/V exchanges around the ring are counted on the cp axis; sampling ran plain
    # attention on every rank and produced the single process's text.
    assert got["bytes"][("cp", "send")] > 0
    assert got["sample"] == reference["sample"]
