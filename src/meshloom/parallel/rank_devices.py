"""Several devices within one rank (`parallel.rank_devices`): naive model parallel in a process.

The rank's model is spread over an ordered list of devices ("slots"): the input part and the
`block_context` state on the first, consecutive runs of blocks on each slot, the output part (and
so the logits and the loss) on the last. Forward then runs on one slot after the other; at each
slot boundary the hidden states are copied to the next device and their gradient copied back in
backward. Data parallel (DDP, ZeRO-1/2) wraps the placed model across ranks unchanged: its
buckets never span two devices (flat.group_parameters closes a bucket at a device change), so
every bucket is reduced on the device its parameters live on, as PyTorch's DDP does for a
multi-device module: no gradient is copied to a gathering device and back.

Only the model contract is used (`pieces()`, the blocks container, `layer_costs`): parameter names
stay as they are (the moves are forward pre-hooks, not wrapper modules), so checkpoints, tensor
plans and the optimizer's weight-decay split see the same model as without it. A head tied to the
embedding stays on the first slot with it (one parameter cannot live on two devices).

Every copy is a real one (`copy=True`), also between two "cpu" slots, and is recorded on the comm
counter (axis `rank_devices`): on a CPU-only machine the code path and the byte counts are those
of a GPU run. See docs/rank-devices.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshloom.config import Config, ModelDims, ParallelConfig
from meshloom.mesh import ParallelDims
from meshloom.models.contract import blocks_of
from meshloom.parallel.pipeline_stage import split_layers

AXIS = "rank_devices"  # the CommCounter axis of the copies between one rank's devices
KEY = "parallel.rank_devices"


# ---------------------------------------------------------------- which devices, as names


def in_use(p: ParallelConfig) -> bool:
    return p.rank_devices != 1


def device_names(spec: int | list, device_type: str, local_rank: int) -> list[str]:
    """The device names of local rank `local_rank` under `parallel.rank_devices` (see config.py).
    ValueError (one line naming the key) when the spec has no entry for this rank."""
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"{KEY}={spec} must be >= 1 (devices per rank)")
        if device_type == "cuda":
            return [f"cuda:{spec * local_rank + i}" for i in range(spec)]
        return ["cpu"] * spec
    if spec and all(isinstance(x, list) for x in spec):
        if local_rank >= len(spec):
            raise ValueError(f"{KEY} lists devices for {len(spec)} local ranks; local rank "
                             f"{local_rank} has none")
        return list(spec[local_rank])
    return list(spec)


def _per_rank_lists(spec: int | list) -> list[list[str]] | None:
    if isinstance(spec, list) and spec and all(isinstance(x, list) for x in spec):
        return spec
    return None


def _name_problem(name: str, first: bool, device_type: str) -> str | None:
    try:
        dev = torch.device(name)
    except RuntimeError:
        return f"{KEY}: '{name}' is not a device (e.g. 'cuda:1' or 'cpu')"
    if dev.type not in ("cpu", "cuda"):
        return f"{KEY}: '{name}' is neither a cpu nor a cuda device"
    if first and dev.type != device_type:
        return (f"{KEY}: the first device ('{name}') holds the input and the batch, so it must be "
                f"of the run's device type {device_type} (run.device)")
    if dev.type == "cuda" and torch.cuda.is_available() and \
            (dev.index or 0) >= torch.cuda.device_count():
        return f"{KEY}: '{name}' does not exist ({torch.cuda.device_count()} CUDA devices here)"
    return None


def resolve(spec: int | list, device_type: str, local_rank: int) -> list[torch.device]:
    """This rank's devices, in slot order; ValueError (one line) if one is not usable."""
    names = device_names(spec, device_type, local_rank)
    if not names:
        raise ValueError(f"{KEY}={spec!r} lists no device")
    for i, name in enumerate(names):
        problem = _name_problem(name, i == 0, device_type)
        if problem:
            raise ValueError(problem)
    return [torch.device(n) for n in names]


