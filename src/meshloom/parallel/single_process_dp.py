"""Single-process data parallel (`parallel.mode = "dp"`): the classic `nn.DataParallel` baseline,
written on our own small pieces.

One process drives several devices. For every micro-batch, `ReplicatedModule.forward`:
1. replicates: `_Broadcast` copies the master parameters (and buffers), which live on the first
   device, to every other device. It is an autograd Function: its backward copies each replica's
   gradient back to the first device and sums it there, which *is* the gradient reduction;
2. scatters the micro-batch along dim 0, one slice per device;
3. runs each replica on its slice in its own thread (the first replica is the master module
   itself, run in the calling thread);
4. gathers the logits into one tensor on the first device (`_Gather`, whose backward sends each
   slice of the logits' gradient back to its device). The training loop computes its loss on
   them exactly as in one process: the mean over the whole micro-batch, whatever the split.

The "devices" may be GPUs or the CPU several times over (`parallel.dp_devices = 2`): on the CPU
every copy is still a real copy (`Tensor.to(copy=True)`), so the code path and the bytes moved
are the GPUs' ones, and the CommCounter's figures (axis `dp_local`) are bytes actually copied.
See docs/data-parallel.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from meshloom.checkpoint import whole_state
from meshloom.comm import CommCounter
from meshloom.mesh import Mesh
from meshloom.optim import decay_groups, named_trainable
from meshloom.parallel.activation_checkpointing import apply_block_options

AXIS = "dp_local"  # the CommCounter axis of this strategy's copies

Record = Callable[[str, torch.Tensor], None]


# ---------------------------------------------------------------- devices and config


def resolve_devices(spec: int | list[str], device_type: str) -> list[torch.device]:
    """`parallel.dp_devices` as a device list (the first one holds the master weights).

    An int N: cuda:0 .. cuda:N-1 on GPUs, or the CPU N times; 0: every visible GPU. A list:
    those devices, e.g. ["cuda:0", "cuda:2"]. ValueError with a one-line message otherwise."""
    key = f"parallel.dp_devices={spec!r}"
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"{key} must be >= 0 (0 = every CUDA device)")
        if spec == 0:
            if device_type != "cuda":
                raise ValueError(f"{key} means every CUDA device, but run.device resolves to "
                                 "cpu; give a replica count, e.g. parallel.dp_devices=2")
            spec = torch.cuda.device_count()
        names = [f"cuda:{i}" for i in range(spec)] if device_type == "cuda" else ["cpu"] * spec
    else:
        names = list(spec)
    if not names:
        raise ValueError(f"{key} lists no device")
    devices = [_parse_device(key, name, device_type) for name in names]
    first = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if devices[0] != first:
        raise ValueError(f"{key}: the first device holds the master weights and must be the "
                         f"run's device {first}")
    return devices


def _parse_device(key: str, name: str, device_type: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{key}: '{name}' is not a device (e.g. 'cpu' or 'cuda:1')") from None
    if dev.type != device_type:
        raise ValueError(f"{key}: '{name}' is not a {device_type} device (run.device resolves "
                         f"to {device_type})")
    if dev.type == "cpu":
        return torch.device("cpu")  # "cpu:0" and "cpu" are the same memory
    dev = torch.device(dev.type, dev.index or 0)
    if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{key}: '{name}' but {torch.cuda.device_count()} CUDA device(s) "
                         "are visible")
    return dev


def check_dp_config(cfg, world_size: int) -> str | None:
    """The first reason `cfg` (a meshloom Config) cannot run in mode dp, as one line; or None."""
    from meshloom.config import resolve_device

    p = cfg.parallel
    for axis in ("pp", "dp_replicate", "cp", "tp"):
        if getattr(p, axis) != 1:
            return (f"parallel.mode=dp needs parallel.{axis}=1 (got {getattr(p, axis)}): every "
                    "device holds the whole model")
    if p.dp_shard not in (-1, 1):
        return (f"parallel.mode=dp needs parallel.dp_shard=1 or -1 (got {p.dp_shard}); the "
                "replica count is parallel.dp_devices")
    if world_size != 1:
        return (f"parallel.mode=dp drives several devices from one process, but {world_size} "
                "processes are launched (--nproc); launch 1, or use DDP (parallel.mode=auto)")
    if p.zero_stage != 0:
        return f"parallel.mode=dp needs parallel.zero_stage=0 (got {p.zero_stage})"
    if cfg.train.compile:
        return "train.compile=true is not supported with parallel.mode=dp"
    try:
        resolve_devices(p.dp_devices, resolve_device(cfg.run))
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------- autograd pieces


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # copy=True: on the CPU "another device" is the same memory and .to() would return `t`
    # itself; the baseline must move the same bytes as it would between GPUs.
    return t.to(device, copy=True)


class _Broadcast(torch.autograd.Function):
    """Forward: a copy of every tensor on each of `devices`, device-major. Backward: every copy's
    gradient is copied back to the source device and summed there."""

    @staticmethod
    def forward(ctx, devices, record, op, *tensors):
        ctx.n, ctx.record = len(tensors), record
        ctx.source = tensors[0].device
        ctx.set_materialize_grads(False)  # unused parameters: no zero tensors to move
        out = []
        for d in devices:
            for t in tensors:
                record(op, t)
                out.append(_copy_to(t, d))
        frozen = [o for i, o in enumerate(out) if not ctx.needs_input_grad[3 + i % ctx.n]]
        ctx.mark_non_differentiable(*frozen)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        sums: list[torch.Tensor | None] = [None] * ctx.n
        for i, g in enumerate(grads):
            if g is None:
                continue
            ctx.record("reduce_grads", g)
            g = _copy_to(g, ctx.source)
            j = i % ctx.n
            sums[j] = g if sums[j] is None else sums[j].add_(g)
        # The master copy's own gradient (replica 0's) is added by autograd, as for any tensor
        # used twice.
        return (None, None, None, *sums)


class _Gather(torch.autograd.Function):
    """Forward: concatenate the replicas' outputs along dim 0 on `device`. Backward: each slice of
    the gradient goes back to the device its rows came from."""

    @staticmethod
    def forward(ctx, device, record, *parts):
        ctx.record = record
        ctx.sizes = [p.shape[0] for p in parts]
        ctx.devices = [p.device for p in parts]
        out = torch.empty((sum(ctx.sizes), *parts[0].shape[1:]), dtype=parts[0].dtype,
                          device=device)
        for i, (part, rows) in enumerate(zip(parts, out.split(ctx.sizes), strict=True)):
            if i:  # the first part is already on `device`: a local copy, not data movement
                record("gather_outputs", part)
            rows.copy_(part)
        return out

    @staticmethod
    def backward(ctx, grad):
        slices = grad.split(ctx.sizes)
        moved = []
        for g, d in zip(slices[1:], ctx.devices[1:], strict=True):
            ctx.record("scatter_output_grads", g)
            moved.append(_copy_to(g, d))
        return (None, None, slices[0], *moved)


# ---------------------------------------------------------------- the replicated model


class ReplicatedModule(nn.Module):
    """The master `module` on devices[0], run as one replica per device on slices of the batch.

    `state_dict()` is the master's, under its own names. A module's tensors must be parameters or
    buffers (plain tensor attributes would not be replicated)."""

    def __init__(self, module: nn.Module, devices: list[torch.device], counter: CommCounter,
                 activation_checkpointing: str = "none"):
        super().__init__()
        self.module, self.devices = module, list(devices)
        self._params = list(module.parameters())  # tied weights once
        self._bufs = list(module.buffers())
        for t in self._params + self._bufs:
            if t.device != self.devices[0]:
                raise ValueError(f"the master module must be on {self.devices[0]}, found a "
                                 f"tensor on {t.device}")
        self._lock = threading.Lock()  # backward may run on several engine threads (CUDA)
        self._counter = counter
        # Shells: the module's structure once per extra device, without tensors; each forward
        # puts that device's copies into their parameter and buffer slots. Built once, so that
        # per-step replication is only the copies.
        self._shells = [self._shell() for _ in self.devices[1:]]
        self._slots = [self._slots_of(s) for s in self._shells]
        # After the shells: each gets its own checkpoint wrappers, bound to its own blocks.
        for m in (module, *self._shells):
            apply_block_options(m, activation_checkpointing)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, len(self.devices) - 1), thread_name_prefix="meshloom-dp")

    def _shell(self) -> nn.Module:
        # Mapping every tensor to None in deepcopy's memo copies the modules but not one tensor.
        memo = {id(t): None for t in self._params + self._bufs}
        shell = copy.deepcopy(self.module, memo)
        shell.train(self.module.training)
        return shell

    def _slots_of(self, shell: nn.Module) -> list[tuple[dict, str, bool, int]]:
        """(table, name, is_param, index into _params/_bufs) for every slot, ties included."""
        index = {id(t): i for i, t in enumerate(self._params)}
        index.update({id(t): i for i, t in enumerate(self._bufs)})
        slots = []
        for master, sub in zip(_all_modules(self.module), _all_modules(shell), strict=True):
            for table, is_param in ((master._parameters, True), (master._buffers, False)):
                own = sub._parameters if is_param else sub._buffers
                for name, t in table.items():
                    if t is not None:
                        slots.append((own, name, is_param, index[id(t)]))
        return slots

    def _record(self, op: str, tensor: torch.Tensor) -> None:
        with self._lock:
            self._counter.record(AXIS, op, tensor)

    def train(self, mode: bool = True) -> ReplicatedModule:
        super().train(mode)
        for s in self._shells:  # not submodules (they hold no state of their own)
            s.train(mode)
        return self

    def state_dict(self, *args, **kwargs):
        # The master's names, as in a one-process run (checkpoints go through the GradSync).
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        k = min(len(self.devices), tokens.shape[0])  # a batch smaller than the devices uses k
        if k == 1:
            return self.module(tokens.to(self.devices[0]))
        devices = self.devices[:k]
        parts = tokens.to(devices[0]).tensor_split(k)  # sizes differ by at most one row
        inputs = [parts[0]]
        for part, d in zip(parts[1:], devices[1:], strict=True):
            self._record("scatter_inputs", part)
            inputs.append(_copy_to(part, d))
        self._replicate(devices[1:])
        outputs = self._parallel_apply([self.module, *self._shells[:k - 1]], inputs, devices)
        out = _Gather.apply(devices[0], self._record, *outputs)
        if not torch.is_grad_enabled():
            self.release()  # no backward will need the copies
        return out

    def _replicate(self, devices: list[torch.device]) -> None:
        params = _Broadcast.apply(devices, self._record, "broadcast_params", *self._params)
        bufs = _Broadcast.apply(devices, self._record, "broadcast_buffers", *self._bufs) \
            if self._bufs else ()
        np_, nb = len(self._params), len(self._bufs)
        for r, slots in enumerate(self._slots[:len(devices)]):
            for table, name, is_param, i in slots:
                table[name] = params[r * np_ + i] if is_param else bufs[r * nb + i]

    def _parallel_apply(self, modules: list[nn.Module], inputs: list[torch.Tensor],
                        devices: list[torch.device]) -> list[torch.Tensor]:
        # Grad mode and autocast are thread-local: each worker takes the caller's.
        grad = torch.is_grad_enabled()
        kind = devices[0].type
        cast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

        def run(module: nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
            with torch.set_grad_enabled(grad), _on(device), \
                    torch.autocast(kind, dtype=cast[1], enabled=cast[0]):
                out = module(x)
            return getattr(out, "logits", out)  # a Hugging Face output object

        futures = [self._pool.submit(run, m, x, d)
                   for m, x, d in zip(modules[1:], inputs[1:], devices[1:], strict=True)]
        try:
            first = run(modules[0], inputs[0], devices[0])
        finally:
            concurrent.futures.wait(futures)  # never leave a replica running behind an error
        return [first, *(f.result() for f in futures)]

    def close(self) -> None:
        """Stop the worker threads (they also end when this object is garbage-collected)."""
        self._pool.shutdown()

    def release(self) -> None:
        """Empty the replicas' slots: the autograd graph keeps what backward still needs."""
        for slots in self._slots:
            for table, name, _, _ in slots:
                table[name] = None


def _all_modules(m: nn.Module) -> Iterator[nn.Module]:
    """Every module in definition order, shared ones as often as they occur (so that a master
    and its deep copy pair up one to one)."""
    yield m
    for child in m._modules.values():
        if child is not None:
            yield from _all_modules(child)


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# ---------------------------------------------------------------- GradSync


class ReplicaGrads:
    """GradSync of a ReplicatedModule. Backward has already summed every replica's gradient into
    the master parameters' `.grad` (in `_Broadcast.backward`), so nothing is left to reduce; and
    nothing can be deferred under `no_sync()`, since the replicas are rebuilt per micro-batch."""

    norm_axes: tuple[str, ...] = ()

    def __init__(self, replicated: ReplicatedModule, mesh: Mesh):
        self.replicated, self.module, self.mesh = replicated, replicated.module, mesh

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def finish(self) -> None:
        self.replicated.release()  # the step's backward is done: free the replicas' copies

    def optim_param_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return decay_groups(self.module.parameters())

    def after_step(self) -> None:
        pass

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=False)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return whole_state(named_trainable(self.module), self.mesh, optimizer)

    def model_state(self) -> dict:
        return whole_state(named_trainable(self.module), self.mesh)
