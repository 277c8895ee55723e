"""meshloom's own distributed data parallel.

The model is left as it is (no wrapper module, so parameter names and checkpoints don't change);
`DataParallel` attaches to it:
- at start, parameters are broadcast from the first rank of the data-parallel group;
- every gradient lives in a flat bucket buffer (`param.grad` is a view into it), so a bucket's
  all-reduce needs no packing copy;
- buckets are filled in reverse parameter order (the order backward produces gradients), and a
  bucket's all-reduce starts asynchronously the moment its last gradient is accumulated, so it
  overlaps the rest of backward;
- buckets are launched strictly in index order on every rank, which keeps collectives matched even
  when ranks finish gradients in different orders;
- inside `no_sync()` (accumulation micro-batches) nothing is communicated;
- `finish()` waits for the buckets and averages them, just before the optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from meshloom import comm
from meshloom.checkpoint import whole_state
from meshloom.mesh import Mesh
from meshloom.optim import decay_groups, named_trainable
from meshloom.parallel.flat import group_parameters

# A small first bucket, so the first all-reduce starts as soon as the output layer's gradient is
# ready instead of waiting for a full-sized bucket.
FIRST_BUCKET_BYTES = 1 << 20


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views: dict[nn.Parameter, torch.Tensor] = {}
        offset = 0
        for p in params:
            self.views[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.pending = len(params)
        self.work = None
        self.launched = False
        self.wire: torch.Tensor | None = None  # the low-precision copy on the wire, if any

    def reset(self) -> None:
        self.pending, self.work, self.launched = len(self.params), None, False
        self.wire = None


class DataParallel:
    """Bucketed, overlapped gradient averaging over a data-parallel mesh axis."""

    def __init__(self, model: nn.Module, mesh: Mesh, *, axis: str = "dp",
                 bucket_mb: float = 25.0, broadcast_params: bool = True,
                 reduce_dtype: torch.dtype | None = None,
                 named: list[tuple[str, nn.Parameter]] | None = None,
                 divisor: int | None = None):
        """`named`: the parameters to handle (default: all trainable ones; expert parallel
        gives the dense ones to one instance and the experts to another, parallel/expert_dp.py).
        `divisor`: what the summed gradients are divided by (default: the axis's size)."""
        self.model, self.mesh, self.axis = model, mesh, axis
        # parallel.reduce_dtype: gradients travel (and are summed) in this dtype, e.g. bf16 to
        # halve the traffic; accumulation and the average stay in the parameters' dtype.
        self.reduce_dtype = reduce_dtype
        self.size = divisor or mesh.size(axis)
        # named_trainable() already de-duplicates tied weights.
        self.named = named if named is not None else named_trainable(model)
        params = [p for _, p in self.named]
        self.params = params
        if broadcast_params:
            with torch.no_grad():
                for p in params:
                    comm.broadcast(p.data, mesh, axis, src_coord=0)
        self.buckets = self._make_buckets(list(reversed(params)), int(bucket_mb * 2**20))
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._sync = True
        self._next = 0  # index of the next bucket to launch
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self.bind_grads()

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], cap: int) -> list[_Bucket]:
        groups = group_parameters([("", p) for p in params], cap, FIRST_BUCKET_BYTES)
        return [_Bucket([p for _, p in g]) for g in groups]

    norm_axes: tuple[str, ...] = ()  # gradients are whole and identical on every rank

    def optim_param_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return decay_groups(self.params)

    def after_step(self) -> None:
        pass

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return whole_state(self.named, self.mesh, optimizer)

    def model_state(self) -> dict:
        return whole_state(self.named, self.mesh)

    @property
    def grad_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def bind_grads(self) -> None:
        """Point every `param.grad` at its slice of the bucket buffer."""
        for b in self.buckets:
            for p, view in b.views.items():
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
        self.bind_grads()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: for every micro-batch but the last of a step."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[p]
        view = bucket.views[p]
        if p.grad.data_ptr() != view.data_ptr():
            # Someone reset .grad (e.g. zero_grad(set_to_none=True)): fold it back into the bucket.
            view.copy_(p.grad)
            p.grad = view
        if not self._sync:
            return
        bucket.pending -= 1
        if bucket.pending < 0:
            raise RuntimeError("DataParallel: a parameter's gradient arrived twice in one step; "
                               "call finish() after each synchronised backward")
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if not force and b.pending > 0:
                return
            wire = b.buffer
            if self.reduce_dtype is not None and self.reduce_dtype != b.buffer.dtype:
                wire = b.wire = b.buffer.to(self.reduce_dtype)
            b.work = comm.all_reduce(wire, self.mesh, self.axis, async_op=True)
            b.launched = True
            self._next += 1

    def finish(self) -> None:
        """Complete the step's gradient averaging; call once after the last micro-batch."""
        # Buckets with a parameter that got no gradient (unused in this step) are launched now, in
        # order, so every rank issues the same collectives.
        self._launch_ready(force=True)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            if b.wire is not None:
                b.buffer.copy_(b.wire)
            if self.size > 1:
                b.buffer.div_(self.size)
            b.reset()
        self._next = 0

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
