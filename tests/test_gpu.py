"""Checks that need a CUDA GPU; skipped without one (CI has none). Run on a GPU machine with
`python -m pytest tests/test_gpu.py` (benchmarks/gpu_check.sh tests does).

The training run goes through the real launcher (torchrun, NCCL bound to the GPU) with bf16,
compiled blocks and loss, and selective checkpointing; its CUDA allocator peak is held against
the planner's prediction for the same run, which the run itself writes to summary.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshloom.config import TrainConfig
from meshloom.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(run_dir: Path, cache: Path, *overrides: str) -> dict:
    cmd = [sys.executable, "-m", "meshloom", "train", str(ROOT / "configs" / "tiny.toml"),
           "--nproc", "1", "--set", f"run.dir={run_dir}", "--set", f"data.cache_dir={cache}",
           "--set", "run.device=cuda", "--set", "model.preset=small", "--set", "data.seq_len=512",
           "--set", "train.global_batch=8", "--set", "train.eval_every=0"]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "memory per GPU: peak allocated" in proc.stdout + proc.stderr
    return json.loads((run_dir / "summary.json").read_text())


def test_gpu_run_memory_against_the_planner(tmp_path):
    s = _train(tmp_path / "run", tmp_path / "cache", "train.steps=4", "train.dtype=bf16",
               "train.compile=true", "train.activation_checkpointing=selective")
    assert s["final_loss"] < s["first_loss"]
    allocated = s["peak_mem_bytes_per_rank"][0]
    reserved = s["peak_mem_reserved_bytes_per_rank"][0]
    predicted = s["predicted_memory_per_gpu"]
    states = predicted["params"] + predicted["grads"] + predicted["optimizer"]
    # The allocator holds at least the model states, at most the planner's peak plus the CUDA
    # context it adds (the cache reserved above the allocated peak is not a limit: docs/plan.md).
    assert states <= allocated <= reserved and allocated <= predicted["total"], \
        (allocated, reserved, predicted)


def test_bf16_tracks_fp32_on_gpu(tmp_path):
    """bf16 autocast with fp32 masters follows the fp32 run (same data, same init)."""
    ref = _train(tmp_path / "fp32", tmp_path / "cache", "train.steps=12")
    bf16 = _train(tmp_path / "bf16", tmp_path / "cache", "train.steps=12", "train.dtype=bf16")
    assert bf16["first_loss"] == pytest.approx(ref["first_loss"], rel=1e-2)
    assert bf16["final_loss"] == pytest.approx(ref["final_loss"], rel=3e-2)


def test_fused_adamw_on_cuda():
    p = torch.nn.Parameter(torch.randn(8, 8, device="cuda"))
    b = torch.nn.Parameter(torch.zeros(8, device="cuda"))
    opt = build_optimizer([p], [b], TrainConfig())
    assert opt.defaults.get("fused") is True


def _requested(device: torch.device, which: str) -> int:
    """Bytes the program asked the CUDA caching allocator for (current or peak). Not
    `memory_allocated`: that counts whole blocks, and a block reused for a smaller request
    keeps up to 1 MiB unsplit, which differs between two runs' allocation histories (on an H100
    and an H200 it made the offloaded run look 3.5 MB, 2.3%, better than it is)."""
    return torch.cuda.memory_stats(device)[f"requested_bytes.all.{which}"]


def _zero2_peak_bytes(device: torch.device, offload: bool, steps: int = 3) -> tuple[int, int]:
    """(peak bytes allocated on the device during `steps` bf16 ZeRO-2 training steps of the small
    Llama, above what was allocated before; its parameter count). One rank, dp_shard 1: the
    layout's tensors and their placement are those of any dp_shard, divided by 1, and no
    collective runs (a group of one is skipped), so no second GPU is needed."""
    import gc

    from meshloom.comm import CommCounter
    from meshloom.config import ParallelConfig
    from meshloom.mesh import Mesh, ParallelDims
    from meshloom.models.llama import build_model, config_from_preset
    from meshloom.parallel import parallelize

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = _requested(device, "current")
    mesh = Mesh(ParallelDims(), 0, device.type, CommCounter())
    model = build_model(config_from_preset("small"), 0, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    par = parallelize(model, mesh, ParallelConfig(dp_shard=1, zero_stage=2, cpu_offload=offload),
                      "bf16")
    decay, no_decay = par.grads.optim_param_groups()
    opt = build_optimizer(decay, no_decay, TrainConfig())
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 257, (4, 512), generator=g).to(device) for _ in range(2))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):  # AdamW's state exists from the first step on: later peaks hold it
        par.loss(par.model(x), y).backward()
        par.grads.finish()
        opt.step()
        par.grads.after_step()
        par.grads.zero_grad()
    peak = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = _requested(device, "peak") - base
    del par, model, opt, decay, no_decay
    gc.collect()  # the strategy's gradient hooks and the model refer to each other
    return peak, n_params


def test_cpu_offload_frees_the_device_memory_the_planner_counts():
    """parallel.cpu_offload moves the fp32 master shard, the fp32 gradient shard and the AdamW
    state of ZeRO-1/2 to the CPU (ShardPrecision.master_device). Both runs hold the same bf16
    working parameters and the same activations, so their CUDA peaks differ by exactly those
    states: in the planner's terms (model_state_bytes, mixed precision) its `optimizer` (fp32
    master + AdamW, 12 bytes per parameter) plus the gradient shard, which the code keeps in
    fp32 (4 bytes, twice the planner's 2-byte `grads`). (On CPU, offload moves nothing: the
    CPU tests check only its numerics.)"""
    import torch.distributed as dist

    from meshloom.plan.formulas import MIXED, model_state_bytes

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device)
    try:
        # A first run creates what stays allocated for the process (cuBLAS workspaces and the
        # like), so that neither measured peak includes it.
        _zero2_peak_bytes(device, offload=False, steps=1)
        on_device, n_params = _zero2_peak_bytes(device, offload=False)
        offloaded, _ = _zero2_peak_bytes(device, offload=True)
    finally:
        dist.destroy_process_group()
    planner = model_state_bytes(n_params, 1, 2, MIXED)
    moved = planner["optimizer"] + 2 * planner["grads"]  # 16 bytes per parameter
    drop = on_device - offloaded
    # Requested bytes, so no allocator slack: at the peak the two runs differ by these states
    # and the fused AdamW's step counters, one 4-byte tensor on the device per parameter (228
    # bytes here; traced on an H200, benchmarks/measured/h200-2026-11-28/offload_probe.json).
    assert abs(drop - moved) <= 0.001 * moved, (drop, moved, on_device, offloaded)
    # What stays on the device: the bf16 working parameters (the planner's `params`) at least.
    assert offloaded >= planner["params"], (offloaded, planner)


# ---------------------------------------------------------------- parallel.rank_devices


def test_rank_devices_place_blocks_on_cuda_and_cpu():
    """One rank over cuda:0 and the CPU (parallel/rank_devices.py): each piece's parameters are
    on the device the plan names, the hidden states cross to the CPU once per forward (and
    their gradient back once per backward), and logits and gradients are those of the same
    model on the GPU alone."""
    from meshloom.comm import CommCounter
    from meshloom.models.llama import build_model, config_from_preset
    from meshloom.parallel.rank_devices import AXIS, RankDevices, plan_blocks

    cfg = config_from_preset("tiny")
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    ref = build_model(cfg, 0, device=gpu)
    model = build_model(cfg, 0, device=gpu)
    counter = CommCounter()
    RankDevices(model, [gpu, cpu], plan_blocks(4, 2, given=[1, 3]), counter)
    assert model.tok_embeddings.weight.device == gpu
    assert [{p.device for p in b.parameters()} for b in model.layers] == \
        [{gpu}, {cpu}, {cpu}, {cpu}]
    assert model.norm.weight.device == cpu and model.output.weight.device == cpu
    tokens = torch.randint(0, 257, (2, 32), device=gpu)
    logits = model(tokens)
    assert logits.device == cpu
    want = ref(tokens)
    torch.testing.assert_close(logits, want.cpu(), rtol=1e-4, atol=1e-4)
    logits.pow(2).mean().backward()
    want.pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-3, atol=1e-6, msg=name)
    assert counter.calls[(AXIS, "activation")] == 1 and counter.calls[(AXIS, "gradient")] == 1


def test_rank_devices_training_matches_one_gpu(tmp_path):
    """`parallel.rank_devices=["cuda:0", "cpu"]` through the launcher: the same per-step losses
    as the run on the GPU alone (fp32; the CPU half sums in another order, hence 1e-4)."""
    # eps 1e-6: AdamW amplifies the two summation orders' noise by at most lr / eps (conftest's
    # WELL_CONDITIONED).
    ref = _train(tmp_path / "one", tmp_path / "cache", "train.steps=4", "train.eps=1e-6")
    split = _train(tmp_path / "split", tmp_path / "cache", "train.steps=4", "train.eps=1e-6",
                   'parallel.rank_devices=["cuda:0", "cpu"]')

    def losses(run: Path) -> list[float]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    a, b = losses(tmp_path / "one"), losses(tmp_path / "split")
    assert len(a) == len(b) == 4
    for step, (x, y) in enumerate(zip(a, b, strict=True), 1):
        assert abs(x - y) <= 1e-4 * abs(x), f"step {step}: {y} vs one GPU {x}"
    assert split["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)


def test_clip_in_the_cuda_kernel_matches_clipping_first():
    """optim.guarded_step on CUDA's fused AdamW (what every GPU run takes) against clip_grads
    then a step, over steps whose norm is above and below the clip, and a skipped step."""
    from meshloom.optim import clip_grads, grad_norm, grad_norm_tensor, guarded_step

    g = torch.Generator(device="cuda").manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(256, 64, device="cuda", generator=g)),
         torch.nn.Parameter(torch.randn(64, device="cuda", generator=g))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a, opt_b = (build_optimizer(ps[:1], ps[1:], TrainConfig()) for ps in (a, b))
    assert opt_a.defaults["fused"]
    for step, scale in enumerate((50.0, 1e-3, 20.0)):
        grads = [scale * torch.randn(p.shape, device="cuda", generator=g) for p in a]
        for p, q, x in zip(a, b, grads, strict=True):
            p.grad, q.grad = x.clone(), x.clone()
        norm, skipped = guarded_step(opt_a, grad_norm_tensor(a), 1.0, True)()
        assert not skipped and norm == pytest.approx(grad_norm(b), rel=1e-6)
        clip_grads(b, 1.0, grad_norm(b))
        opt_b.step()
        for p, q in zip(a, b, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {step}")
    before = [p.detach().clone() for p in a]
    a[0].grad.fill_(float("nan"))
    _, skipped = guarded_step(opt_a, grad_norm_tensor(a), 1.0, True)()
    assert skipped and all(torch.equal(p, q) for p, q in zip(a, before, strict=True))
