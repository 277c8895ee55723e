"""Generation with a KV cache, tensor parallel and from checkpoints: the cached path gives the
full-recompute tokens, tp 2 gives tp 1's, a checkpoint written under ZeRO-3 loads at tp 1 and
tp 2 into the trained weights, and `meshloom generate` keeps stdout for the text and refuses
bad input in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, tiny_config
from dist_harness import run_ranks

from meshloom import checkpoint, comm
from meshloom.comm import CommCounter
from meshloom.commands import main as cli_main
from meshloom.inference import Request, init_mesh, load_model, make_pick, prepare
from meshloom.inference import run as run_generation
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.generate import generate, generate_cached
from meshloom.models.llama import build_model, config_from_preset
from meshloom.parallel.tensor_plan import TensorParallel
from meshloom.train import train

PROMPT = "def main():\n    "
NEW = 12


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny ops: intra-op threads only add spin-wait stalls on a shared CPU.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_model(seed: int = 0):
    return build_model(config_from_preset("tiny"), seed=seed).eval()  # GQA: 4 heads, 2 KV


# ---------------------------------------------------------------- KV cache, one process


def test_cached_greedy_equals_full_recompute():
    model = tiny_model()
    prompt = torch.randint(0, 257, (3, 7), generator=torch.Generator().manual_seed(1))
    full = generate(model, prompt, 20, temperature=0)
    cached = generate_cached(model, prompt, 20, temperature=0)
    assert torch.equal(cached.tokens, full)
    assert cached.decode_steps == 19 and cached.prefill_s > 0 and cached.decode_s > 0
    # Seeded sampling draws the same tokens as well (same generator stream, same logits up to
    # rounding), and eos stops rows the same way.
    kw = dict(temperature=1.0, top_k=50)
    sampled = generate(model, prompt, 10, generator=torch.Generator().manual_seed(5), **kw)
    again = generate_cached(model, prompt, 10, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(again.tokens, sampled)
    eos = int(full[0, 7])  # row 0 finishes at once
    assert torch.equal(generate_cached(model, prompt, 20, temperature=0, eos_id=eos).tokens,
                       generate(model, prompt, 20, temperature=0, eos_id=eos))


def test_cache_positions_masks_and_limits():
    model = tiny_model()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model.new_cache(16)
        # The prefill is the training forward, bit for bit.
        assert torch.equal(model(tokens[:, :6], cache=cache), model(tokens[:, :6]))
        full = model(tokens)
        # Several tokens after a cached prefix (the masked path), then one at a time.
        torch.testing.assert_close(model(tokens[:, 6:10], cache=cache), full[:, 6:10],
                                   rtol=1e-5, atol=1e-5)
        for i in range(10, 16):
            torch.testing.assert_close(model(tokens[:, i:i + 1], cache=cache)[:, 0], full[:, i],
                                       rtol=1e-5, atol=1e-5)
        assert cache.length == 16
        # Each layer holds [b, kv_heads, max_len, head_dim]: GQA caches 2 heads, not 4.
        assert cache.layers[0].k.shape == (2, 2, 16, 16)
        with pytest.raises(ValueError, match="KV cache full"):
            model(tokens[:, :1], cache=cache)
        with pytest.raises(ValueError, match="max_seq_len"):
            model.new_cache(model.cfg.max_seq_len + 1)
        with pytest.raises(ValueError, match="max_seq_len"):  # nothing is silently cropped
            generate_cached(model, tokens, model.cfg.max_seq_len, temperature=0)


# ---------------------------------------------------------------- tp 2 == tp 1


def _tp_generate(prompt, steps, sample_seed):
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = Mesh(ParallelDims(tp=2), rank, "cpu", CommCounter())
    model = tiny_model()
    tp = TensorParallel(model, model.TP_PLAN, mesh)
    greedy, seen = make_pick(tp, 0.0, None, None), []

    def recording_pick(logits):  # also keeps the whole logits the token was picked from
        seen.append(comm.gather_from_group(logits.contiguous(), mesh, "tp")[..., :tp.vocab_size])
        return greedy(logits)

    out = generate_cached(model, prompt, steps, temperature=0, pick=recording_pick)
    calls = dict(mesh.counter.calls)
    gen = torch.Generator().manual_seed(sample_seed)
    sampled = generate_cached(model, prompt, steps, pick=make_pick(tp, 1.0, 50, gen))
    return {"greedy": out.tokens, "logits": torch.stack(seen), "calls": calls,
            "sampled": sampled.tokens}


def test_tp2_generation_equals_tp1():
    prompt = torch.randint(0, 257, (2, 6), generator=torch.Generator().manual_seed(3))
    steps, layers = 10, 4
    ranks = run_ranks(_tp_generate, 2, prompt, steps, 11)
    model = tiny_model()
    reference = generate(model, prompt, steps, temperature=0)
    with torch.no_grad():  # the full-recompute logits of every step's last position
        ref_logits = torch.stack([model(reference[:, :6 + i])[:, -1] for i in range(steps)])
    sampled = generate_cached(model, prompt, steps, temperature=1.0, top_k=50,
                              generator=torch.Generator().manual_seed(11))
    for r in ranks:
        assert torch.equal(r["greedy"], reference)
        torch.testing.assert_close(r["logits"], ref_logits, rtol=1e-4, atol=1e-5)
        # Same seed on both ranks, same gathered bytes: both draw tp 1's tokens.
        assert torch.equal(r["sampled"], sampled.tokens)
    # Per forward pass (the prefill and steps - 1 decode steps): 2 all-reduces per layer plus
    # the vocabulary-parallel embedding's, and one all-gather of the last position's logits
    # (the recording pick gathers them a second time).
    calls = ranks[0]["calls"]
    assert calls[("tp", "all_reduce")] == steps * (2 * layers + 1)
    assert calls[("tp", "all_gather")] == 2 * steps


# ---------------------------------------------------------------- from a training checkpoint


def _train_job(run_dir, cache):
    cfg = tiny_config(run_dir, cache, "train.steps=2", "train.eval_every=0",
                      "train.sample_tokens=0", "parallel.dp_shard=2", "parallel.zero_stage=3")
    r = train(cfg, keep_model=True)
    return r.strategy.full_state_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, token_cache):
    """A run folder whose checkpoint was written by 2 ranks under ZeRO-3, and its weights."""
    run_dir = tmp_path_factory.mktemp("zero3-run")
    state = run_ranks(_train_job, 2, run_dir, token_cache)[0]
    return run_dir, state


def _generate_job(request):
    return run_generation(Request(**request))


def test_checkpoint_loads_at_tp1_and_tp2(trained):
    run_dir, state = trained
    request = dict(path=str(run_dir), prompt=PROMPT, max_new_tokens=NEW, temperature=0.0)
    one = run_ranks(_generate_job, 1, {**request, "tp": 1})[0]
    two = run_ranks(_generate_job, 2, {**request, "tp": 2})
    assert one["tp"] == 1 and two[0]["tp"] == 2 and one["trained_layout"]["zero_stage"] == 3
    assert one["text"].startswith(PROMPT) and one["new_tokens"] >= 1
    for r in two:
        assert r["new_ids"] == one["new_ids"] and r["text"] == one["text"]
    # The loaded weights are the trained ones: a plain model holding them continues the same.
    model = build_model(config_from_preset("tiny"), seed=1).eval()
    model.load_state_dict(state)
    prompt = torch.tensor([list(PROMPT.encode())])
    expected = generate(model, prompt, NEW, temperature=0, eos_id=256)[0, len(PROMPT):]
    assert one["new_ids"] == [t for t in expected.tolist() if t != 256]
    # Sampling with a seed: reproducible, and the same at tp 2 as at tp 1.
    request.update(temperature=1.0, top_k=20, seed=4)
    a = run_ranks(_generate_job, 1, {**request, "tp": 1})[0]
    b = run_ranks(_generate_job, 2, {**request, "tp": 2})
    assert b[0]["new_ids"] == b[1]["new_ids"] == a["new_ids"]
    expected = generate(model, prompt, NEW, temperature=1.0, top_k=20, eos_id=256,
                        generator=torch.Generator().manual_seed(4))[0, len(PROMPT):]
    assert a["new_ids"] == [t for t in expected.tolist() if t != 256]


# ---------------------------------------------------------------- the command


def test_cli_tp2_subprocess(trained, capsys):
    run_dir, _ = trained
    args = ["generate", "--checkpoint", str(run_dir), "--prompt", PROMPT,
            "--max-new-tokens", str(NEW), "--temperature", "0"]
    assert cli_main(args) == 0  # tp 1, in this process
    local = capsys.readouterr()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "meshloom", *args, "--tp", "2"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == local.out  # only the text, the same as tp 1's
    assert proc.stdout.startswith(PROMPT)
    lines = proc.stderr.splitlines()
    assert any(line.startswith("prefill:") and "tokens/s" in line for line in lines), lines
    assert any(line.startswith("decode:") and "tokens/s" in line for line in lines), lines
    assert any("on tp=2" in line and "zero_stage=3" in line for line in lines), lines
    assert "Traceback" not in proc.stderr
    # No rank outlives the command.
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit()
                 and _cmdline(p).count("meshloom.inference") and str(run_dir) in _cmdline(p)]
    assert not leftovers


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_cli_json(trained, capsys):
    run_dir, _ = trained
    assert cli_main(["generate", "--checkpoint", str(run_dir / "checkpoints"), "--prompt", "x",
                     "--max-new-tokens", "3", "--seed", "1", "--json", "--ignore-eos"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 3 and out["decode_steps"] == 2 and out["tp"] == 1
    assert out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0


def _variant(run_dir: Path, dest: Path, change) -> Path:
    """A copy of the run's checkpoint, changed by `change(folder)`."""
    shutil.copytree(checkpoint.latest_checkpoint(run_dir), dest)
    change(dest)
    return dest


