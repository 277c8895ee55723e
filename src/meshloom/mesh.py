"""The device mesh: named parallel axes, the groups behind them, and a drawing of who holds what.

Axes, outermost first: pp, dp_replicate, dp_shard, cp, tp. `tp` is innermost so that the ranks of a
tensor-parallel group are neighbours (same node, fastest links). Components ask a `Mesh` for the
group of an axis by name; nothing else in meshloom does rank arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from meshloom.comm import CommCounter
    from meshloom.config import ParallelConfig

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened views several components need: all data-parallel ranks (gradient averaging), data x
# context parallel (the ranks whose losses are averaged), and the ranks that together hold one copy
# of a tensor-parallel parameter sharded by ZeRO (a checkpoint entry's group).
FLAT_AXES = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
             "dp_shard_tp": ("dp_shard", "tp")}
# Expert parallel (parallel/expert.py) takes its ranks from the data x context ranks (dp_shard x
# cp, flattened, ep innermost): "ep" holds one copy of every expert between its ranks;
# "edp_shard" are the ranks holding the same experts within a dp_replicate group (ZeRO shards
# experts over them) and "edp" all the ranks holding the same experts (their gradients are summed
# over them). Without experts ep = 1, and "edp_shard"/"edp" are dp_shard x cp / dp x cp.
EXPERT_AXES = ("ep", "edp_shard", "edp", "edp_shard_ep")  # the last: one copy of the experts


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # not a factor of the world size: ep ranks are data x context ranks

    @classmethod
    def resolve(cls, world_size: int, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = -1,
                cp: int = 1, tp: int = 1, ep: int = 1) -> ParallelDims:
        """Fill in dp_shard=-1 from the world size; ValueError naming the key if inconsistent."""
        given = {"pp": pp, "dp_replicate": dp_replicate, "cp": cp, "tp": tp}
        for name, deg in {**given, "dp_shard": dp_shard}.items():
            if deg < 1 and not (name == "dp_shard" and deg == -1):
                hint = " (or -1 to infer it)" if name == "dp_shard" else ""
                raise ValueError(f"parallel.{name}={deg} must be >= 1{hint}")
        others = pp * dp_replicate * cp * tp
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"parallel.dp_shard=-1 cannot be inferred: {world_size} processes do not "
                    f"divide by pp*dp_replicate*cp*tp = {others}")
            dp_shard = world_size // others
        dims = cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=1)
        if dims.world_size != world_size:
            raise ValueError(
                f"parallel: pp*dp_replicate*dp_shard*cp*tp = {dims.world_size} "
                f"({dims.describe()}) but {world_size} processes are launched (--nproc)")
        if ep < 1 or (dp_shard * cp) % ep:
            raise ValueError(f"parallel.ep={ep} must be >= 1 and divide parallel.dp_shard x "
                             f"parallel.cp = {dp_shard} x {cp} (expert-parallel ranks are taken "
                             "from the data and context ranks)")
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def degree(self, axis: str) -> int:
        if axis == "ep":
            return self.ep
        if axis == "edp_shard":
            return self.dp_shard * self.cp // self.ep
        if axis == "edp":
            return self.dp_replicate * self.dp_shard * self.cp // self.ep
        if axis == "edp_shard_ep":
            return self.dp_shard * self.cp
        if axis in FLAT_AXES:
            n = 1
            for a in FLAT_AXES[axis]:
                n *= getattr(self, a)
            return n
        if axis == "world":
            return self.world_size
        if axis == "pp_ends":  # the first and the last pipeline stage
            return min(self.pp, 2)
        return getattr(self, axis)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def describe(self) -> str:
        text = " x ".join(f"{a}={getattr(self, a)}" for a in AXES)
        return text + (f" (ep={self.ep} of dp_shard x cp)" if self.ep > 1 else "")

    def _expert_coords(self, rank: int) -> dict[str, int]:
        """(ep, edp_shard, edp) coordinates: dp_shard x cp flattened, ep innermost."""
        c = self.coordinates(rank)
        flat = c["dp_shard"] * self.cp + c["cp"]
        shard = flat // self.ep
        return {"ep": flat % self.ep, "edp_shard": shard,
                "edp": c["dp_replicate"] * self.degree("edp_shard") + shard, "edp_shard_ep": flat}

    def coordinates(self, rank: int) -> dict[str, int]:
        """Axis coordinates of a global rank (row-major over AXES, tp fastest)."""
        coords = {}
        for axis, size in zip(reversed(AXES), reversed(self.shape), strict=True):
            coords[axis] = rank % size
            rank //= size
        return {a: coords[a] for a in AXES}

    def coordinate(self, rank: int, axis: str) -> int:
        if axis in EXPERT_AXES:
            return self._expert_coords(rank)[axis]
        c = self.coordinates(rank)
        if axis in FLAT_AXES:
            idx = 0
            for a in FLAT_AXES[axis]:
                idx = idx * getattr(self, a) + c[a]
            return idx
        if axis == "world":
            return rank
        return c[axis]

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group of the axis (or flattened axes) as lists of global ranks."""
        members = FLAT_AXES.get(axis, (axis,))
        if axis == "world":
            return [list(range(self.world_size))]
        if axis in EXPERT_AXES:  # grouped by everything but the axis's own coordinate
            groups_e: dict[tuple, list[int]] = {}
            for rank in range(self.world_size):
                c, e = self.coordinates(rank), self._expert_coords(rank)
                key = {"ep": (c["pp"], c["tp"], e["edp_shard"], c["dp_replicate"]),
                       "edp_shard": (c["pp"], c["tp"], e["ep"], c["dp_replicate"]),
                       "edp": (c["pp"], c["tp"], e["ep"]),
                       "edp_shard_ep": (c["pp"], c["tp"], c["dp_replicate"])}[axis]
                groups_e.setdefault(key, []).append(rank)
            return list(groups_e.values())
        fixed = [a for a in AXES if a not in members]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            groups.setdefault(tuple(c[a] for a in fixed), []).append(rank)
        return list(groups.values())