def home_device(p: ParallelConfig, device_type: str, local_rank: int) -> torch.device | None:
    """The rank's first device (its batches, its process-group device), or None when the
    rank has the usual single device."""
    return resolve(p.rank_devices, device_type, local_rank)[0] if in_use(p) else None


# ---------------------------------------------------------------- the layout rule


def check_rank_devices_config(cfg: Config, dims: ParallelDims,
                              model: ModelDims | None = None) -> str | None:
    """Why `parallel.rank_devices` cannot run on this layout (one line), or None."""
    p = cfg.parallel
    if not in_use(p):
        return ("parallel.rank_device_blocks is only used with parallel.rank_devices"
                if p.rank_device_blocks else None)
    if p.mode == "dp":
        return (f"{KEY} cannot be combined with parallel.mode=dp (which replicates the whole "
                "model over parallel.dp_devices instead)")
    others = {"parallel.pp": dims.pp, "parallel.tp": dims.tp, "parallel.cp": dims.cp}
    for key, degree in others.items():
        if degree > 1:
            return (f"{KEY} (several devices per rank) does not combine with {key}={degree}; "
                    "use it with data parallel (DDP, ZeRO-1/2) only")
    if p.zero_stage == 3:
        return (f"{KEY} (several devices per rank) does not combine with parallel.zero_stage=3 "
                "(ZeRO-3/FSDP units are gathered on one device); use zero_stage 0, 1 or 2")
    from meshloom.config import resolve_device

    device_type = resolve_device(cfg.run)
    per_rank = _per_rank_lists(p.rank_devices)
    if isinstance(p.rank_devices, int):
        if p.rank_devices < 1:
            return f"{KEY}={p.rank_devices} must be >= 1 (devices per rank)"
        lists = [device_names(p.rank_devices, device_type, 0)]
    else:
        lists = per_rank or [list(p.rank_devices)]
    for names in lists:
        if not names:
            return f"{KEY}={p.rank_devices!r} lists no device for a rank"
        for i, name in enumerate(names):
            problem = _name_problem(name, i == 0, device_type)
            if problem:
                return problem
    if device_type == "cuda" and dims.world_size > 1 and \
            any(torch.device(n).type == "cpu" for names in lists for n in names):
        return (f"{KEY}: a CPU device in a CUDA run works with one rank only (NCCL cannot reduce "
                "the gradients of the blocks on the CPU)")
    if per_rank is None and not isinstance(p.rank_devices, int) and dims.world_size > 1 and \
            any(torch.device(n).type != "cpu" for n in lists[0]):
        return (f"{KEY}={p.rank_devices!r} would give every rank the same devices; give one "
                "list per local rank ([[\"cuda:0\", \"cuda:1\"], [\"cuda:2\", \"cuda:3\"]]) or "
                "a count (2: local rank r uses cuda:2r and cuda:2r+1)")
    if per_rank is not None:
        owner: dict[torch.device, int] = {}
        for r, names in enumerate(per_rank):
            for dev in {torch.device(n) for n in names if torch.device(n).type != "cpu"}:
                if dev in owner:
                    return f"{KEY}: {dev} is used by local ranks {owner[dev]} and {r}"
                owner[dev] = r
    slots = {len(names) for names in lists}
    if p.rank_device_blocks:
        if len(slots) > 1:
            return (f"parallel.rank_device_blocks needs every local rank to have the same number "
                    f"of devices in {KEY}")
        return _blocks_problem(p.rank_device_blocks, slots.pop(), model)
    if model is not None and max(slots) > model.n_layers:
        return (f"{KEY} gives a rank {max(slots)} devices, but the model has only "
                f"{model.n_layers} blocks (at least one per device)")
    return None


def _blocks_problem(given: list[int], n_slots: int, model: ModelDims | None) -> str | None:
    n = model.n_layers if model is not None else sum(given)
    if len(given) != n_slots or min(given) < 1 or sum(given) != n:
        return (f"parallel.rank_device_blocks={given} must list {n_slots} block counts (one per "
                f"device of {KEY}) of at least 1 each, adding up to the model's {n} blocks")
    return None


