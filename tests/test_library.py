"""meshloom as a library: `import meshloom` exports the documented API without importing torch,
and examples/train_custom_model.py (a user's own decoder, optimizer and loop under FSDP x tp on
4 ranks) trains step for step like its own single-process run, down to the final weights."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from dist_harness import run_ranks

EXAMPLE = ROOT / "examples" / "train_custom_model.py"
# Tiny but real: 2 blocks, 6 AdamW steps, 2 micro-batches per rank under dp_shard=2, and a
# clipping threshold below every step's gradient norm (about 0.8), so the global norm is used.
SIZES = ["--steps", "6", "--dim", "32", "--heads", "4", "--layers", "2", "--vocab", "48",
         "--seq", "16", "--batch", "8", "--micro-batch", "2", "--grad-clip", "0.5",
         "--device", "cpu"]
ONE_PROCESS = ["--dp-shard", "1", "--tp", "1", "--zero-stage", "0"]


def _example():
    spec = importlib.util.spec_from_file_location("train_custom_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_example(argv: list[str]) -> dict[str, list[float]]:
    return _example().main(argv)


def test_public_api_is_lazy_and_complete():
    """Every name in __all__ resolves; importing the package alone does not load torch (the
    command line imports it, and `meshloom --help` must not wait for torch)."""
    code = ("import sys, meshloom; assert 'torch' not in sys.modules, 'torch imported'; "
            "[getattr(meshloom, n) for n in meshloom.__all__]; import meshloom.train; "
            "assert callable(meshloom.parallelize); print(meshloom.__version__)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import meshloom

    assert set(meshloom.__all__) == {"__version__", *meshloom._EXPORTS}
    with pytest.raises(AttributeError):
        meshloom.no_such_name  # noqa: B018


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[dict[str, list[float]], dict]:
    folder = tmp_path_factory.mktemp("single") / "ckpt"
    history = run_ranks(_run_example, 1, [*SIZES, *ONE_PROCESS, "--checkpoint", str(folder)])[0]
    return history, _final_weights(folder)


def _final_weights(folder) -> dict[str, torch.Tensor]:
    from meshloom.checkpoint import complete_checkpoints, read_tensors

    (last,) = complete_checkpoints(folder)
    return read_tensors(last, "model/")


def test_example_fsdp_x_tp_matches_one_process(single, tmp_path):
    ref, ref_weights = single
    folder = tmp_path / "ckpt"
    results = run_ranks(_run_example, 4, [*SIZES, "--checkpoint", str(folder)], timeout=300)
    for rank, history in enumerate(results):
        for key in ("loss", "grad_norm"):
            for step, (a, b) in enumerate(zip(ref[key], history[key], strict=True), 1):
                assert abs(a - b) <= 1e-5 * abs(a), f"rank {rank} step {step} {key}: {b} vs {a}"
    assert ref["loss"][-1] < ref["loss"][0] - 0.1, ref["loss"]  # it really trains
    assert min(ref["grad_norm"]) > 0.5  # so every step clipped
    weights = _final_weights(folder)
    assert set(weights) == set(ref_weights)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_example_resumes_under_another_layout(single, tmp_path):
    """Three steps on one process, saved; three more on 4 ranks (FSDP x tp) from that
    checkpoint: the same losses as six steps on one process."""
    ref, _ = single
    folder = str(tmp_path / "ckpt")
    first = run_ranks(_run_example, 1, [*SIZES, *ONE_PROCESS, "--steps", "3",
                                        "--checkpoint", folder])[0]
    assert first["loss"] == ref["loss"][:3]
    rest = run_ranks(_run_example, 4, [*SIZES, "--checkpoint", folder, "--resume"], timeout=300)
    for rank, history in enumerate(rest):
        assert len(history["loss"]) == 3
        for step, (a, b) in enumerate(zip(ref["loss"][3:], history["loss"], strict=True), 4):
            assert abs(a - b) <= 1e-5 * abs(a), f"rank {rank} step {step}: {b} vs {a}"


def _weights_after_parallelize() -> dict[str, torch.Tensor]:
    """A user's model initialised differently on each rank, under tp=2: what each rank holds."""
    import meshloom as ml

    layout = ml.ParallelConfig(dp_shard=1, tp=2)
    mesh = ml.init_mesh(layout, device="cpu")
    torch.manual_seed(mesh.rank)
    example = _example()
    model = example.Decoder(vocab=48, dim=32, heads=4, layers=1, max_seq=16)
    ml.parallelize(model, mesh, layout)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_parallelize_trains_rank0_weights_of_a_user_model():
    """A model without `init_tensor` may draw its weights any way on any rank: parallelize hands
    every rank its slice of rank 0's (replicated parameters whole, tp-split ones sliced)."""
    torch.manual_seed(0)
    ref = _example().Decoder(vocab=48, dim=32, heads=4, layers=1, max_seq=16)
    ranks = run_ranks(_weights_after_parallelize, 2)
    for rank, held in enumerate(ranks):
        torch.testing.assert_close(held["pos.weight"], ref.pos.weight, rtol=0, atol=0)
        rows = slice(rank * 16, (rank + 1) * 16)  # colwise: this rank's output rows
        torch.testing.assert_close(held["blocks.0.attn.q.weight"],
                                   ref.blocks[0].attn.q.weight[rows], rtol=0, atol=0)


def test_example_under_torchrun(tmp_path):
    """The example as a user runs it: torchrun, 4 ranks (the one real launch here)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", str(EXAMPLE), "--steps", "3",
                           *SIZES[2:]], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split(":")[0] for ln in lines] == ["step 1", "step 2", "step 3"]
