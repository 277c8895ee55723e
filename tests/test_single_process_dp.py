"""Single-process data parallel (parallel.mode=dp): parity with the one-process run, the exact
bytes it copies, checkpoint/resume, and its config errors."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ROOT,
    WELL_CONDITIONED,
    assert_same_grad_norms,
    assert_same_gradients,
    gradient_probe,
    tiny_config,
)
from dist_harness import run_ranks

from meshloom import checkpoint
from meshloom.comm import CommCounter
from meshloom.commands import main
from meshloom.models.llama import build_model, config_from_preset
from meshloom.parallel.single_process_dp import AXIS, ReplicatedModule
from meshloom.train import train

STEPS = 6
# The replicas compute the same sums as one process, split along the batch: the first step's
# loss is bit-identical, the gradients differ in the last bits (a sum of two or three parts), and
# AdamW carries that into later losses (measured: <= 1e-7 relative) and weights (<= 3e-7 at the
# default eps 1e-8; <= 6e-8 at conftest.WELL_CONDITIONED's 1e-6, which these runs use).
LOSS_RTOL, WEIGHT_ATOL = 1e-6, 1e-6
DP = ["parallel.mode=dp"]


def _job(run_dir, cache, overrides, resume=False):
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=3",
                      *WELL_CONDITIONED, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, resume=resume, keep_model=True)
    module = getattr(r.model, "module", r.model)  # the master of a ReplicatedModule
    return {"losses": r.losses, "eval": r.eval_losses, "start": r.summary["start_step"], **probe,
            "state": {k: v.detach().clone() for k, v in r.model.state_dict().items()},
            "bytes": dict(r.counter.bytes), "calls": dict(r.counter.calls),
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
            "param_tensors": len(list(module.parameters())),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in module.buffers()),
            "vocab": module.cfg.vocab_size, "seq": cfg.data.seq_len}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, token_cache):
    """The one-process run with the same train.* settings (memoised per setting)."""
    runs = {}

    def get(overrides: list[str]) -> dict:
        same = tuple(o for o in overrides if o.startswith("train."))
        if same not in runs:
            runs[same] = run_ranks(_job, 1, tmp_path_factory.mktemp("ref"), token_cache,
                                   list(same))[0]
        return runs[same]

    return get


def _assert_parity(ref, got):
    assert len(got["losses"]) == STEPS
    assert got["losses"][0] == ref["losses"][0]  # same weights, same data: bit-identical
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True), 1):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"step {step}: loss {b} vs single-process {a}"
    for step, a in ref["eval"].items():
        assert abs(got["eval"][step] - a) <= LOSS_RTOL * abs(a), f"eval loss at step {step}"
    # What the optimizer was handed: AdamW would hide a wrong gradient scale from the losses.
    assert_same_grad_norms(ref["norms"], got["norms"])
    assert_same_gradients(ref["grads"], got["grads"])
    assert got["state"].keys() == ref["state"].keys()  # the master's names, no wrapper prefix
    for name, w in ref["state"].items():
        torch.testing.assert_close(got["state"][name], w, rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("overrides", [
    ["parallel.dp_devices=2"],                                # 16 -> 8 + 8
    ["parallel.dp_devices=2", "train.micro_batch=4"],         # 4 accumulation micro-batches
    ["parallel.dp_devices=3", "train.micro_batch=4"],         # uneven: 4 -> 2 + 1 + 1
    ["parallel.dp_devices=['cpu', 'cpu']", "train.activation_checkpointing=full"],
], ids=["2", "2-accum", "3-uneven", "2-list-ac"])
def test_dp_matches_single_process(tmp_path, token_cache, reference, overrides):
    _assert_parity(reference(overrides),
                   run_ranks(_job, 1, tmp_path, token_cache, DP + overrides)[0])


def test_dp_matches_ddp_bit_for_bit(tmp_path, token_cache):
    """2 replicas in one process compute what DDP on 2 ranks does, in the same order: each
    replica's gradient of the mean over all 16 sequences is exactly half its gradient of the
    mean over its 8 (halving is exact), and a + b is b + a. So the weights are bit-identical;
    only the reported loss is averaged differently (one mean vs the mean of two)."""
    ddp = run_ranks(_job, 2, tmp_path / "ddp", token_cache, [])[0]
    dp = run_ranks(_job, 1, tmp_path / "dp", token_cache, DP + ["parallel.dp_devices=2"])[0]
    for name, w in ddp["state"].items():
        assert torch.equal(dp["state"][name], w), name
    for a, b in zip(ddp["losses"], dp["losses"], strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(a)


def _expected_bytes(res: dict, devices: int, micro: int, micro_batches: int) -> dict:
    """What one optimizer step copies, from the sizes alone: every micro-batch broadcasts the
    parameters and buffers to the k-1 other devices, scatters the rows the first device does
    not keep, gathers their logits, sends the logits' gradient back, and copies every other
    replica's gradients back to the first device."""
    k = min(devices, micro)
    moved_rows = micro - -(-micro // k)  # tensor_split gives the first device ceil(micro / k)
    logits = moved_rows * res["seq"] * res["vocab"] * 4  # fp32
    per_micro = {"broadcast_params": (k - 1) * res["param_bytes"],
                 "broadcast_buffers": (k - 1) * res["buffer_bytes"],
                 "scatter_inputs": moved_rows * res["seq"] * 8,  # int64 token ids
                 "gather_outputs": logits, "scatter_output_grads": logits,
                 "reduce_grads": (k - 1) * res["param_bytes"]}
    return {op: n * micro_batches for op, n in per_micro.items()}


@pytest.mark.parametrize("devices,micro", [(2, 16), (2, 4), (3, 4)])
def test_dp_copies_exactly_the_formula(tmp_path, token_cache, devices, micro):
    # No evaluation: its forwards copy too (everything but the two backward ops).
    res = run_ranks(_job, 1, tmp_path, token_cache,
                    DP + [f"parallel.dp_devices={devices}", f"train.micro_batch={micro}",
                          "train.eval_sequences=0"])[0]
    per_step = _expected_bytes(res, devices, micro, 16 // micro)
    got = {op: n for (axis, op), n in res["bytes"].items() if axis == AXIS}
    assert got == {op: STEPS * n for op, n in per_step.items()}
    # One copy per parameter tensor and extra device; nothing on the mesh axes.
    assert res["calls"][(AXIS, "broadcast_params")] == \
        STEPS * (16 // micro) * (devices - 1) * res["param_tensors"]
    assert not [key for key in res["bytes"] if key[0] != AXIS and "scalars" not in key[1]]
    # The metrics show the same per step, under the axis name.
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["comm_bytes"] for r in lines] == [{AXIS: sum(per_step.values())}] * STEPS


def test_dp_resume_is_exact(tmp_path, token_cache):
    overrides = DP + ["parallel.dp_devices=2", "run.checkpoint_every=3",
                      "run.keep_checkpoints=5", "train.micro_batch=4"]
    full = run_ranks(_job, 1, tmp_path / "full", token_cache, overrides)[0]
    assert [c.name for c in checkpoint.complete_checkpoints(tmp_path / "full")] == \
        ["step_0000003", "step_0000006"]
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_0000006")
    resumed = run_ranks(_job, 1, tmp_path / "cut", token_cache, overrides, True)[0]
    assert resumed["start"] == 3
    assert resumed["losses"] == full["losses"][3:]  # bit-identical
    for name, w in full["state"].items():
        assert torch.equal(resumed["state"][name], w), name
    # The checkpoint has the one-process layout's keys: a plain run resumes from it too.
    shutil.rmtree(tmp_path / "full" / "checkpoints" / "step_0000006")
    plain = run_ranks(_job, 1, tmp_path / "full", token_cache,
                      ["run.checkpoint_every=3", "train.micro_batch=4"], True)[0]
    assert plain["start"] == 3
    for a, b in zip(full["losses"][3:], plain["losses"], strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(a)


# ---------------------------------------------------------------- without the training loop


@pytest.mark.parametrize("tied", [False, True])
def test_replicas_are_real_copies_run_in_threads(tied):
    # In a forked child: compute with OpenMP teams in the test process itself would make every
    # later forked rank with more than one thread hang (libgomp does not survive fork).
    run_ranks(_replica_checks, 1, tied)


def _replica_checks(tied: bool) -> None:
    cfg = config_from_preset("tiny", tie_embeddings=tied)
    model = build_model(cfg, 0, torch.device("cpu"))
    plain = build_model(cfg, 0, torch.device("cpu"))
    rep = ReplicatedModule(model, [torch.device("cpu")] * 2, CommCounter())
    shell = rep._shells[0]
    assert all(t is None for t in shell._parameters.values())  # no tensors of its own
    seen = {}

    def probe(module, args, out):
        seen["thread"] = threading.current_thread().name
        seen["ptr"] = module.tok_embeddings.weight.data_ptr()

    shell.register_forward_hook(probe)
    x = torch.randint(0, 257, (5, 17))  # odd batch: 3 + 2 rows
    loss = F.cross_entropy(rep(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    ref = F.cross_entropy(plain(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    assert loss.item() == ref.item()
    assert seen["thread"].startswith("meshloom-dp")  # the second replica ran in a worker
    assert seen["ptr"] != model.tok_embeddings.weight.data_ptr()  # on its own copy
    # A tied head shares the replica's copy, as it shares the master's weight.
    assert (shell.output.weight is shell.tok_embeddings.weight) == tied
    loss.backward()
    ref.backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    rep.release()  # the shells keep no tensors between steps
    assert shell.tok_embeddings.weight is None
    with torch.no_grad():  # a batch of one runs on the master alone, nothing copied
        before = rep._counter.total()
        torch.testing.assert_close(rep(x[:1, :-1]), plain(x[:1, :-1]))
        assert rep._counter.total() == before
    rep.close()


# ---------------------------------------------------------------- config errors

TINY = str(ROOT / "configs" / "tiny.toml")
BAD = [
    (["--nproc", "2", "--set", "parallel.mode=dp"], "2 processes are launched"),
    (["--set", "parallel.mode=dp", "--set", "parallel.tp=2"], "parallel.mode=dp needs "
     "parallel.tp=1 (got 2)"),
    (["--set", "parallel.mode=dp", "--set", "parallel.dp_shard=2"], "parallel.dp_shard=1 or -1"),
    (["--set", "parallel.mode=dp", "--set", "parallel.zero_stage=1"], "parallel.zero_stage=0"),
    (["--set", "parallel.mode=dp", "--set", "train.compile=true"], "train.compile=true"),
    (["--set", "parallel.mode=dp", "--set", "run.device=cpu"], "parallel.dp_devices=0 means "
     "every CUDA device"),
    (["--set", "parallel.mode=dp", "--set", "parallel.dp_devices=-1"], "must be >= 0"),
    (["--set", "parallel.mode=dp", "--set", "parallel.dp_devices=[]"], "lists no device"),
    (["--set", "parallel.mode=dp", "--set", "run.device=cpu", "--set",
      "parallel.dp_devices=['cpu', 'cuda:1']"], "'cuda:1' is not a cpu device"),
    (["--set", "parallel.mode=dp", "--set", "parallel.dp_devices=['cpu', 'gpu7']"],
     "'gpu7' is not a device"),
    (["--set", "parallel.mode=dpp"], "did you mean 'dp'"),
    (["--set", "parallel.dp_devices=2"], "only used with parallel.mode=dp"),
]


@pytest.mark.parametrize("args,fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_dp_config_is_one_line_exit_2(args, fragment, capsys, tmp_path):
    rc = main(["train", TINY, "--set", f"run.dir={tmp_path}", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0, err
    assert err.startswith("meshloom: error: ")
    assert fragment in err, err