# ---------------------------------------------------------------- the placement plan


@dataclass(frozen=True)
class Plan:
    """Blocks [lo, hi) of each slot, and the slot of the output part (0 when tied)."""

    bounds: tuple[tuple[int, int], ...]
    output_slot: int

    def slot_of_block(self, i: int) -> int:
        return next(s for s, (lo, hi) in enumerate(self.bounds) if lo <= i < hi)


def plan_blocks(n_blocks: int, n_slots: int, costs: list[float] | None = None,
                head_cost: float = 0.0, given: list[int] | None = None,
                tied: bool = False) -> Plan:
    """Consecutive blocks per slot: `given` counts, else balanced on the blocks' costs with the
    output part's cost on the slot that holds it (the last; the first when tied)."""
    if given:
        problem = _blocks_problem(given, n_slots, None)
        if problem or sum(given) != n_blocks:
            raise ValueError(problem or f"parallel.rank_device_blocks={given} must add up to the "
                             f"model's {n_blocks} blocks")
        return Plan(tuple(split_layers(n_blocks, n_slots, explicit=given)),
                    0 if tied else n_slots - 1)
    costs = list(costs or [1.0] * n_blocks)
    if n_slots > n_blocks:
        raise ValueError(f"{KEY} gives a rank {n_slots} devices, but the model has only "
                         f"{n_blocks} blocks (at least one per device)")
    if not tied:
        return Plan(tuple(split_layers(n_blocks, n_slots, costs, head_cost)), n_slots - 1)
    # The head's cost on the first slot: balance the reversed sequence, then read it backwards.
    rev = split_layers(n_blocks, n_slots, costs[::-1], head_cost)
    bounds = [(n_blocks - hi, n_blocks - lo) for lo, hi in reversed(rev)]
    return Plan(tuple(bounds), 0)


def describe(names: list[str], plan: Plan, input_names: tuple[str, ...] = ("embedding",),
             output_names: tuple[str, ...] = ("norm", "head")) -> str:
    """One line: what each device of the rank holds (for the layout drawing)."""
    parts = []
    for s, (name, (lo, hi)) in enumerate(zip(names, plan.bounds, strict=True)):
        held = [*input_names] if s == 0 else []
        held.append(f"layers {lo}-{hi - 1}" if hi - lo > 1 else f"layer {lo}")
        if s == plan.output_slot:
            held.extend([*output_names, "loss"])
        parts.append(f"{name}: {', '.join(held)}")
    return "devices  " + " | ".join(parts)


def layout_lines(cfg: Config, dims: ParallelDims, model: Any, device_type: str,
                 ranks_per_node: int | None = None) -> dict[int, str] | None:
    """rank -> what each of its devices holds, for `mesh.draw_layout`; None when not in use."""
    p = cfg.parallel
    if not in_use(p):
        return None
    per_node = ranks_per_node or dims.world_size
    costs, head = model.layer_costs(cfg.data.seq_len)
    out = {}
    for rank in range(dims.world_size):
        names = device_names(p.rank_devices, device_type, rank % per_node)
        plan = plan_blocks(model.n_layers, len(names), costs, head,
                           p.rank_device_blocks or None, bool(model.tie_embeddings))
        out[rank] = describe(names, plan)
    return out


# ---------------------------------------------------------------- moving the model and activations