def _set_model(folder: Path, **fields) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta["config"]["model"].update(fields)
    meta["model"].update(fields)  # the model record generate builds from
    (folder / "meta.json").write_text(json.dumps(meta))


def _bad_cases(run_dir: Path, tmp: Path) -> list[tuple[list[str], str]]:
    ckpt = ["--checkpoint", str(run_dir)]
    old = tmp / "old"
    old.mkdir()
    (old / "meta.json").write_text(json.dumps({"format": 2, "config": {}}))
    missing = _variant(run_dir, tmp / "missing-file", lambda d: (d / "__1_0.distcp").unlink())
    cut = _variant(run_dir, tmp / "truncated",
                   lambda d: os.truncate(d / "__0_0.distcp", 100))
    deeper = _variant(run_dir, tmp / "deeper", lambda d: _set_model(d, n_layers=5))
    wider = _variant(run_dir, tmp / "wider", lambda d: _set_model(d, dim=128))
    return [
        (["--checkpoint", str(tmp / "nowhere")], "no such folder"),
        (["--checkpoint", str(tmp)], "no complete checkpoint"),
        (["--checkpoint", str(old)], "format 2"),
        (["--checkpoint", str(missing)], "is damaged: __1_0.distcp is missing"),
        (["--checkpoint", str(cut)], "is damaged: __0_0.distcp has 100 bytes, the manifest says"),
        (["--checkpoint", str(deeper)], "has no model/layers.4."),
        (["--checkpoint", str(wider)], "model/tok_embeddings.weight has shape (257, 64)"),
        ([*ckpt, "--tp", "3"], "model.n_heads=4 must be divisible by --tp=3"),
        ([*ckpt, "--tp", "4"], "model.n_kv_heads=2 must be divisible by --tp=4"),
        ([*ckpt, "--tp", "0"], "--tp=0 must be >= 1"),
        ([*ckpt, "--temperature", "-0.5"], "--temperature=-0.5 must be >= 0"),
        ([*ckpt, "--top-k", "-1"], "--top-k=-1"),
        ([*ckpt, "--max-new-tokens", "0"], "--max-new-tokens=0"),
        ([*ckpt, "--max-new-tokens", "1000"], "max_seq_len=256"),
    ]