class Mesh:
    """The process groups of every axis for this rank, plus the comm counter they report to."""

    def __init__(self, dims: ParallelDims, rank: int, device_type: str, counter: CommCounter):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.dims, self.rank, self.device_type, self.counter = dims, rank, device_type, counter
        self.device_mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
        self._groups: dict[str, dist.ProcessGroup] = {}
        for axis in AXES:
            self._groups[axis] = self.device_mesh.get_group(axis)
        # Flattened groups are made with new_group on every rank in the same order (a collective
        # call), rather than DeviceMesh's private _flatten.
        for name in FLAT_AXES:
            for ranks in dims.group_ranks(name):
                g = dist.new_group(ranks)
                if rank in ranks:
                    self._groups[name] = g
        if dims.ep > 1:
            for name in EXPERT_AXES:
                for ranks in dims.group_ranks(name):
                    g = dist.new_group(ranks)
                    if rank in ranks:
                        self._groups[name] = g
        # The first and last pipeline stage of each pipeline (a tied embedding's two copies).
        if dims.pp > 1:
            for ranks in dims.group_ranks("pp"):
                ends = sorted({ranks[0], ranks[-1]})
                g = dist.new_group(ends)
                if rank in ends:
                    self._groups["pp_ends"] = g
        self._groups["world"] = dist.group.WORLD

    def group(self, axis: str) -> dist.ProcessGroup:
        return self._groups[axis]

    def size(self, axis: str) -> int:
        return self.dims.degree(axis)

    def coord(self, axis: str) -> int:
        return self.dims.coordinate(self.rank, axis)

    def group_ranks(self, axis: str) -> list[int]:
        return next(g for g in self.dims.group_ranks(axis) if self.rank in g)

    @property
    def device(self) -> torch.device:
        """This rank's compute device: the current CUDA device on GPUs (init_mesh sets it)."""
        import torch

        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    @property
    def replica_axis(self) -> str:
        """The ranks that hold the same weights and see different tokens (gradients and losses
        are averaged over them): data parallel, and context parallel when there is any."""
        return "dp_cp" if self.dims.cp > 1 else "dp"


def init_mesh(parallel: ParallelConfig, *, device: str = "auto", backend: str = "auto",
              timeout_s: float = 600.0) -> Mesh:
    """For a user's own loop: join the ranks' process group and build the mesh `parallel` asks
    for (`dp_shard=-1`: what the other axes leave of the world size). The ranks come from
    torchrun's environment; a process started without it is a world of one. `device`: auto
    (cuda:LOCAL_RANK where CUDA is available, else cpu), cpu or cuda; `backend`: auto (NCCL on
    GPUs, Gloo on CPUs), gloo or nccl. ValueError, naming the key, when the degrees do not
    multiply to the world size."""
    import datetime

    import torch

    from meshloom import launch
    from meshloom.comm import CommCounter
    from meshloom.config import RunConfig, resolve_backend, resolve_device

    rank, world, local_rank, _ = launch.rank_env()
    p = parallel
    dims = ParallelDims.resolve(world, pp=p.pp, dp_replicate=p.dp_replicate,
                                dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, ep=p.ep)
    run = RunConfig(device=device, backend=backend)
    kind = resolve_device(run)
    dev = torch.device(kind, local_rank) if kind == "cuda" else torch.device(kind)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    launch.join_group(resolve_backend(run), datetime.timedelta(seconds=timeout_s), dev,
                      alone=world == 1)
    return Mesh(dims, rank, dev.type, CommCounter())


