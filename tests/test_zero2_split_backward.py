"""ZeRO-2 under the zero-bubble schedules, on real Gloo ranks: a bucket's reduce-scatter is
launched by its weight pass once all its gradients exist, while the backward runs, never by an
input-gradient pass.

An input pass gives some parameters their gradients (norm weights, the embedding) and none of the
matrices'. Counted towards a bucket, those gradients let a second input pass complete the bucket
before its weight pass had run: it was sent without its matrices' gradients, which the next
micro-batch's reduce then carried (the sum came out right, the overlap did not). Parity and bytes
are tested in test_pipeline.py; this tests when the launches happen."""

from __future__ import annotations

import pytest
from conftest import tiny_config
from dist_harness import run_ranks

from meshloom.parallel.flat import FlatGroup
from meshloom.parallel.zero import ZeroDataParallel
from meshloom.train import train


def _job(run_dir, cache, overrides):
    # Each launch: (from a gradient hook, not a drain; the pass running; gradients missing)
    launches: list[tuple[bool, str, bool]] = []
    original, pack = ZeroDataParallel._launch_ready, FlatGroup.pack
    state = {}

    def spy(self, lane, force=False):
        state["zero"], state["hook"] = self, not force
        state["kind"] = ("outside" if self._scope is None else
                         "input" if not self._scope else "weight")
        try:
            original(self, lane, force)
        finally:
            state.clear()

    def spy_pack(self, tensors, out):
        if state:  # a bucket being launched
            bucket = next(b for b in state["zero"].buckets if b.group is self)
            # Gradients an input pass gives (norms) may have gone out with an earlier launch;
            # every other one must be here.
            missing = any(t is None and p not in bucket.early
                          for p, t in zip(self.params, tensors, strict=True))
            launches.append((state["hook"], state["kind"], missing))
        return pack(self, tensors, out)

    ZeroDataParallel._launch_ready, FlatGroup.pack = spy, spy_pack
    try:
        train(tiny_config(run_dir, cache, "train.steps=2", "train.eval_every=0",
                          "train.eval_sequences=0", "train.sample_tokens=0", *overrides))
    finally:
        ZeroDataParallel._launch_ready, FlatGroup.pack = original, pack
    return launches


@pytest.mark.parametrize("schedule,v", [("zb_h1", 1), ("interleaved_zb", 2)])
def test_buckets_launch_in_weight_passes(tmp_path, token_cache, schedule, v):
    overrides = ["parallel.pp=2", f"parallel.pp_schedule={schedule}",
                 f"parallel.pp_virtual_stages={v}", "parallel.pp_microbatches=4",
                 "parallel.dp_shard=2", "parallel.zero_stage=2", "parallel.ddp_bucket_mb=0.01"]
    for launches in run_ranks(_job, 4, tmp_path, token_cache, overrides):
        assert launches, "no reduce-scatter launched"
        # No input pass launches a bucket, from its hooks or otherwise.
        assert all(kind != "input" for _, kind, _ in launches), launches
        # A bucket its gradient hooks launch has every weight pass's gradient (a drain may send
        # a bucket whose parameters this micro-batch did not reach, as zeros; hooks never do).
        assert not any(hook and missing for hook, _, missing in launches), launches
        # The overlap: buckets go out from their weight passes' gradient hooks, while the
        # backward still runs, not only from the drain at the micro-batch's end.
        assert sum(hook and kind == "weight" for hook, kind, _ in launches) > len(launches) // 2
