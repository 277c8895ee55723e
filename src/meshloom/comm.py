"""All of meshloom's communication, and the counter that records it.

Every collective a strategy issues goes through a function here, naming the mesh axis it runs on.
The `CommCounter` records payload bytes and calls per (axis, op), which is how the tests hold comm
volume to the published formulas. The payload is the size of the whole tensor the collective
acts on: the tensor for all-reduce and broadcast, the gathered output for all-gather, the input
for reduce-scatter. So a reduce-scatter plus an all-gather of Ψ bytes count 2Ψ, like one
all-reduce of Ψ, as in the ZeRO paper's accounting.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshloom.mesh import Mesh


@dataclass
class CommCounter:
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    # The latest collective issued and when: the stall watchdog (faults.py) reports it.
    last: tuple[str, str] = ("", "")
    last_time: float = field(default_factory=time.monotonic)
    key: int = field(default_factory=lambda: next(_counter_keys), compare=False)

    def __post_init__(self) -> None:
        _counters[self.key] = self

    def record(self, axis: str, op: str, tensor: torch.Tensor, times: int = 1) -> None:
        """Count `times` × `tensor`'s bytes. Pass the tensor the collective reads (an all-gather
        counts its input `times` = group size): compiled, the count runs where that tensor is
        ready, so a backward collective's count stays in the backward graph."""
        if torch.compiler.is_compiling():
            # Inside a compiled block (tensor parallel's collectives): Python bookkeeping would
            # break the graph, so the compiled code calls the counter through an opaque op.
            torch.ops.meshloom.count_collective(tensor, self.key, axis, op, times)
            return
        self.add(axis, op, tensor.numel() * tensor.element_size() * times)

    def add(self, axis: str, op: str, nbytes: int) -> None:
        self.bytes[(axis, op)] += nbytes
        self.calls[(axis, op)] += 1
        self.last = (axis, op)
        self.last_time = time.monotonic()

    def snapshot(self) -> dict[tuple[str, str], int]:
        return dict(self.bytes)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def by_axis(self, since: dict[tuple[str, str], int] | None = None) -> dict[str, int]:
        """Bytes per axis, optionally only what was added after an earlier snapshot."""
        out: dict[str, int] = defaultdict(int)
        for (axis, _op), n in self.bytes.items():
            out[axis] += n - (since or {}).get((axis, _op), 0)
        return {k: v for k, v in out.items() if v}

    def total(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(n for (a, o), n in self.bytes.items()
                   if (axis is None or a == axis) and (op is None or o == op))


_counter_keys = itertools.count()
_counters: weakref.WeakValueDictionary[int, CommCounter] = weakref.WeakValueDictionary()


@torch.library.custom_op("meshloom::count_collective", mutates_args=())
def _count_collective(tensor: torch.Tensor, counter: int, axis: str, op: str,
                      times: int) -> None:
    """`CommCounter.record` as compiled code runs it, once per call of the graph: the bytes of
    every collective a compiled block issues are counted as in eager (it runs on the host and
    reads only the tensor's size)."""
    found = _counters.get(counter)
    if found is not None:
        found.add(axis, op, tensor.numel() * tensor.element_size() * times)


@_count_collective.register_fake
def _(tensor: torch.Tensor, counter: int, axis: str, op: str, times: int) -> None:
    return None


# It returns nothing, so without this the compiler would drop it as dead code.
torch.fx.node.has_side_effect(torch.ops.meshloom.count_collective.default)


# torch 2.13 renamed the flat collectives; older releases (>= 2.4) only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _skip(mesh: Mesh, axis: str) -> bool:
    # A group of one rank moves nothing; not calling it keeps the counter honest and saves time.
    return mesh.size(axis) == 1


def all_reduce(tensor: torch.Tensor, mesh: Mesh, axis: str, *, op=dist.ReduceOp.SUM,
               async_op: bool = False, label: str = "all_reduce") -> dist.Work | None:
    """`label` names the op in the counter: bookkeeping traffic stays apart from model traffic."""
    if _skip(mesh, axis):
        return None
    mesh.counter.record(axis, label, tensor)
    return dist.all_reduce(tensor, op=op, group=mesh.group(axis), async_op=async_op)


def broadcast(tensor: torch.Tensor, mesh: Mesh, axis: str, *, src_coord: int = 0,
              async_op: bool = False) -> dist.Work | None:
    """Broadcast from the rank at coordinate `src_coord` of the axis."""
    if _skip(mesh, axis):
        return None
    mesh.counter.record(axis, "broadcast", tensor)
    src = mesh.group_ranks(axis)[src_coord]
    return dist.broadcast(tensor, src=src, group=mesh.group(axis), async_op=async_op)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, mesh: Mesh, axis: str, *,
                    async_op: bool = False, label: str = "all_gather") -> dist.Work | None:
    """Gather equal-sized shards along dim 0 of `output` (Gloo needs equal sizes: pad first)."""
    if _skip(mesh, axis):
        output.copy_(shard)
        return None
    mesh.counter.record(axis, label, shard, times=mesh.size(axis))
    return _all_gather_flat(output, shard, group=mesh.group(axis), async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, mesh: Mesh, axis: str, *,
                        op=dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
    if _skip(mesh, axis):
        output.copy_(full)
        return None
    mesh.counter.record(axis, "reduce_scatter", full)
    return _reduce_scatter_flat(output, full, op=op, group=mesh.group(axis), async_op=async_op)


def all_reduce_scalars(values: list[float], mesh: Mesh, axis: str, *, op=dist.ReduceOp.SUM,
                       device: torch.device | str = "cpu") -> list[float]:
    """Reduce a few Python numbers (losses, norms) in one call."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    all_reduce(t, mesh, axis, op=op, label="all_reduce_scalars")
    return t.tolist()


def all_to_all(x: torch.Tensor, mesh: Mesh, axis: str, send_rows: list[int],
               recv_rows: list[int], *, label: str = "all_to_all") -> torch.Tensor:
    """Rows of `x` [n, ...] to the ranks of the axis: the first send_rows[0] to coordinate 0,
    the next send_rows[1] to coordinate 1, ...; returns what arrives, recv_rows[r] rows from
    coordinate r, in coordinate order. Counted as the payload sent (x), so a dispatch and its
    combine count the same bytes. `label` keeps bookkeeping (split sizes) apart."""
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    if _skip(mesh, axis):
        out.copy_(x)
        return out
    mesh.counter.record(axis, label, x)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_rows,
                           input_split_sizes=send_rows, group=mesh.group(axis))
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all forward; backward sends each gradient row back where its row came from."""

    @staticmethod
    def forward(ctx, x, mesh, axis, send_rows, recv_rows):
        ctx.args = (mesh, axis, send_rows, recv_rows)
        return all_to_all(x, mesh, axis, send_rows, recv_rows)

    @staticmethod
    def backward(ctx, g):
        mesh, axis, send_rows, recv_rows = ctx.args
        return all_to_all(g.contiguous(), mesh, axis, recv_rows, send_rows), None, None, None, \
            None


def all_to_all_rows(x: torch.Tensor, mesh: Mesh, axis: str, send_rows: list[int],
                    recv_rows: list[int]) -> torch.Tensor:
    """`all_to_all`, differentiable (expert parallel's dispatch and combine)."""
    return _AllToAll.apply(x, mesh, axis, send_rows, recv_rows)


# ---------------------------------------------------------------- autograd-aware pairs
# Tensor (and sequence) parallel layers are built from these. Each is its own adjoint's
# partner: what one does in forward, the other does in backward, so gradients come out right
# without the layers knowing about communication.


def _leading(x: torch.Tensor, dim: int) -> bool:
    """Whether every dimension before `dim` has size 1. The collectives work on flat buffers,
    rank after rank; then the ranks' pieces along `dim` already lie in that order in memory, so
    gathering or scattering along `dim` needs no rearranging copy (a micro-batch of one sequence
    under sequence parallel)."""
    return math.prod(x.shape[:dim]) == 1


def _gather_dim(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (equal shapes)."""
    n = mesh.size(axis)
    if n == 1:
        return x
    x = x.contiguous()
    leading = _leading(x, dim)  # then gathered straight into the result
    shape = (*x.shape[:dim], n * x.shape[dim], *x.shape[dim + 1:]) if leading else (n, *x.shape)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    all_gather_into(out.view(-1), x.view(-1), mesh, axis)
    return out if leading else torch.cat(out.unbind(0), dim=dim)


def _check_splits(x: torch.Tensor, n: int, axis: str, dim: int) -> None:
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {axis}={n}")


def _chunk_dim(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    """This rank's slice of `x` along `dim`."""
    n = mesh.size(axis)
    if n == 1:
        return x
    _check_splits(x, n, axis, dim)
    return x.chunk(n, dim=dim)[mesh.coord(axis)].contiguous()


def _reduce_scatter_dim(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's slice along `dim`."""
    n = mesh.size(axis)
    if n == 1:
        return x
    _check_splits(x, n, axis, dim)
    if _leading(x, dim):  # the chunks already lie rank after rank
        parts = x.contiguous()
        shape = (*x.shape[:dim], x.shape[dim] // n, *x.shape[dim + 1:])
    else:
        parts = torch.stack(x.chunk(n, dim=dim)).contiguous()  # [n, ...slice]
        shape = parts.shape[1:]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    reduce_scatter_into(out.view(-1), parts.view(-1), mesh, axis)
    return out


def _identity(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    return x


def _summed(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    x = x.clone()
    all_reduce(x, mesh, axis)
    return x


def _pair(name: str, forward_op, backward_op) -> type[torch.autograd.Function]:
    """An autograd Function doing `forward_op` forward and `backward_op` to the gradient."""

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mesh, axis, dim):
            ctx.args = (mesh, axis, dim)
            return forward_op(x, mesh, axis, dim)

        @staticmethod
        def backward(ctx, g):
            return backward_op(g.contiguous(), *ctx.args), None, None, None

    Pair.__name__ = Pair.__qualname__ = name
    return Pair


_CopyToGroup = _pair("CopyToGroup", _identity, _summed)
_ReduceFromGroup = _pair("ReduceFromGroup", _summed, _identity)
_GatherFromGroup = _pair("GatherFromGroup", _gather_dim, _chunk_dim)
_ScatterToGroup = _pair("ScatterToGroup", _chunk_dim, _gather_dim)
# Sequence parallel: entry gathers the sequence-split activations and reduce-scatters their
# gradient; exit is the reverse.
_GatherThenReduceScatter = _pair("GatherThenReduceScatter", _gather_dim, _reduce_scatter_dim)
_ReduceScatterThenGather = _pair("ReduceScatterThenGather", _reduce_scatter_dim, _gather_dim)


def copy_to_group(x: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (entry of a column-parallel part)."""
    return _CopyToGroup.apply(x, mesh, axis, 0)


def reduce_from_group(x: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
    """All-reduce forward, identity backward (exit of a row-parallel part)."""
    return _ReduceFromGroup.apply(x, mesh, axis, 0)


def gather_from_group(x: torch.Tensor, mesh: Mesh, axis: str, dim: int = -1) -> torch.Tensor:
    """All-gather along `dim` forward, keep own slice of the gradient backward."""
    return _GatherFromGroup.apply(x, mesh, axis, dim % x.ndim)


def scatter_to_group(x: torch.Tensor, mesh: Mesh, axis: str, dim: int = -1) -> torch.Tensor:
    """Keep own slice along `dim` forward, all-gather the gradient backward."""
    return _ScatterToGroup.apply(x, mesh, axis, dim % x.ndim)


def gather_seq(x: torch.Tensor, mesh: Mesh, axis: str, dim: int = 1) -> torch.Tensor:
    """All-gather along `dim` forward, reduce-scatter backward (sequence parallel entry)."""
    return _GatherThenReduceScatter.apply(x, mesh, axis, dim % x.ndim)


def reduce_scatter_seq(x: torch.Tensor, mesh: Mesh, axis: str, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along `dim` forward, all-gather backward (sequence parallel exit)."""
    return _ReduceScatterThenGather.apply(x, mesh, axis, dim % x.ndim)


# ---------------------------------------------------------------- point-to-point (pipeline)


class PeerTimeout(RuntimeError):
    """A receive that did not complete in time (the message names what was awaited)."""


def send(tensor: torch.Tensor, mesh: Mesh, axis: str, dst: int, tag: int) -> dist.Work:
    """Asynchronous send to global rank `dst`; counted once, as the payload."""
    mesh.counter.record(axis, "send", tensor)
    return dist.isend(tensor.contiguous(), dst=dst, tag=tag)


def post_recv(buffer: torch.Tensor, src: int, tag: int) -> dist.Work:
    """Start receiving into `buffer` from global rank `src` (Gloo moves the data only once the
    receive is posted, so posting it early lets the transfer overlap compute)."""
    return dist.irecv(buffer, src=src, tag=tag)


def wait_recv(work: dist.Work, buffer: torch.Tensor, src: int, timeout_s: float,
              what: str) -> torch.Tensor:
    """Wait for a posted receive, or raise PeerTimeout after `timeout_s`."""
    import datetime

    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # Gloo reports a time-out as an error
        raise PeerTimeout(f"{what}: nothing arrived from rank {src} within {timeout_s:g} s "
                          f"({type(e).__name__})") from None
    if ok is False:
        raise PeerTimeout(f"{what}: nothing arrived from rank {src} within {timeout_s:g} s")
    return buffer


def recv(buffer: torch.Tensor, src: int, tag: int, timeout_s: float, what: str) -> torch.Tensor:
    """Receive into `buffer` from global rank `src`, or raise PeerTimeout after `timeout_s`."""
    return wait_recv(post_recv(buffer, src, tag), buffer, src, timeout_s, what)
