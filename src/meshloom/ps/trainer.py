"""A trainer: its part of every batch, the dense MLP under meshloom's DDP, and remote tables.

One step, on each trainer:
1. lookup: the ids of its samples go to the servers (one RPC per server, only the distinct ids,
   each server getting the ids it holds), the rows come back; all inside a distributed-autograd
   context, so the RPCs are recorded as graph edges.
2. the dense part runs as ordinary local autograd on a detached copy of those rows, so DDP's
   gradient hooks fire and its bucket all-reduces overlap the backward.
3. distributed backward from the rows: `(rows * rows_grad).sum()` has the rows' gradient as its
   gradient, and distributed autograd sends it to the servers, which run the embedding backward.
4. DDP finishes (average), the dense optimizer steps; then DistributedOptimizer.step hands this
   trainer's table gradients to every server, where the last trainer's arrival triggers the
   single table update of this step (server.TableOptimizer).
5. an all-reduce of the loss over the trainers, which also keeps any trainer from looking up the
   next step's rows before every server has applied this step's update.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer

from meshloom import comm
from meshloom.comm import CommCounter
from meshloom.mesh import Mesh, ParallelDims
from meshloom.metrics import ProgressBar
from meshloom.parallel.ddp import DataParallel
from meshloom.ps.config import PSConfig
from meshloom.ps.data import ClickData
from meshloom.ps.model import click_loss, make_dense, make_optimizer
from meshloom.ps.placement import Piece, pieces_of_table, server_name
from meshloom.ps.server import TableStep, local_shard, ping, recorded_steps


class StepFailed(RuntimeError):
    """A training step failed; the cause is chained (`__cause__`)."""

    def __init__(self, step: int):
        super().__init__(f"step {step}")
        self.step = step


class RemoteTables:
    """The trainer's handle on the sharded tables."""

    def __init__(self, cfg: PSConfig, pieces: list[Piece]):
        self.timeout = cfg.ps.rpc_timeout_s
        self.dim, self.rows = cfg.model.dim, cfg.model.rows
        self.names = [server_name(s) for s in range(cfg.ps.servers)]
        self.shards = [rpc.remote(n, local_shard, timeout=self.timeout) for n in self.names]
        self.by_table = [pieces_of_table(pieces, t) for t in range(cfg.model.tables)]
        self.bytes = 0  # RPC payload of lookups so far: ids out, rows back, rows' gradients out

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """(n, tables) ids -> (n, tables * dim) rows, differentiable through distributed autograd.
        Every server is asked, even for no ids, so that every server takes part in the step's
        autograd context (its optimizer step reads the gradients from that context)."""
        requests: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.names]
        plans = []
        for t, pieces in enumerate(self.by_table):
            # Frequent ids repeat within a batch: each distinct id travels once.
            distinct, inverse = torch.unique(ids[:, t], sorted=True, return_inverse=True)
            # Pieces are contiguous id ranges in order, so the sorted ids split into runs.
            bounds = torch.tensor([p.hi for p in pieces[:-1]], dtype=torch.long)
            cuts = torch.searchsorted(distinct, bounds)
            slots = []
            for p, run in zip(pieces, torch.tensor_split(distinct, cuts), strict=True):
                slots.append((p.server, len(requests[p.server])))
                requests[p.server].append((t, run - p.lo))
            plans.append((inverse, slots))
            self.bytes += distinct.numel() * (8 + 2 * 4 * self.dim)
        futures = [shard.rpc_async(timeout=self.timeout).lookup(req)
                   for shard, req in zip(self.shards, requests, strict=True)]
        replies = [f.wait() for f in futures]
        columns = []
        for inverse, slots in plans:
            parts = [replies[s][i] for s, i in slots]
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)
            columns.append(rows[inverse])
        return torch.cat(columns, dim=1)

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [r for shard in self.shards
                for r in shard.rpc_sync(timeout=self.timeout).parameter_rrefs()]

    def fetch(self) -> list[torch.Tensor]:
        """The whole tables, gathered from the servers."""
        full = [torch.empty(self.rows, self.dim) for _ in self.by_table]
        for shard in self.shards:
            for t, lo, w in shard.rpc_sync(timeout=self.timeout).weights():
                full[t][lo:lo + w.shape[0]] = w
        return full


def unreachable_servers(cfg: PSConfig, timeout_s: float = 2.0) -> list[str]:
    """The servers that do not answer a ping within timeout_s (dead, hung or unreachable)."""
    down = []
    for s in range(cfg.ps.servers):
        try:
            rpc.rpc_sync(server_name(s), ping, timeout=timeout_s)
        except Exception:  # noqa: BLE001 - any failure to answer counts
            down.append(server_name(s))
    return down


