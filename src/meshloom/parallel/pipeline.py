"""The pipeline executor: runs any schedule's action list on this rank.

For each action of its list (`pipeline_schedule.py`) a rank: receives a neighbour's activations
or gradient (tagged point-to-point, waiting at most `timeout_s`, then failing with a message
that names the stage and micro-batch), runs a chunk forward (the last stage also computes the
loss, divided by the number of micro-batches exactly as gradient accumulation does), runs a
backward, or sends. With a split backward (zero-bubble), I computes only the input gradient: every
linear layer's weight gradient is deferred (its input and output-gradient kept) until the
action W computes it. Only the last micro-batch's backward of each chunk (W for deferred weights)
runs with the data-parallel gradient sync on; the others run in `no_sync()`, so a step
communicates its gradients once, as with accumulation.

Each step records when every compute action ran (the measured timeline), how many
micro-batches' activations were alive at most, and the CPU time this thread spent in compute:
on a CPU run that equals the busy wall time unless another process took the core, which is how
the report tells an undisturbed step from one stretched by an outside load.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import json
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from meshloom import comm
from meshloom.mesh import Mesh
from meshloom.parallel.delegate import DelegatingGrads, backward_scope
from meshloom.parallel.pipeline_schedule import Action, build_schedule
from meshloom.parallel.pipeline_stage import PipelineStageModel
from meshloom.parallel.step import Batch, Step, local_batch, micro_share

if TYPE_CHECKING:
    from meshloom.parallel import GradSync

AXIS = "pp"
STEP_HISTORY = 100  # steps whose per-rank span and busy time the run keeps for the report


class PipelineError(RuntimeError):
    pass


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T for the zero-bubble schedule: backward (the I pass) returns only dx and keeps
    (x, dy) for the weight gradient, computed by the W pass (`WeightGradStore.run`). The weight
    enters detached, so the I pass gives it no gradient at all (a gradient hook on it, e.g. a
    data-parallel bucket's, fires only when W accumulates the real one)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, holder):
        ctx.save_for_backward(x, weight)
        # The parameter travels inside a tuple: a tensor argument would become a graph input,
        # and its gradient hooks would fire (with no gradient) in the I pass.
        ctx.store, ctx.param, ctx.has_bias = store, holder[0], bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        if ctx.store.collecting is None:
            raise RuntimeError("a deferred-weight linear layer ran backward outside the "
                               "zero-bubble executor's I pass")
        ctx.store.keep(ctx.param, x, gy)
        gb = gy.flatten(0, -2).sum(0) if ctx.has_bias else None
        return gy @ weight.to(gy.dtype), None, gb, None, None


def _weight_grad(x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    return gy.flatten(0, -2).t().to(torch.float32) @ x.flatten(0, -2).to(torch.float32)


def _deferred(x, weight, bias, store):
    return _DeferredLinear.apply(x, weight.detach(), bias, store, (weight,))


class WeightGradStore:
    """Deferred weight gradients per (stage, micro-batch)."""

    def __init__(self):
        self.collecting: tuple[int, int] | None = None
        self.kept: dict[tuple[int, int], list] = {}

    def keep(self, weight: nn.Parameter, x: torch.Tensor, gy: torch.Tensor) -> None:
        self.kept.setdefault(self.collecting, []).append((weight, x, gy))

    def run(self, key: tuple[int, int]) -> None:
        """Accumulate the kept weight gradients through autograd (so that the data-parallel
        strategies' gradient hooks fire as for any other gradient)."""
        items = self.kept.pop(key, [])
        if items:
            grads = [_weight_grad(x, gy).to(w.dtype) for w, x, gy in items]
            torch.autograd.backward([w for w, _, _ in items], grads)


def defer_weight_grads(model: nn.Module, store: WeightGradStore) -> None:
    """Route every linear layer's matmul through `_DeferredLinear`."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            def forward(self, x):
                return _deferred(x, self.weight, self.bias, store)
            module.forward = types.MethodType(forward, module)
        elif hasattr(module, "matmul"):  # the tensor-parallel layers
            module.matmul = lambda x, w, b: _deferred(x, w, b, store)


def _tag(kind: str, stage: int, mb: int) -> int:
    return ((0 if kind.endswith("F") else 1) * 4096 + stage) * 65536 + mb


class PipelineRunner:
    """Runs this rank's part of the pipeline schedule, step after step."""

    def __init__(self, model: PipelineStageModel, mesh: Mesh, *, schedule: str,
                 microbatches: int, virtual_stages: int, loss: Callable, timeout_s: float,
                 sequence_split: Callable[[], int] = lambda: 1, context=None):
        self.model, self.mesh, self.loss = model, mesh, loss
        self.pp, self.m, self.v = mesh.size(AXIS), microbatches, virtual_stages
        self.n_stages = self.pp * self.v
        self.schedule_name = schedule
        self.actions = build_schedule(schedule, self.pp, self.m, self.v)[mesh.coord(AXIS)]
        self.chunk_of = {s: c for c, s in enumerate(model.stages)}
        self._chunk_params = [model.chunk_parameters(c) for c in range(len(model.stages))]
        self.peers = mesh.group_ranks(AXIS)
        self.timeout_s = timeout_s
        self.sequence_split = sequence_split  # how many parts the boundary sequence is split in
        self.context = context  # context parallel: each rank runs its zigzag slice of the tokens
        self.store = WeightGradStore()
        if any(a.kind == "W" for a in self.actions):
            defer_weight_grads(model, self.store)
        self.timeline: list[tuple[float, float, str, int, int]] = []
        self.t0_wall = 0.0
        self.peak_alive = 0
        # Per step (the last STEP_HISTORY): wall-clock first start, last end, busy seconds and
        # CPU seconds of this rank's compute, and each action's (kind, stage, micro-batch,
        # seconds), so the report can give the bubble of every step, not one sample, say which
        # steps ran undisturbed, and replay a step without its transfers.
        self.step_stats: collections.deque = collections.deque(maxlen=STEP_HISTORY)

    # -- helpers

    def _rank_of(self, stage: int) -> int:
        return self.peers[stage % self.pp]

    def _boundary(self, x: torch.Tensor) -> tuple[int, ...]:
        b, s = x.shape[0], x.shape[1]
        return (b, s // self.sequence_split(), self.model.hidden_size)

    def _post(self, a: Action, shape, dtype, device) -> tuple:
        """Start the receive of action `a` (RECV_F / RECV_B)."""
        src = a.stage - 1 if a.kind == "RECV_F" else a.stage + 1
        buf = torch.empty(shape, dtype=dtype, device=device)
        work = comm.post_recv(buf, self._rank_of(src), _tag(a.kind, src, a.mb))
        return work, buf, src

    def _wait(self, a: Action, posted: tuple) -> torch.Tensor:
        work, buf, src = posted
        what = "activations" if a.kind == "RECV_F" else "gradients"
        try:
            return comm.wait_recv(work, buf, self._rank_of(src), self.timeout_s,
                                  f"pipeline stage {a.stage} (rank {self.mesh.rank}) waiting "
                                  f"for the {what} of micro-batch {a.mb} from stage {src}")
        except comm.PeerTimeout as e:
            raise PipelineError(str(e)) from None

    def _recv(self, kind: str, stage: int, mb: int, shape, dtype, device) -> torch.Tensor:
        a = Action(kind, stage, mb)
        return self._wait(a, self._post(a, shape, dtype, device))

    def _localise(self, batches: list, device) -> list:
        return [local_batch(x, y, device, self.context) for x, y in batches]

    # -- one training step

    def train_step(self, batches: list, grads, device: torch.device, autocast,
                   loss_scale: float = 1.0) -> float:
        """Forward and backward of every micro-batch by the schedule; returns the sum of this
        rank's micro-batch losses (each divided by their count; 0 off the last stage)."""
        if len(batches) != self.m:
            raise PipelineError(f"the pipeline schedule was built for {self.m} micro-batches, "
                                f"the step has {len(batches)}")
        dtype = next(self.model.parameters()).dtype
        batches = self._localise(batches, device)
        # Every boundary tensor (activations and their gradients) has the same shape and dtype.
        shape = self._boundary(batches[0][0])
        held: dict[tuple, object] = {}
        posted: dict[int, tuple] = {}  # action index -> receive in flight
        recvs = [i for i, a in enumerate(self.actions) if a.kind.startswith("RECV")]
        sends, total, cpu = [], 0.0, 0.0
        self.timeline, alive, t0 = [], 0, time.perf_counter()
        self.t0_wall = time.time()  # puts the ranks' timelines on one clock (same host clocks)
        for i, a in enumerate(self.actions):
            s, k = a.stage, a.mb
            x_tokens, y, positions = batches[k]
            seq = x_tokens.shape[1]
            if a.kind in ("RECV_F", "RECV_B"):
                if i not in posted:
                    posted[i] = self._post(a, shape, dtype, device)
                key = ("in", s, k) if a.kind == "RECV_F" else ("grad", s, k)
                held[key] = self._wait(a, posted.pop(i))
            elif a.kind == "SEND_F":
                sends.append(comm.send(held[(s, k)][1].detach(), self.mesh, AXIS,
                                       self._rank_of(s + 1), _tag(a.kind, s, k)))
            elif a.kind == "SEND_B":
                sends.append(comm.send(held.pop(("dx", s, k)), self.mesh, AXIS,
                                       self._rank_of(s - 1), _tag(a.kind, s, k)))
            else:
                # Post the next receive now, so that its data moves while this action computes.
                j = bisect.bisect_right(recvs, i)
                nxt = recvs[j] if j < len(recvs) else None
                if nxt is not None and nxt not in posted:
                    posted[nxt] = self._post(self.actions[nxt], shape, dtype, device)
                start, cpu_start = time.perf_counter(), time.thread_time()
                if a.kind == "F":
                    total += self._forward(a, held, x_tokens, y, seq, device, autocast,
                                           positions)
                    alive += 1
                    self.peak_alive = max(self.peak_alive, alive)
                else:
                    last_mb = k == self.m - 1
                    # The chunk's parameters (none in a zero-bubble I pass, which defers the
                    # weights' gradients to its W): what the micro-batch's reduce may cover.
                    reach = [] if a.kind == "I" else self._chunk_params[self.chunk_of[s]]
                    with backward_scope(grads, reach), \
                            contextlib.nullcontext() if last_mb else grads.no_sync():
                        if a.kind == "W":
                            self.store.run((s, k))
                        else:
                            self._backward(a, held, loss_scale)
                    if a.kind != "I":
                        alive -= 1
                cpu += time.thread_time() - cpu_start
                self.timeline.append((start - t0, time.perf_counter() - t0, a.kind, s, k))
        for w in sends:
            w.wait()
        if self.timeline:
            self.step_stats.append((self.t0_wall + self.timeline[0][0],
                                    self.t0_wall + self.timeline[-1][1],
                                    sum(e - b for b, e, *_ in self.timeline), cpu,
                                    [(k, s, m, e - b) for b, e, k, s, m in self.timeline]))
        return total

    def _forward(self, a: Action, held: dict, x_tokens, y, seq: int, device, autocast,
                 positions=None) -> float:
        s, k = a.stage, a.mb
        chunk = self.chunk_of[s]
        if s == 0:
            x = x_tokens.to(device)
        else:
            x = held.pop(("in", s, k)).requires_grad_()
        with autocast:
            out = self.model(x, chunk, seq, positions)
            if s == self.n_stages - 1:
                out = micro_share(self.loss(out, y), self.m)
        held[(s, k)] = (x, out)
        return out.item() if s == self.n_stages - 1 else 0.0

    def _backward(self, a: Action, held: dict, loss_scale: float) -> None:
        s, k = a.stage, a.mb
        x, out = held.pop((s, k))
        if a.kind == "I":
            self.store.collecting = (s, k)
        try:
            if s == self.n_stages - 1:
                (out * loss_scale).backward()
            else:
                out.backward(held.pop(("grad", s, k)))
        finally:
            self.store.collecting = None
        if s > 0:
            held[("dx", s, k)] = x.grad

    # -- forward only (evaluation, sampling)

    @torch.no_grad()
    def forward_only(self, batches: list, device: torch.device, autocast,
                     logits: bool = False):
        """Every micro-batch through the stages; the last stage returns the sum of the
        micro-batch mean losses (or the logits of each, with `logits`), the others 0 / []."""
        dtype = next(self.model.parameters()).dtype
        if not logits:  # sampling runs whole sequences (context parallel switched off)
            batches = self._localise(batches, device)
        else:
            batches = [(x, y, None) for x, y in batches]
        order = [(k, s) for k in range(len(batches)) for s in self.model.stages]
        total, outs, sends = 0.0, [], []
        for k, s in order:
            x_tokens, y, positions = batches[k]
            if s == 0:
                x = x_tokens.to(device)
            else:
                x = self._recv("RECV_F", s, k, self._boundary(x_tokens), dtype, device)
            with autocast:
                out = self.model(x, self.chunk_of[s], x_tokens.shape[1], positions)
            if s == self.n_stages - 1:
                if logits:
                    outs.append(out)
                else:
                    total += self.loss(out, y).item()
            else:
                sends.append(comm.send(out, self.mesh, AXIS, self._rank_of(s + 1),
                                       _tag("SEND_F", s, k)))
        for w in sends:
            w.wait()
        return outs if logits else total


class PipelineStep(Step):
    """The pipeline executor as the model's step (parallel/step.py): the schedule runs the
    micro-batches; the loss is the last stage's, the other stages add 0 to it."""

    def __init__(self, runner: PipelineRunner, grads: GradSync, mesh: Mesh):
        super().__init__(runner.model, grads, mesh)
        self.runner = runner

    def _forward_backward(self, batches: list[Batch], device: torch.device, autocast,
                          loss_scale: float) -> float:
        return self.runner.train_step(batches, self.grads, device, autocast, loss_scale)

    def _eval_sum(self, batches: list[Batch], device: torch.device) -> float:
        return self.runner.forward_only(batches, device, contextlib.nullcontext())

    def write_timeline(self, run_dir: Path) -> None:
        """This rank's measured timelines of the last steps: RUN_DIR/pipeline/timeline_rankR.json
        (read by `meshloom report`), written whole or not at all."""
        r, mesh, rank = self.runner, self.mesh, self.mesh.rank
        folder = run_dir / "pipeline"
        folder.mkdir(parents=True, exist_ok=True)
        data = {"rank": rank, "pp_rank": mesh.coord(AXIS), "pp": r.pp,
                "schedule": r.schedule_name, "virtual_stages": r.v,
                "microbatches": r.m, "peak_alive": r.peak_alive,
                "coords": mesh.dims.coordinates(rank), "t0": r.t0_wall,
                "spans": [list(span) for span in r.timeline],
                "steps": [list(st) for st in r.step_stats]}
        tmp = folder / f".timeline_rank{rank}.json"
        tmp.write_text(json.dumps(data))
        tmp.replace(folder / f"timeline_rank{rank}.json")


class PipelinedLogits(nn.Module):
    """The pipelined model seen as a plain one for sampling: every pp rank calls it with the
    same tokens and gets the whole logits (computed on the last stage, then broadcast)."""

    def __init__(self, runner: PipelineRunner, tp=None):
        super().__init__()
        self.runner, self.tp = runner, tp
        self.cfg = runner.model.cfg  # generate() reads max_seq_len from it, if there is one
        self.vocab = runner.model.vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        r = self.runner
        cp_off = r.context.off() if r.context is not None else contextlib.nullcontext()
        with self.tp.sequence_parallel_off() if self.tp else contextlib.nullcontext(), cp_off:
            outs = r.forward_only([(tokens, tokens)], tokens.device, contextlib.nullcontext(),
                                  logits=True)
        shape = (*tokens.shape, self.vocab)
        if r.model.last:
            logits = outs[0]
            if self.tp is not None:  # vocabulary-split logits: gather, drop the padding
                logits = comm.gather_from_group(logits.contiguous(), self.tp.mesh, "tp",
                                                dim=-1)[..., :self.vocab]
            logits = logits.float().contiguous()
        else:
            logits = torch.empty(shape, dtype=torch.float32, device=tokens.device)
        comm.broadcast(logits, r.mesh, AXIS, src_coord=r.pp - 1)
        return logits


class PipelineGrads(DelegatingGrads):
    """Wraps the (tensor-/data-parallel) gradient strategy of a pipeline stage: the global norm
    adds pp to its axes, and a table tied between the first and the last stage gets the sum of
    both stages' gradients on both, so that the two copies take identical steps."""

    def __init__(self, inner, model: PipelineStageModel, mesh: Mesh):
        super().__init__(inner)
        self.model, self.mesh = model, mesh
        self.norm_axes = (*inner.norm_axes, AXIS)
        if hasattr(inner, "expert_norm_axes"):  # expert parallel's own part of the norm
            self.expert_norm_axes = (*inner.expert_norm_axes, AXIS)
        self.tied = model.tied_parameter()
        # ZeRO-1 reduce-scatters the whole gradients in finish(): sum the ends before; DDP's
        # gradients are whole (and maybe still in flight) until finish(): sum them after.
        self.tie_before_finish = getattr(_innermost(inner), "stage", None) == 1

    def _sum_tied(self) -> None:
        if self.tied is not None and self.tied.grad is not None:
            comm.all_reduce(self.tied.grad, self.mesh, "pp_ends", label="all_reduce_tied")

    def finish(self) -> None:
        if self.tie_before_finish:
            self._sum_tied()
        self.inner.finish()
        if not self.tie_before_finish:
            self._sum_tied()


def _innermost(strategy):
    while hasattr(strategy, "inner"):
        strategy = strategy.inner
    return strategy
