"""ZeRO stages 1 and 2 over the `dp_shard` axis, with HSDP replication over `dp_replicate`.

Parameters stay whole on every rank, living in flat padded buffers (one per bucket, buckets in the
order backward produces gradients). Each rank owns 1/N of every buffer (N = dp_shard):
- the optimizer (AdamW state: 8 bytes per element in fp32) exists only for the owned shard, as
  views of it, one per parameter piece, so weight decay still applies to matrices only;
- stage 1: gradients accumulate in full flat buffers; at the end of the step each buffer is
  reduce-scattered and the averaged shard lands in the buffer's own shard slice;
- stage 2: as each bucket's gradients are complete during backward, they are packed, the
  per-parameter gradients freed, and the bucket reduce-scattered asynchronously (overlapping the
  rest of backward) into a gradient shard, the only gradient memory kept;
- HSDP (dp_replicate > 1): the reduced shard is then all-reduced across the replicate group;
- after the optimizer step, each buffer's shard is all-gathered back into the whole parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from meshloom import comm
from meshloom.checkpoint import ADAM_STATS
from meshloom.config import Config, ModelDims
from meshloom.mesh import Mesh, ParallelDims
from meshloom.parallel.ddp import FIRST_BUCKET_BYTES
from meshloom.parallel.dp_axes import DENSE, DPAxes
from meshloom.parallel.flat import FlatGroup, group_parameters
from meshloom.placement import checkpoint_entry, checkpoint_name, set_source


def check_zero_config(cfg: Config, dims: ParallelDims,
                      model: ModelDims | None = None) -> str | None:
    """Why the ZeRO settings cannot run on this layout (one line), or None. Every stage (the
    ZeRO-3 of fsdp.py too) shards over dp_shard; offloading moves the sharded optimizer state."""
    p = cfg.parallel
    if p.zero_stage and dims.dp_shard == 1:
        return f"parallel.zero_stage={p.zero_stage} shards over parallel.dp_shard, which is 1"
    if p.reduce_once and p.zero_stage != 3:
        return (f"parallel.reduce_once needs parallel.zero_stage=3, not {p.zero_stage} (DDP and "
                "ZeRO-1 reduce once a step already; ZeRO-2 keeps no whole gradients)")
    if p.cpu_offload and not p.zero_stage:
        return ("parallel.cpu_offload needs parallel.zero_stage >= 1 (it offloads the sharded "
                "optimizer state)")
    return None


@dataclass(frozen=True)
class ShardPrecision:
    """Mixed precision and offload for the sharded stages: the model computes with
    `param_dtype` working copies, gradients are reduced in `reduce_dtype`, and the fp32 master
    shard with its AdamW state lives on `master_device` (the CPU when offloaded)."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    offload: bool = False

    def master_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu") if self.offload else device

    def master_aliases(self) -> bool:
        """In plain fp32 on the device, the working shard is the master: no copy."""
        return self.param_dtype == torch.float32 and not self.offload


FP32 = ShardPrecision()


class _Bucket:
    def __init__(self, group: FlatGroup, stage: int, prec: ShardPrecision):
        self.group = group
        fp32 = group.pack([p.detach().float() for p in group.params], group.new_flat(torch.float32))
        self.params = fp32 if prec.param_dtype == torch.float32 else fp32.to(prec.param_dtype)
        for p, view in zip(group.params, group.views(self.params), strict=True):
            p.data = view  # the model's parameters now live in the flat buffer
        master_device = prec.master_device(group.device)
        if prec.master_aliases():
            self.master = group.shard_of(self.params)
        else:
            self.master = group.shard_of(fp32).to(master_device, copy=True)
        if stage == 1:
            # Whole gradients; in plain fp32 the shard slice receives the reduced result.
            self.grads = group.new_flat(prec.param_dtype)
            self.grad_shard = (group.shard_of(self.grads) if prec.master_aliases()
                               and prec.reduce_dtype == torch.float32
                               else group.new_shard(torch.float32, master_device))
        else:
            self.grads = None
            self.grad_shard = group.new_shard(torch.float32, master_device)
        self.pending = len(group.params)
        # Parameters whose gradients a zero-bubble input pass gives (norms, an embedding): the
        # weight pass completes the bucket without them (their gradients wait in .grad).
        self.early: set[nn.Parameter] = set()
        self.inflight: tuple | None = None  # (work, packed input, output shard) of stage 2

    def bind_grads(self) -> None:
        if self.grads is None:
            return
        for p, view in zip(self.group.params, self.group.views(self.grads), strict=True):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view


