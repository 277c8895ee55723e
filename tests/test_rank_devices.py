"""Several devices within one rank (parallel.rank_devices): the placement plan, the copies at
each device boundary, the layout rules, the drawing, and parity with one process for 1 rank on
2 devices, and DDP and ZeRO-2 on 2 ranks of 2 devices each. On a CPU machine every device is
`cpu`: the copies still happen (and are counted), only their destination is the same memory."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ROOT,
    WELL_CONDITIONED,
    assert_same_grad_norms,
    assert_same_gradients,
    gradient_probe,
    tiny_config,
)
from dist_harness import run_ranks

from meshloom.comm import CommCounter
from meshloom.config import ConfigError, load_config
from meshloom.mesh import ParallelDims
from meshloom.models.llama import Llama, config_from_preset
from meshloom.parallel.rank_devices import (
    AXIS,
    RankDevices,
    check_rank_devices_config,
    plan_blocks,
)
from meshloom.train import train
from meshloom.validation import validate

STEPS = 4
CPU = torch.device("cpu")


# ---------------------------------------------------------------- the plan and the copies


def test_plan_balances_blocks_and_honours_given_counts():
    # Equal blocks, the head as heavy as two blocks: it pulls blocks off the last device.
    assert plan_blocks(6, 2, [1.0] * 6, 2.0).bounds == ((0, 4), (4, 6))
    assert plan_blocks(6, 2, [1.0] * 6, 2.0).output_slot == 1
    # Tied to the embedding, the head sits on the first device: its cost moves with it.
    tied = plan_blocks(6, 2, [1.0] * 6, 2.0, tied=True)
    assert tied.bounds == ((0, 2), (2, 6)) and tied.output_slot == 0
    assert plan_blocks(4, 3, given=[1, 2, 1]).bounds == ((0, 1), (1, 3), (3, 4))
    with pytest.raises(ValueError, match="rank_device_blocks"):
        plan_blocks(4, 2, given=[1, 2])


def _tiny(tie: bool = False) -> Llama:
    torch.manual_seed(0)
    return Llama(config_from_preset("tiny", tie_embeddings=tie))


@pytest.mark.parametrize("tie", [False, True])
def test_blocks_go_where_the_plan_says_and_every_boundary_copies(tie):
    model, ref = _tiny(tie), _tiny(tie)
    counter = CommCounter()
    plan = plan_blocks(4, 3, given=[1, 2, 1], tied=tie)
    placed = RankDevices(model, [CPU, CPU, CPU], plan, counter)
    out_slot = 0 if tie else 2
    assert placed.slots == {"tok_embeddings": 0, "layers.0": 0, "layers.1": 1, "layers.2": 1,
                            "layers.3": 2, "norm": out_slot, "output": out_slot}
    tokens = torch.randint(0, 257, (2, 16))
    logits = model(tokens)
    torch.testing.assert_close(logits, ref(tokens), rtol=0, atol=0)
    # Hidden states cross 0 -> 1 -> 2 (and back to 0 for a tied head): one copy per boundary.
    boundaries = 3 if tie else 2
    hidden = 2 * 16 * 64 * 4
    assert counter.calls[(AXIS, "activation")] == boundaries
    assert counter.bytes[(AXIS, "activation")] == boundaries * hidden
    # The RoPE table: one copy per forward for each device after the first, not one per block.
    assert counter.calls[(AXIS, "context")] == 2
    logits.float().pow(2).mean().backward()
    ref(tokens).float().pow(2).mean().backward()
    assert counter.calls[(AXIS, "gradient")] == boundaries
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_one_device_moves_nothing():
    counter = CommCounter()
    model = _tiny()
    RankDevices(model, [CPU], plan_blocks(4, 1), counter)
    model(torch.randint(0, 257, (1, 8))).sum().backward()
    assert counter.total(AXIS) == 0


# ---------------------------------------------------------------- rules before launch


def _problem(*overrides: str, world: int = 1) -> str:
    cfg = load_config(ROOT / "configs" / "tiny.toml", list(overrides))
    with pytest.raises(ConfigError) as e:
        validate(cfg, world, check_data=False)
    return str(e.value)


@pytest.mark.parametrize("overrides,world,expected", [
    (["parallel.pp=2"], 2, "does not combine with parallel.pp=2"),
    (["parallel.tp=2"], 2, "does not combine with parallel.tp=2"),
    (["parallel.cp=2"], 2, "does not combine with parallel.cp=2"),
    (["parallel.zero_stage=3"], 2, "does not combine with parallel.zero_stage=3"),
    (["parallel.rank_device_blocks=[1, 1]"], 1, "adding up to the model's 4 blocks"),
    (["parallel.rank_device_blocks=[1, 1, 2]"], 1, "must list 2 block counts"),
])
def test_mixes_that_cannot_work_are_refused_by_name(overrides, world, expected):
    assert expected in _problem('parallel.rank_devices=["cpu", "cpu"]', *overrides, world=world)


def test_device_lists_are_checked():
    assert "only used with parallel.rank_devices" in _problem("parallel.rank_device_blocks=[2]")
    assert "must be >= 1" in _problem("parallel.rank_devices=0")
    assert "'gpu:0' is not a device" in _problem('parallel.rank_devices=["cpu", "gpu:0"]')
    assert "only 4 blocks" in _problem("parallel.rank_devices=5")
    assert "parallel.mode=dp" in _problem("parallel.mode=dp", "parallel.dp_devices=2",
                                          "parallel.rank_devices=2")
    # A device used by two ranks of one host (only GPUs are exclusive; the CPU is shared). The
    # rule itself: this machine may have no GPU, which validate() reports first.
    def rule(spec: str, world: int = 2) -> str | None:
        cfg = load_config(None, ["run.device=cuda", f"parallel.rank_devices={spec}"])
        return check_rank_devices_config(cfg, ParallelDims(dp_shard=world),
                                         config_from_preset("tiny"))

    assert rule('[["cuda:0", "cuda:1"], ["cuda:2", "cuda:1"]]') == \
        "parallel.rank_devices: cuda:1 is used by local ranks 0 and 1"
    assert rule('[["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]') is None
    assert rule("2") is None  # local rank r: cuda:2r, cuda:2r+1
    assert "same devices" in rule('["cuda:0", "cuda:1"]')
    assert rule('["cuda:0", "cuda:1"]', world=1) is None
    assert "run's device type cuda" in rule('["cpu", "cuda:0"]', world=1)
    assert rule('["cuda:0", "cpu"]', world=1) is None
    assert "one rank only" in rule('[["cuda:0", "cpu"], ["cuda:1", "cpu"]]')


def test_layout_command_draws_each_ranks_devices(capsys):
    from meshloom.commands import main

    rc = main(["layout", str(ROOT / "configs" / "tiny.toml"), "--nproc", "2", "--set",
               "parallel.rank_devices=2", "--set", "parallel.rank_device_blocks=[1, 3]"])
    out = capsys.readouterr().out
    assert rc == 0
    line = "devices  cpu: embedding, layer 0 | cpu: layers 1-3, norm, head, loss"
    assert out.count(line) == 2, out


# ---------------------------------------------------------------- parity with one process


def _job(run_dir, cache, overrides):
    cfg = tiny_config(run_dir, cache, f"train.steps={STEPS}", "train.eval_every=2",
                      "train.sample_tokens=0", *WELL_CONDITIONED, *overrides)
    with gradient_probe() as probe:
        r = train(cfg, keep_model=True)
    whole = r.strategy.full_state_dict() if hasattr(r.strategy, "full_state_dict") else \
        {k: v.detach().clone() for k, v in r.model.state_dict().items()}
    calls = {op: r.counter.calls[(AXIS, op)] for op in ("activation", "gradient", "context")}
    return {"losses": r.losses, "eval": r.eval_losses, "state": whole, "calls": calls, **probe}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, token_cache):
    return run_ranks(_job, 1, tmp_path_factory.mktemp("ref"), token_cache, [])[0]


CASES = [
    (1, ['parallel.rank_devices=["cpu", "cpu"]']),
    (1, ['parallel.rank_devices=["cpu", "cpu"]', "train.activation_checkpointing=full"]),
    (2, ["parallel.rank_devices=2", "parallel.rank_device_blocks=[3, 1]"]),
    (2, ['parallel.rank_devices=[["cpu", "cpu"], ["cpu", "cpu"]]', "parallel.zero_stage=2",
         "train.micro_batch=4"]),
]


@pytest.mark.parametrize("world,overrides", CASES, ids=[" ".join(o) for _, o in CASES])
def test_parity_with_one_process(tmp_path, token_cache, reference, world, overrides):
    results = run_ranks(_job, world, tmp_path, token_cache, overrides)
    for step, (a, b) in enumerate(zip(reference["losses"], results[0]["losses"], strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {b} vs single-process {a}"
    for step, a in reference["eval"].items():
        assert abs(results[0]["eval"][step] - a) <= 1e-5 * abs(a)
    micro = 2 if any("micro_batch" in o for o in overrides) else 1
    evals = 2 * (32 // 16) * micro  # eval_sequences=32 at steps 2 and 4, per micro-batch
    for r in results:
        assert_same_grad_norms(reference["norms"], r["norms"])
        assert_same_gradients(reference["grads"], r["grads"])
        for name, w in reference["state"].items():
            torch.testing.assert_close(r["state"][name], w, rtol=1e-5, atol=1e-6, msg=name)
        # One boundary: a copy per forward (train and eval micro-batches), one back per backward.
        forwards = STEPS * micro + evals
        assert r["calls"] == {"activation": forwards, "gradient": STEPS * micro,
                              "context": forwards}


def test_place_follows_rank_device_blocks_else_the_costs():
    from meshloom.config import ParallelConfig
    from meshloom.parallel.rank_devices import place

    model = _tiny()
    placed = place(model, [CPU, CPU], ParallelConfig(rank_device_blocks=[3, 1]), seq_len=64)
    assert [placed.slots[f"layers.{i}"] for i in range(4)] == [0, 0, 0, 1]
    # Balanced: four equal blocks and a head that costs something go 2 + 2 (head on the last).
    placed = place(_tiny(), [CPU, CPU], ParallelConfig(), seq_len=64)
    assert [placed.slots[f"layers.{i}"] for i in range(4)] == [0, 0, 1, 1]
    assert placed.slots["output"] == 1


def test_drawing_names_each_local_ranks_gpus():
    from meshloom.parallel.rank_devices import layout_lines

    cfg = load_config(None, ["parallel.rank_devices=2"])
    tied = config_from_preset("tiny", tie_embeddings=True)
    lines = layout_lines(cfg, ParallelDims(dp_shard=4), tied, "cuda", ranks_per_node=2)
    # Rank 3 is local rank 1 of the second host: cuda:2 and cuda:3. Tied: the head on the first.
    assert lines[3] == ("devices  cuda:2: embedding, layers 0-1, norm, head, loss | "
                        "cuda:3: layers 2-3")
    assert lines[0].startswith("devices  cuda:0: ") and "| cuda:1: " in lines[0]
