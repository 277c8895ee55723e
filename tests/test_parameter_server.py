"""Parameter-server hybrid (meshloom.ps): parity with one process for 1 and 2 servers (tables
whole or split by rows), the server's one update per step, the real `meshloom train`, config
errors, and a process dying mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT

from meshloom.commands import main as cli_main
from meshloom.ps.config import is_ps_config, load_ps_config
from meshloom.ps.data import ClickData
from meshloom.ps.launch import LaunchError, launch
from meshloom.ps.local import train_local
from meshloom.ps.model import click_loss, make_dense, make_optimizer, make_table
from meshloom.ps.placement import pieces_of_server, place
from meshloom.ps.server import TableOptimizer, TableShard

# Importing torch.distributed.optim scripts its functional optimizers; TorchScript warns.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")

CONFIG = ROOT / "configs" / "hybrid_ps.toml"
STEPS = 8
ADAGRAD = ["train.optimizer=adagrad", "train.lr=0.02", "train.table_lr=0.1"]


def _cfg(*overrides: str):
    return load_ps_config(CONFIG, [f"train.steps={STEPS}", *overrides])


_references: dict[tuple[str, ...], object] = {}


def _reference(overrides: tuple[str, ...]):
    """The single-process run; it depends on the model and train keys only, not on ps.*."""
    key = tuple(o for o in overrides if not o.startswith("ps."))
    if key not in _references:
        _references[key] = train_local(_cfg(*key))
    return _references[key]


def _step_reference(cfg, step: int, tables: list[torch.Tensor], dense_state: dict):
    """The single-process loss and gradients of `step` from the given weights."""
    m = cfg.model
    embs = [make_table(cfg, t, 0, m.rows) for t in range(m.tables)]
    for e, w in zip(embs, tables, strict=True):
        e.weight.data.copy_(w)
    dense = make_dense(cfg)
    dense.load_state_dict(dense_state)
    b = ClickData(cfg).batch(step, cfg.train.global_batch)
    emb = torch.cat([e(b.ids[:, t]) for t, e in enumerate(embs)], dim=1)
    loss = click_loss(dense, emb, b.dense, b.labels)
    loss.backward()
    return (loss.item(), [e.weight.grad.to_dense() for e in embs],
            {k: v.grad for k, v in dense.named_parameters()})


def _close_to_scale(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Gradients from the same weights differ only by summation order: within 1e-5 of the
    gradient's own scale (not elementwise, where a sum that nearly cancels is all rounding)."""
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= 1e-5 * scale + 1e-12, f"{what}: max difference {err:.2e}, scale {scale:.2e}"


def _replay(cfg, steps: list[dict]) -> tuple[list[torch.Tensor], dict]:
    """The optimizer rules applied, in one process, to the gradients the run applied, from the
    initial weights; checks each step's result is exactly where the run's next step started."""
    m = cfg.model
    embs = [make_table(cfg, t, 0, m.rows) for t in range(m.tables)]
    dense = make_dense(cfg)
    table_opt = make_optimizer(cfg.train.optimizer, [e.weight for e in embs], cfg.table_lr)
    dense_opt = make_optimizer(cfg.train.optimizer, dense.parameters(), cfg.train.lr)
    for k, rec in enumerate(steps):
        for t, e in enumerate(embs):
            assert torch.equal(e.weight.detach(), rec["tables_before"][t]), (
                f"step {k + 1}: table {t} did not start where the applied updates lead")
            rows = rec["table_grad_rows"][t]
            # The sparse gradient as the server's optimizer got it: its rows, their values.
            e.weight.grad = torch.sparse_coo_tensor(
                rows[None], rec["table_grads"][t][rows], e.weight.shape,
                check_invariants=False).coalesce()
        for name, w in dense.state_dict().items():
            assert torch.equal(w, rec["dense_before"][name]), (
                f"step {k + 1}: {name} did not start where the applied updates lead")
        for name, w in dense.named_parameters():
            w.grad = rec["dense_grads"][name].clone()
        table_opt.step()
        dense_opt.step()
        table_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
    return ([e.weight.detach() for e in embs],
            {k: v.detach() for k, v in dense.state_dict().items()})