def draw_layout(dims: ParallelDims, ranks_per_node: int | None = None, backend: str = "",
                device: str = "", zero_stage: int = 0, model=None,
                sequence_parallel: bool = False,
                stages: dict[int, str] | None = None,
                devices: dict[int, str] | None = None) -> str:
    """A text picture of the layout: each rank's coordinates on the axes that are split, by node,
    and what it holds. With `model` (a LlamaConfig) the tensor-parallel slice is spelled out: the
    attention heads, MLP columns and vocabulary rows of every layer that the rank keeps.
    `devices` (parallel.rank_devices): rank -> what each of its devices holds."""
    split = [a for a in AXES if getattr(dims, a) > 1]
    per_node = ranks_per_node or dims.world_size
    head = f"mesh: {dims.describe()}  ({dims.world_size} rank{'s' * (dims.world_size > 1)}"
    head += f", {backend}" if backend else ""
    head += f" on {device}" if device else ""
    lines = [head + ")"]
    for node in range((dims.world_size + per_node - 1) // per_node):
        lines.append(f"  node {node}")
        for rank in range(node * per_node, min((node + 1) * per_node, dims.world_size)):
            c = dims.coordinates(rank)
            axes = "  ".join(f"{a} {c[a]}/{getattr(dims, a)}" for a in split) or "single process"
            holds = _holds(dims, c, zero_stage)
            if stages and c["pp"] in stages:  # which layers this pipeline rank runs
                holds = holds.replace(f"stage {c['pp']}", stages[c["pp"]], 1)
            lines.append(f"    rank {rank:>3}  {axes:<40} {holds}")
            if dims.tp > 1:
                lines.append(" " * 15 + _tp_slice(dims.tp, c["tp"], model, sequence_parallel,
                                                  whole=dims.pp == 1))
            if devices and rank in devices:
                lines.append(" " * 15 + devices[rank])
    return "\n".join(lines)


def _span(total: int, parts: int, i: int, padded: bool = False) -> str:
    size = -(-total // parts) if padded else total // parts
    lo, hi = i * size, min(total, (i + 1) * size)
    return f"{lo}-{hi - 1} of {total}"


def _tp_slice(tp: int, i: int, model, sequence_parallel: bool, whole: bool = True) -> str:
    """Which part of every layer tensor-parallel rank i holds (Megatron's split)."""
    if model is None:
        text = f"tp slice {i}/{tp} of every layer's heads, MLP columns and vocabulary"
    else:
        layers = f"layers 0-{model.n_layers - 1}" if model.n_layers > 1 else "layer 0"
        layers = layers if whole else "each of its stages' layers"
        text = (f"tp slice {i}/{tp} of {layers}: heads {_span(model.n_heads, tp, i)} "
                f"(KV heads {_span(model.kv_heads, tp, i)}), MLP columns "
                f"{_span(model.hidden, tp, i)}; vocabulary rows "
                f"{_span(model.vocab_size, tp, i, padded=True)}")
    if sequence_parallel:
        text += f"; tokens of sequence part {i}/{tp} outside attention and MLP"
    return text


_SHARDED = {1: "optimizer state", 2: "optimizer state + grads", 3: "params + grads + optimizer"}


def _holds(dims: ParallelDims, c: dict[str, int], zero_stage: int = 0) -> str:
    parts = []
    parts.append(f"stage {c['pp']}" if dims.pp > 1 else "all layers")
    if zero_stage and dims.dp_shard > 1:
        parts.append(f"shard {c['dp_shard']}/{dims.dp_shard} of {_SHARDED[zero_stage]}")
    if dims.tp > 1:
        parts.append(f"tp slice {c['tp']}")
    if dims.ep > 1:
        part = (c["dp_shard"] * dims.cp + c["cp"]) % dims.ep
        parts.append(f"experts part {part}/{dims.ep}")
    if dims.dp > 1:
        dp_idx = c["dp_replicate"] * dims.dp_shard + c["dp_shard"]
        parts.append(f"batch part {dp_idx}")
    if dims.cp > 1:
        parts.append(f"sequence chunks {c['cp']},{2 * dims.cp - 1 - c['cp']}")
    return "holds: " + ", ".join(parts)