def _recorded_steps(cfg: PSConfig, tables: RemoteTables,
                    dense_steps: list[tuple[dict, dict]]) -> list[dict[str, Any]]:
    """Per step: the whole tables before it and their applied (mean) gradient as dense tensors,
    from every server's history, and the MLP's weights before it and its averaged gradient."""
    shape = (cfg.model.rows, cfg.model.dim)
    histories = [rpc.rpc_sync(n, recorded_steps, timeout=tables.timeout) for n in tables.names]
    out = []
    for step, (dense_before, dense_grads) in enumerate(dense_steps):
        before = [torch.empty(shape) for _ in range(cfg.model.tables)]
        grads = [torch.zeros(shape) for _ in range(cfg.model.tables)]
        for history in histories:
            for t, lo, w, ids, rows in history[step]:
                before[t][lo:lo + w.shape[0]] = w
                grads[t][lo + ids] = rows
        out.append({"tables_before": before, "table_grads": grads,
                    "table_grad_rows": [torch.cat([ids + lo for h in histories
                                                   for t2, lo, _, ids, _ in h[step] if t2 == t])
                                        for t in range(cfg.model.tables)],
                    "dense_before": dense_before, "dense_grads": dense_grads})
    return out


def run_trainer(cfg: PSConfig, index: int, pieces: list[Piece], group_url: str, run_dir: Path,
                collect: bool = False) -> dict[str, Any]:
    """Train; returns losses and a summary (trainer 0 also writes metrics.jsonl), and with
    `collect` the final tables and MLP weights. RPC must be up."""
    T, main = cfg.ps.trainers, index == 0
    # The trainers' own Gloo group (the servers are not in it): DDP's all-reduces run on it.
    dist.init_process_group("gloo", init_method=group_url, rank=index, world_size=T,
                            timeout=timedelta(seconds=cfg.ps.rpc_timeout_s))
    try:
        return _train(cfg, index, main, pieces, run_dir, collect)
    finally:
        dist.destroy_process_group()


def _train(cfg: PSConfig, index: int, main: bool, pieces: list[Piece], run_dir: Path,
           collect: bool) -> dict[str, Any]:
    T, steps, B = cfg.ps.trainers, cfg.train.steps, cfg.train.global_batch
    mesh = Mesh(ParallelDims(dp_shard=T), index, "cpu", CommCounter())
    dense = make_dense(cfg)
    ddp = DataParallel(dense, mesh, axis="dp")
    dense_opt = make_optimizer(cfg.train.optimizer, ddp.params, cfg.train.lr)
    tables = RemoteTables(cfg, pieces)
    table_opt = DistributedOptimizer(TableStep, tables.parameter_rrefs(), trainer=index)
    data = ClickData(cfg)
    metrics = open(run_dir / "metrics.jsonl", "w") if main else None  # noqa: SIM115
    bar = ProgressBar(steps) if main else None
    losses: list[float] = []
    dense_steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    t_start = time.perf_counter()
    rpc_total = 0.0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        batch = data.batch(step, B).part(index, T)
        dp_before, rpc_before = mesh.counter.total("dp", "all_reduce"), tables.bytes
        try:
            with dist_autograd.context() as ctx:
                rows = tables.lookup(batch.ids)
                x = rows.detach().requires_grad_()
                # Loss normalisation: each trainer's loss is the mean over its B/T samples. DDP
                # averages the dense gradients over the T trainers, and each server averages the
                # T trainers' table gradients (TableOptimizer): both give the gradient of the
                # mean over the global batch, i.e. the single-process step.
                loss = click_loss(dense, x, batch.dense, batch.labels)
                loss.backward()
                dist_autograd.backward(ctx, [(rows * x.grad).sum()])
                ddp.finish()
                if collect and main:  # the weights this step started from, its gradient
                    dense_steps.append(
                        ({k: v.detach().clone() for k, v in dense.state_dict().items()},
                         {k: v.grad.clone() for k, v in dense.named_parameters()}))
                dense_opt.step()
                ddp.zero_grad()
                table_opt.step(ctx)
            # The summed loss doubles as the step's barrier (module docstring, step 5).
            total, rpc_step = comm.all_reduce_scalars(
                [loss.item(), float(tables.bytes - rpc_before)], mesh, "dp")
        except Exception as e:
            raise StepFailed(step) from e
        mean_loss = total / T
        losses.append(mean_loss)
        rpc_total += rpc_step
        dt = time.perf_counter() - t0
        if main and (step % cfg.train.log_every == 0 or step == steps):
            record = {"step": step, "loss": mean_loss, "lr": cfg.train.lr,
                      "table_lr": cfg.table_lr, "step_time_s": dt, "samples_per_s": B / dt,
                      "comm_bytes": {"dp": mesh.counter.total("dp", "all_reduce") - dp_before,
                                     "rpc": int(rpc_step)}}
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if bar is not None:
            bar.update(step, f"loss {mean_loss:.4f} | {B / dt:.0f} samples/s")
    train_time = time.perf_counter() - t_start
    if metrics is not None:
        metrics.close()
    out: dict[str, Any] = {"losses": losses, "train_time_s": train_time,
                           "samples_per_s": B * steps / train_time,
                           "comm_bytes": {"dp": mesh.counter.total("dp", "all_reduce"),
                                          "rpc": int(rpc_total)}}
    if collect and main:
        out["tables"] = tables.fetch()
        out["dense"] = {k: v.detach().clone() for k, v in dense.state_dict().items()}
        out["steps"] = _recorded_steps(cfg, tables, dense_steps)
    ddp.remove()
    return out