@pytest.mark.parametrize("overrides", [
    (),                                     # 1 server x 2 trainers
    ("ps.servers=2",),                      # tables 0, 2 on ps0; 1, 3 on ps1
    ("ps.servers=2", "ps.sharding=row"),    # every table split by id range
    ("ps.servers=2", "ps.sharding=row", *ADAGRAD),
], ids=["1x2-table-sgd", "2x2-table-sgd", "2x2-row-sgd", "2x2-row-adagrad"])
def test_matches_single_process(tmp_path, overrides):
    """Each step in two well-conditioned halves: the gradient the servers and the MLP applied
    equals the single-process gradient from the same weights, and the weights each step ends
    with are the optimizer's rule applied to that gradient (replayed, bit for bit). Losses are
    compared end to end. Final weights are compared end to end only under SGD: Adagrad's first
    step is lr * g / |g| per element, so an element whose gradient nearly cancels takes a full
    step of either sign depending on summation order (the run and the single-process reference
    then differ visibly in that element while agreeing everywhere that is well conditioned)."""
    cfg = _cfg(*overrides)
    ref = _reference(overrides)
    got = launch(cfg, tmp_path, collect=True)
    assert len(got["losses"]) == len(got["steps"]) == STEPS
    for step, rec in enumerate(got["steps"], 1):
        loss, table_grads, dense_grads = _step_reference(cfg, step, rec["tables_before"],
                                                         rec["dense_before"])
        assert abs(loss - got["losses"][step - 1]) <= 1e-6 * abs(loss), f"step {step}: loss"
        for t, (g, r) in enumerate(zip(rec["table_grads"], table_grads, strict=True)):
            _close_to_scale(g, r, f"step {step}: table {t} gradient")
        for name, r in dense_grads.items():
            _close_to_scale(rec["dense_grads"][name], r, f"step {step}: {name} gradient")
    tables, dense = _replay(cfg, got["steps"])
    for t, (a, b) in enumerate(zip(tables, got["tables"], strict=True)):
        assert torch.equal(a, b), f"table {t}: final weights are not the replayed updates'"
    for name, w in dense.items():
        assert torch.equal(w, got["dense"][name]), f"{name}: not the replayed updates'"
    for step, (a, b) in enumerate(zip(ref.losses, got["losses"], strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: loss {b} vs single-process {a}"
    if cfg.train.optimizer == "sgd":  # linear in the gradient: well conditioned end to end
        for t, (a, b) in enumerate(zip(ref.tables, got["tables"], strict=True)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"table {t}")
        for name, w in ref.dense.items():
            torch.testing.assert_close(got["dense"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert ref.losses[-1] < ref.losses[0]
    # Trainer 0 logged every step (train.log_every = 1) with the global-batch loss.
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == got["losses"]
    assert {"step", "loss", "lr", "step_time_s", "samples_per_s", "comm_bytes"} <= set(records[0])
    # Dense gradients all-reduced once per step (fp32), rows and their gradients over RPC.
    n_dense = sum(w.numel() for w in ref.dense.values())
    assert records[0]["comm_bytes"]["dp"] == 4 * n_dense
    assert records[0]["comm_bytes"]["rpc"] > 0


def _shard_and_grads(cfg, trainers: int):
    """Server 0's shard, and one sparse gradient of table 0 per trainer (overlapping ids)."""
    shard = TableShard(cfg, pieces_of_server(place(cfg), 0))
    table = shard.tables["0"]
    grads = []
    for i in range(trainers):
        ids = torch.tensor([1, 2, 3, 3, 10 + i])
        (table(ids) * (i + 1.5)).pow(2).sum().backward()
        grads.append(table.weight.grad)
        table.weight.grad = None
    return shard, table.weight, grads


def test_server_applies_one_update_from_all_trainers():
    """Adagrad is not linear in the gradient: the server must apply the trainers' mean gradient
    in one step, only once all have arrived, with a result independent of their arrival order."""
    cfg = _cfg(*ADAGRAD)
    results = []
    for order in ([2, 0, 1], [1, 2, 0]):
        shard, weight, grads = _shard_and_grads(cfg, 3)
        before = weight.detach().clone()
        opt = TableOptimizer(shard, "adagrad", 0.1, trainers=3)
        for k, i in enumerate(order):
            opt.contribute(i, {weight: grads[i]})
            if k < 2:
                assert torch.equal(weight, before), "stepped before every trainer contributed"
        assert opt.steps == 1
        with pytest.raises(RuntimeError, match="stepped the tables twice"):
            opt.contribute(order[0], {weight: grads[0]})
            opt.contribute(order[0], {weight: grads[0]})
        results.append(weight.detach().clone())
    assert torch.equal(results[0], results[1])
    # The same as one plain Adagrad step on the mean gradient ...
    shard, weight, grads = _shard_and_grads(cfg, 3)
    plain = torch.optim.Adagrad([weight], lr=0.1)
    weight.grad = ((grads[0] + grads[1] + grads[2]).coalesce()) / 3
    plain.step()
    torch.testing.assert_close(results[0], weight.detach(), rtol=0, atol=1e-7)
    # ... and not what one step per trainer (DistributedOptimizer's default) would give.
    shard, weight, grads = _shard_and_grads(cfg, 3)
    per_trainer = torch.optim.Adagrad([weight], lr=0.1)
    for g in grads:
        weight.grad = g / 3
        per_trainer.step()
    assert (weight.detach() - results[0]).abs().max() > 1e-3


def test_meshloom_train_runs_the_ps_config(tmp_path):
    """The real command: 1 server x 2 trainers, its layout, loss lines, metrics and summary."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "meshloom", "train", str(CONFIG),
                           "--set", "train.steps=6", "--set", f"run.dir={run_dir}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "parameter server: 1 server x 2 trainers" in out
    assert "ps0       tables 0-3" in out and "trainer1  MLP 72-64-32-1" in out
    assert "6/6 loss" in out and f"run directory: {run_dir}" in out
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == {"servers": 1, "trainers": 2, "sharding": "table"}
    assert summary["final_loss"] == records[-1]["loss"]
    assert (run_dir / "config.toml").is_file() and (run_dir / "logs" / "ps0.log").is_file()


@pytest.mark.parametrize("args,message", [
    (["--set", "ps.trainers=3"], "train.global_batch=256 must be a positive multiple of "
                                 "ps.trainers=3"),
    (["--set", "ps.server=2"], "ps.server: unknown key (did you mean 'servers'?)"),
    (["--set", "ps.servers=5"], "ps.servers=5 exceeds model.tables=4 with ps.sharding=table"),
    (["--set", "train.optimizer=adam"], "train.optimizer: unknown optimizer 'adam'"),
    (["--set", "ps.rpc_timeout_s=0"], "ps.rpc_timeout_s=0.0 must be > 0"),
    (["--nproc", "2"], "--nproc: not supported by parameter-server runs"),
])
def test_config_errors_are_one_line_exit_2(capsys, args, message):
    assert cli_main(["train", str(CONFIG), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_ps_config_detection(tmp_path):
    assert is_ps_config(CONFIG)
    assert not is_ps_config(ROOT / "configs" / "tiny.toml")
    assert not is_ps_config(tmp_path / "missing.toml") and not is_ps_config(None)


def _kill_when_running(run_dir, victim: str, box: dict, ended: threading.Event) -> None:
    """Once trainer 0 has logged 3 steps, SIGKILL `victim` (however long that takes on a
    loaded machine; the run has no end of its own before then)."""
    metrics, pids = run_dir / "metrics.jsonl", run_dir / "processes.json"
    while not ended.is_set():
        if pids.exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            box["pids"] = json.loads(pids.read_text())
            os.kill(box["pids"][victim], signal.SIGKILL)
            return
        time.sleep(0.05)


@pytest.mark.parametrize("victim,overrides", [
    ("ps1", ("ps.servers=2", "ps.sharding=row")),
    ("trainer1", ()),
])
def test_a_dead_process_fails_the_run_fast(tmp_path, capfd, victim, overrides):
    """A process killed mid-run: the trainers fail by noticing the dead peer, not by an RPC or
    collective time-out, with one line each naming the dead server, and nothing is left running.
    The time-out is set far beyond the test's own (pytest's 300 s), so a run that only failed
    by timing out would fail this test; no wall-clock bound is needed."""
    cfg = _cfg(*overrides, "train.steps=100000", "ps.rpc_timeout_s=3600")
    box: dict = {}
    ended = threading.Event()
    killer = threading.Thread(target=_kill_when_running, args=(tmp_path, victim, box, ended))
    killer.start()
    try:
        with pytest.raises(LaunchError) as failure:
            launch(cfg, tmp_path)
    finally:
        ended.set()
        killer.join()
    assert f"{victim} was killed by SIGKILL" in str(failure.value)
    err = capfd.readouterr().err
    trainers = [n for n in box["pids"] if n.startswith("trainer") and n != victim]
    for name in trainers:
        line = next(x for x in err.splitlines() if x.startswith(f"meshloom: {name} failed"))
        assert " at step " in line
        if victim.startswith("ps"):
            assert f"parameter server {victim} stopped answering" in line
    for name, pid in box["pids"].items():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
            pytest.fail(f"{name} (pid {pid}) is still running")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie child of this process is gone too; servers and trainers are not our children.
    return False


def test_processes_die_with_the_launcher(tmp_path):
    """SIGKILL of the launcher itself (the `meshloom train` process, which can run no clean-up):
    its fork server ends, and every server and trainer dies with it (PR_SET_PDEATHSIG). The run
    has no end of its own, so a process that survived would keep this test waiting until
    pytest's time-out."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "meshloom", "train", str(CONFIG),
                             "--set", "train.steps=100000", "--set", f"run.dir={run_dir}"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, pids = run_dir / "metrics.jsonl", run_dir / "processes.json"
    try:
        while not (pids.exists() and metrics.exists()
                   and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, f"the run ended by itself (exit {proc.returncode})"
            time.sleep(0.05)
        children = json.loads(pids.read_text())
        assert set(children) == {"ps0", "trainer0", "trainer1"}
    finally:
        proc.kill()
        proc.wait()
    while not all(_gone(pid) for pid in children.values()):
        time.sleep(0.05)