class ZeroDataParallel:
    """ZeRO-1/2 on a plain model; the training loop drives it through the GradSync protocol."""

    def __init__(self, model: nn.Module, mesh: Mesh, *, stage: int, bucket_mb: float = 25.0,
                 precision: ShardPrecision = FP32,
                 named: list[tuple[str, nn.Parameter]] | None = None, axes: DPAxes = DENSE):
        """`named`: the parameters to shard (default: every trainable one) over `axes`
        (expert parallel's experts go over their own, parallel/expert_dp.py)."""
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel handles stages 1 and 2, not {stage}")
        self.model, self.mesh, self.stage, self.prec = model, mesh, stage, precision
        self.axes = axes
        self.norm_axes = (axes.shard, *axes.split)
        self.dp = mesh.size("dp_cp")  # gradients are averaged over data and context ranks
        if named is None:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        with torch.no_grad():
            for _, p in named:  # replicas start identical
                comm.broadcast(p.data, mesh, axes.whole, src_coord=0)
        n, rank = mesh.size(axes.shard), mesh.coord(axes.shard)
        # One lane of buckets per pipeline chunk, each launched in its own order: a chunk's
        # backward then reduces its buckets without waiting on another chunk's.
        self._lanes = [[_Bucket(FlatGroup([a for a, _ in g], [b for _, b in g], n, rank), stage,
                                precision)
                        for g in group_parameters(list(reversed(lane)), int(bucket_mb * 2**20),
                                                  FIRST_BUCKET_BYTES)]
                       for lane in chunk_lanes(model, named)]
        self.buckets = [b for lane in self._lanes for b in lane]
        self._lane_of = {b: i for i, lane in enumerate(self._lanes) for b in lane}
        self._bucket_of = {p: b for b in self.buckets for p in b.group.params}
        self._decay, self._no_decay, self._masters = split_pieces(
            [(b.group, b.master, b.grad_shard) for b in self.buckets])
        self._next = [0] * len(self._lanes)  # per lane: the next bucket to launch
        self._scope: set[int] | None = None  # the lanes this backward reaches (None: all)
        self._hooks = []
        if stage == 2:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                           for _, p in named]
        for b in self.buckets:
            b.bind_grads()

    def optim_param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(decay, no_decay): this rank's pieces of the parameters, with .grad after finish()."""
        return self._decay, self._no_decay

    # -- stage 2: reduce-scatter during backward

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b = self._bucket_of[p]
        if self._scope is not None and not self._scope:
            # A zero-bubble input pass: its gradient is reduced with the bucket's weight pass
            # (counted here, a second input pass before the first's weight pass would launch
            # the bucket before its weights' gradients exist).
            b.early.add(p)
            return
        b.pending -= 1
        self._launch_ready(self._lane_of[b])

    def _launch_ready(self, lane: int, force: bool = False) -> None:
        buckets = self._lanes[lane]
        while self._next[lane] < len(buckets):
            b = buckets[self._next[lane]]
            if not force and b.pending > len(b.early):
                return
            g = b.group
            packed = g.pack([p.grad for p in g.params],
                            g.new_flat(self.prec.reduce_dtype, empty=True))
            for p in g.params:
                p.grad = None  # only the shard is kept
            out = g.new_shard(self.prec.reduce_dtype, empty=True)
            work = comm.reduce_scatter_into(out, packed, self.mesh, self.axes.shard,
                                            async_op=True)
            b.inflight = (work, packed, out)
            self._next[lane] += 1
            # Launching a bucket completes the one before it: that one had this bucket's
            # backward to finish, and its packed copy (a whole bucket) is released now.
            if self._next[lane] >= 2:
                self._complete(buckets[self._next[lane] - 2])

    def _complete(self, b: _Bucket) -> None:
        if b.inflight is None:
            return
        work, _, out = b.inflight
        if work is not None:
            work.wait()
        b.grad_shard.add_(out.to(b.grad_shard.device, b.grad_shard.dtype))
        b.inflight = None

    def _drain(self, lanes: set[int] | None = None) -> None:
        """Stage 2: finish this micro-batch's reduce-scatters (of `lanes`, default all) and add
        them to the shards; a bucket without gradients (unused) reduces zeros, as the other
        ranks reduce it."""
        for lane, buckets in enumerate(self._lanes):
            if lanes is not None and lane not in lanes:
                continue
            self._launch_ready(lane, force=True)
            for b in buckets:
                self._complete(b)
                b.pending = len(b.group.params)
            self._next[lane] = 0

    # -- the GradSync protocol

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A micro-batch that is not the step's last. Stage 1 communicates only at the end of
        the step anyway; stage 2 keeps no whole gradients, so it reduces every micro-batch."""
        yield
        if self.stage == 2:
            self._drain(self._scope)

    @contextlib.contextmanager
    def backward_of(self, params: list[nn.Parameter]) -> Iterator[None]:
        """The backward run inside reaches only `params` (a pipeline chunk's; none for a
        zero-bubble input-gradient pass): a `no_sync()` ending in it reduces only their lanes,
        so a pipeline rank's other chunks, whose backwards come later, send no zeros."""
        self._scope = {self._lane_of[self._bucket_of[p]] for p in params if p in self._bucket_of}
        try:
            yield
        finally:
            self._scope = None

    def finish(self) -> None:
        if self.stage == 2:
            self._drain()
        for b in self.buckets:
            if self.stage == 1:
                out = b.group.new_shard(self.prec.reduce_dtype)
                comm.reduce_scatter_into(out, b.grads.to(self.prec.reduce_dtype), self.mesh,
                                         self.axes.shard)
                b.grad_shard.copy_(out)
            all_reduce_replicas(b.grad_shard, self.mesh, b.group.device, self.axes.replicas)
            b.grad_shard.div_(self.dp)

    def after_step(self) -> None:
        """All-gather every bucket's updated shard into the whole parameters."""
        for b in self.buckets:
            # A copy in the working dtype on the device (Gloo wants distinct input and output).
            shard = b.master.to(b.params.device, b.params.dtype, copy=True)
            comm.all_gather_into(b.params, shard, self.mesh, self.axes.shard)

    def zero_grad(self) -> None:
        for b in self.buckets:
            if b.grads is not None:
                b.grads.zero_()
                b.bind_grads()
            else:
                b.grad_shard.zero_()
                for p in b.group.params:
                    p.grad = None

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return pieces_state(self.mesh, [b.group for b in self.buckets], self._masters, optimizer,
                            self.axes.shard)

    def model_state(self) -> dict:
        """The fp32 master pieces (after a load, `after_step()` spreads them to the params)."""
        return pieces_state(self.mesh, [b.group for b in self.buckets], self._masters, None,
                            self.axes.shard)