def test_cli_bad_input(trained, tmp_path, capsys, monkeypatch):
    run_dir, _ = trained
    for args, message in _bad_cases(run_dir, tmp_path):
        prompt = [] if "--prompt" in args else ["--prompt", "hi"]
        assert cli_main(["generate", *args, *prompt]) == 2, args
        out = capsys.readouterr()
        assert out.out == ""
        assert out.err.startswith("meshloom: error: ") and out.err.count("\n") == 1, out.err
        assert message in out.err, (args, out.err)
    assert cli_main(["generate", "--checkpoint", str(run_dir), "--prompt", ""]) == 2
    assert "--prompt is empty" in capsys.readouterr().err
    # More ranks than cores (here: pretend there is one).
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert cli_main(["generate", "--checkpoint", str(run_dir), "--prompt", "x", "--tp", "2"]) == 2
    assert "--tp=2 is more than the 1 CPU cores" in capsys.readouterr().err
    # What the parent cannot see (here: a file gone after the check) fails the load in one line.
    broken = _variant(run_dir, tmp_path / "gone", lambda d: None)
    prep = prepare(Request(path=str(broken), prompt="x"))
    (broken / "__0_0.distcp").unlink()
    mesh = init_mesh(1, "cpu")
    try:
        with pytest.raises(checkpoint.CheckpointError, match="FileNotFoundError"):
            load_model(prep.checkpoint, prep.model_cfg, mesh, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    with pytest.raises(SystemExit) as e:  # argparse: the prompt is required
        cli_main(["generate", "--checkpoint", str(run_dir)])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("meshloom: error: the following arguments")


def _train_pp_cp(run_dir, cache):
    cfg = tiny_config(run_dir, cache, "train.steps=2", "train.eval_every=0",
                      "train.sample_tokens=0", "parallel.pp=2", "parallel.cp=2",
                      "parallel.dp_shard=1", "parallel.pp_microbatches=2")
    train(cfg)


def test_pipeline_and_context_parallel_checkpoint_generates_the_same(tmp_path, token_cache):
    """A checkpoint written by pp 2 x cp 2 (4 ranks): generation at tp 1 and tp 2 agrees token
    for token, and with a plain model holding the checkpoint's weights."""
    from meshloom import checkpoint
    from meshloom.checkpoint import read_tensors

    run_ranks(_train_pp_cp, 4, tmp_path, token_cache)
    request = dict(path=str(tmp_path), prompt=PROMPT, max_new_tokens=NEW, temperature=0.0)
    one = run_ranks(_generate_job, 1, {**request, "tp": 1})[0]
    two = run_ranks(_generate_job, 2, {**request, "tp": 2})
    assert one["trained_layout"]["pp"] == 2 and one["trained_layout"]["cp"] == 2
    assert two[0]["new_ids"] == two[1]["new_ids"] == one["new_ids"]
    model = build_model(config_from_preset("tiny"), seed=1).eval()
    missing, unexpected = model.load_state_dict(
        read_tensors(checkpoint.latest_checkpoint(tmp_path)), strict=False)
    assert not unexpected and set(missing) <= {"output.weight"}  # a tied head is not saved
    assert not missing or model.output.weight is model.tok_embeddings.weight
    prompt = torch.tensor([list(PROMPT.encode())])
    expected = generate(model, prompt, NEW, temperature=0, eos_id=256)[0, len(PROMPT):]
    assert one["new_ids"] == [t for t in expected.tolist() if t != 256]