class _Move(torch.autograd.Function):
    """A copy to another device of the rank, counted both ways (its gradient goes back)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, device: torch.device, counter, op: str) -> torch.Tensor:
        ctx.source, ctx.counter = x.device, counter
        if counter is not None:
            counter.record(AXIS, op, x)
        return x.to(device, copy=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.counter is not None:
            ctx.counter.record(AXIS, "gradient", grad)
        return grad.to(ctx.source, copy=True), None, None, None


class RankDevices:
    """Places a model's pieces on the rank's devices (in place) and moves activations at each
    boundary with forward pre-hooks; `slots` says which slot each piece went to."""

    def __init__(self, model: nn.Module, devices: list[torch.device], plan: Plan, counter=None):
        if len(plan.bounds) != len(devices):
            raise ValueError(f"{KEY}: a plan for {len(plan.bounds)} devices, {len(devices)} given")
        self.model, self.devices, self.plan, self.counter = model, devices, plan, counter
        pieces = model.pieces()
        blocks = blocks_of(model)
        self.slots: dict[str, int] = {}
        model.to(devices[0])  # input part, state buffers and anything outside the pieces
        for name in pieces.input:
            self.slots[name] = 0
        for i, block in enumerate(blocks):
            s = plan.slot_of_block(i)
            block.to(devices[s])
            self.slots[f"{pieces.blocks}.{i}"] = s
        for name in pieces.output:
            getattr(model, name).to(devices[plan.output_slot])
            self.slots[name] = plan.output_slot
        # block_context's tensors (a RoPE table) are made on the first slot each forward; each
        # other slot gets one copy per forward, shared by its blocks: slot -> key -> (src, copy).
        self._context: dict[int, dict[Any, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._hooks = []
        previous = 0
        for i, block in enumerate(blocks):
            s = plan.slot_of_block(i)
            if s != 0:
                self._hooks.append(block.register_forward_pre_hook(
                    self._block_hook(s, moves_hidden=s != previous), with_kwargs=True))
            previous = s
        if pieces.output and plan.output_slot != previous:
            first_out = getattr(model, pieces.output[0])
            self._hooks.append(first_out.register_forward_pre_hook(
                self._output_hook(plan.output_slot), with_kwargs=True))

    def move(self, x: torch.Tensor, slot: int, op: str = "activation") -> torch.Tensor:
        return _Move.apply(x, self.devices[slot], self.counter, op)

    def _shared(self, t: Any, slot: int, key: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        cache = self._context.setdefault(slot, {})
        hit = cache.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        moved = self.move(t, slot, "context")
        cache[key] = (t, moved)
        return moved

    def _block_hook(self, slot: int, moves_hidden: bool):
        def hook(module, args, kwargs):
            # The hidden states (first argument) come from the previous block: copied only at
            # a boundary. The rest is block_context's, made on the first device.
            args = list(args)
            if args and moves_hidden:
                args[0] = self.move(args[0], slot)
            for j in range(1, len(args)):
                args[j] = self._shared(args[j], slot, j)
            kwargs = {k: self._shared(v, slot, k) for k, v in kwargs.items()}
            return tuple(args), kwargs
        return hook

    def _output_hook(self, slot: int):
        def hook(module, args, kwargs):
            return (self.move(args[0], slot), *args[1:]), kwargs
        return hook

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def place(model: nn.Module, devices: list[torch.device], p: ParallelConfig, seq_len: int,
          counter=None) -> RankDevices:
    """Spread `model` over `devices` as `parallel.rank_device_blocks` says (else balanced by
    `layer_costs(seq_len)`, the output part's cost on its slot)."""
    costs, head = model.layer_costs(seq_len)
    tied = model.pieces().tied is not None
    plan = plan_blocks(len(blocks_of(model)), len(devices), costs, head,
                       p.rank_device_blocks or None, tied)
    return RankDevices(model, devices, plan, counter)


def loss_beside_logits(loss):
    """The loss on the logits' device (the last slot): the targets come from the first."""
    def on_last(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss(logits, targets.to(logits.device))
    return on_last


class LogitsOnFirst(nn.Module):
    """The placed model for sampling: its logits back on the first device, beside the prompt
    and the sampler's generator."""

    def __init__(self, model: nn.Module, device: torch.device):
        super().__init__()
        self.model, self.device = model, device
        self.cfg = getattr(model, "cfg", None)

    def forward(self, tokens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.model(tokens, *args, **kwargs).to(self.device)