Masters = dict[tuple[int, int], tuple[nn.Parameter, int]]


def chunk_lanes(model: nn.Module, named: list[tuple[str, nn.Parameter]]
                ) -> list[list[tuple[str, nn.Parameter]]]:
    """`named` split by the pipeline chunk whose backward gives them gradients (a pipeline
    stage model's `chunk_parameters`), the last chunk first, as backward reaches them; one
    lane of all of them for any other model."""
    chunks = getattr(model, "chunk_parameters", None)
    n = len(getattr(model, "stages", ()))
    if chunks is None or n <= 1:
        return [named]
    chunk_of = {id(p): c for c in range(n) for p in chunks(c)}
    lanes: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(n)]
    for name, p in named:
        lanes[chunk_of[id(p)]].append((name, p))
    return [lane for lane in reversed(lanes) if lane]


def all_reduce_replicas(shard: torch.Tensor, mesh: Mesh, device: torch.device,
                        replicas: tuple[str, ...] = DENSE.replicas) -> None:
    """Sum a reduced gradient shard over the ranks that hold the same shard: the replicate
    group (HSDP) and, for dense parameters, the context-parallel ranks, which saw other tokens
    of the same sequences (on the device, where the backend can reach it, even when the shard
    is offloaded)."""
    axes = [a for a in replicas if mesh.size(a) > 1]
    if not axes:
        return
    t = shard if shard.device == device else shard.to(device)
    for axis in axes:
        comm.all_reduce(t, mesh, axis)
    if t is not shard:
        shard.copy_(t)


def split_pieces(groups: list[tuple[FlatGroup, torch.Tensor, torch.Tensor]]
                 ) -> tuple[list[nn.Parameter], list[nn.Parameter], Masters]:
    """The optimizer's tensors for sharded groups: one leaf per parameter piece in this rank's
    shard, a view of the parameter shard (the update lands in place) with its gradient a view
    of the gradient shard. Returns (decay, no_decay, {(group, param index): (leaf, offset)})."""
    decay, no_decay, masters = [], [], {}
    for gi, (group, param_shard, grad_shard) in enumerate(groups):
        for piece, view in group.piece_views(param_shard):
            master = nn.Parameter(view)  # shares storage with the shard
            set_source(master, group.params[piece.index])
            master.grad = grad_shard[piece.shard_lo:piece.shard_lo + piece.numel]
            (decay if group.params[piece.index].ndim >= 2 else no_decay).append(master)
            masters[(gi, piece.index)] = (master, piece.param_lo)
    return decay, no_decay, masters


def pieces_state(mesh: Mesh, groups: list[FlatGroup], masters: Masters,
                 optimizer: torch.optim.Optimizer | None, shard_axis: str = "dp_shard") -> dict:
    """This rank's pieces, keyed like whole-parameter state so that a checkpoint does not depend
    on the layout: `optim/<name>/<stat>` (or `model/<name>` when optimizer is None) in the
    parameter's global shape, as ShardedTensors over dp_shard (and tp for tensor-parallel
    slices). HSDP replicas write identical chunks, which DCP stores once. Collective over those
    groups (every rank walks every parameter)."""
    out = {}
    for gi, g in enumerate(groups):
        for i, (name, p) in enumerate(zip(g.names, g.params, strict=True)):
            name = checkpoint_name(name, p)
            master, lo = masters.get((gi, i), (None, 0))
            for k in (ADAM_STATS if optimizer is not None else (None,)):
                if master is None:
                    values = torch.empty(0, dtype=torch.float32, device=g.device)
                else:
                    values = master.detach() if k is None else optimizer.state[master][k]
                key = f"model/{name}" if k is None else f"optim/{name}/{k}"
                out[key] = checkpoint_entry(p, values, lo, mesh, shard_axis)
    return out
