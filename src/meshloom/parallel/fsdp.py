"""ZeRO-3 / FSDP over the `dp_shard` axis (HSDP with `dp_replicate`).

Each unit (the embedding, every transformer block, and the root: what is left, i.e. the final
norm and output head) keeps only a flat shard of its parameters, 1/N of a padded flat buffer,
which is also what the optimizer updates. The model's parameters are views into the unit's whole
flat buffer, whose storage exists only while the unit is gathered:
- forward: just before a unit runs, its buffer is all-gathered (the next unit's gather is started
  at the same time, so it overlaps this unit's compute); after the unit, the storage is freed
  (`reshard_after_forward`; otherwise kept, ZeRO-2-like: every unit is then gathered when the
  forward ends, so the step's later micro-batches find them all still gathered, each unit
  gathered once a step and freed by the last micro-batch's backward);
- backward: a hook on the unit's output re-gathers it just before its backward (and prefetches
  the unit before it); once all of its gradients exist they are packed, freed, and
  reduce-scattered asynchronously into the unit's gradient shard, and the buffer is freed;
- HSDP: the reduced shard is all-reduced across the replicate group at the end of the step.
- `reduce_once` (PyTorch FSDP's `no_sync()`): inside `no_sync()` a unit's gradients are added
  into a whole fp32 gradient of the unit instead of being reduce-scattered, and the step's last
  micro-batch reduce-scatters that sum once: one reduce-scatter a unit and step for 4 bytes a
  parameter of memory from the first micro-batch's backward to the last's.
The root unit stays gathered from forward to its backward, as the head's weights are used last in
forward and first in backward. Its gather is started as the last block's prefetch, so that
block's compute hides it, and waited on by the first module that reads it (the final norm), when
every root parameter lies in a declared piece outside the blocks; a model that reads one in its
own forward gets the root gathered before its forward starts. A tied table is the embedding's
too, so a tied root is gathered when the embedding runs.
Between two micro-batches of a step (`no_sync()`, without a pipeline: `carry`) the units the next
forward opens with, whose gathers nothing would hide, are not gathered again: the first block
(and a tied root) stays gathered from its backward, and the embedding, which backward does not
gather, is gathered while the first block's backward runs. The drain after the step's last
micro-batch frees every unit, held ones too, so no parameter outlives the step it was gathered in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from meshloom import comm
from meshloom.mesh import Mesh
from meshloom.parallel.dp_axes import DENSE, DPAxes
from meshloom.parallel.flat import FlatGroup
from meshloom.parallel.zero import (
    FP32,
    ShardPrecision,
    all_reduce_replicas,
    pieces_state,
    split_pieces,
)


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


class _Unit:
    def __init__(self, name: str, module: nn.Module, named: list[tuple[str, nn.Parameter]],
                 n: int, rank: int, prec: ShardPrecision, axis: str = "dp_shard"):
        self.name, self.module, self.prec, self.axis = name, module, prec, axis
        self.group = g = FlatGroup([a for a, _ in named], [p for _, p in named], n, rank)
        fp32 = g.pack([p.detach().float() for p in g.params], g.new_flat(torch.float32))
        # The fp32 shard is the only lasting copy of the parameters: what the optimizer updates.
        self.shard = g.shard_of(fp32).to(prec.master_device(g.device), copy=True)
        self.full = g.new_flat(prec.param_dtype)  # working copy, storage only while gathered
        for p, view in zip(g.params, g.views(self.full), strict=True):
            p.data = view
        self.nbytes = self.full.numel() * self.full.element_size()
        # The gradient shard exists only from the step's first reduce to zero_grad(), so that
        # forward's activations never share the peak with last step's gradients.
        self.grad_shard = g.new_shard(torch.float32, prec.master_device(g.device))
        self.grad_live = True  # freed once the optimizer's views of it exist
        # An embedding's backward reads only the token ids: no need to re-gather it.
        self.backward_needs_params = (not isinstance(module, nn.Embedding)
                                      and getattr(module, "backward_reads_weight", True))
        self.gathered, self.work = True, None
        self.pending = len(g.params)
        # Parameters whose gradients a zero-bubble input pass gives (norms, an embedding): the
        # weight pass completes the unit without them (their gradients wait in .grad).
        self.early: set[nn.Parameter] = set()
        self.inflight: tuple | None = None
        self.whole: torch.Tensor | None = None  # reduce_once: this step's sum so far, fp32
        self.free()

    def free_grads(self) -> None:
        if self.grad_live:
            _free(self.grad_shard)
            self.grad_live = False

    def live_grads(self) -> torch.Tensor:
        """The gradient shard, allocated (zeroed) if this step has not produced it yet."""
        if not self.grad_live:
            self.grad_shard.untyped_storage().resize_(
                self.grad_shard.numel() * self.grad_shard.element_size())
            self.grad_shard.zero_()
            self.grad_live = True
        return self.grad_shard

    def free(self) -> None:
        if self.work is not None:  # a prefetch in flight still writes into the storage
            self._finish_gather()
        if self.gathered:
            _free(self.full)
            self.gathered = False

    def start_gather(self, mesh: Mesh) -> None:
        if self.gathered or self.work is not None:
            return
        self.full.untyped_storage().resize_(self.nbytes)
        # The working dtype on the device; kept referenced until the gather completes.
        src = self.shard.to(self.full.device, self.full.dtype)
        work = comm.all_gather_into(self.full, src, mesh, self.axis, async_op=True)
        self.work = (work, src)
        if work is None:  # a group of one: already complete
            self.work, self.gathered = None, True

    def wait_gather(self, mesh: Mesh) -> None:
        self.start_gather(mesh)
        if self.work is not None:
            self._finish_gather()

    def _finish_gather(self) -> None:
        self.work[0].wait()
        self.work = None
        self.gathered = True


def units_of(model: nn.Module) -> list[str]:
    """The submodules sharded as units, innermost first, `""` (the root) last: the model's own
    `fsdp_units()` where it declares them, else each input piece (bar one holding a tied table,
    which the root owns), each block, and the root (models/contract.py's `pieces()`)."""
    if hasattr(model, "fsdp_units"):
        return model.fsdp_units()
    pieces = model.pieces()
    tied = pieces.tied[0] if pieces.tied else ""
    inputs = [n for n in pieces.input if not tied.startswith(n + ".")]
    blocks = getattr(model, pieces.blocks)
    return inputs + [f"{pieces.blocks}.{i}" for i in range(len(blocks))] + [""]


def _within(name: str, pieces) -> bool:
    return any(name == piece or name.startswith(piece + ".") for piece in pieces)


def _root_readers(model: nn.Module, root: _Unit) -> tuple[list[nn.Module], bool]:
    """The modules that hold the root's parameters, when each lies in one of the model's pieces
    outside the blocks (the output part's norm and head; an input piece's tied table): the first
    of them to run waits for the root's gather. Empty when one lies elsewhere (on the model
    itself, say), where the model's forward may read it before any of its modules runs. And
    whether the forward reads the root before its blocks (an input piece, or the model itself)."""
    if not hasattr(model, "pieces"):
        return [], True
    pieces = model.pieces()
    mine = set(root.group.params)
    readers, first = [], False
    for name, mod in model.named_modules():
        if not any(p in mine for p in mod.parameters(recurse=False)):
            continue
        if not _within(name, (*pieces.input, *pieces.output)):
            return [], True
        readers.append(mod)
        first = first or _within(name, pieces.input)
    return readers, first


class FullyShardedDataParallel:
    """ZeRO-3 over a model's units: its `fsdp_units()`, else those its `pieces()` imply."""

    def __init__(self, model: nn.Module, mesh: Mesh, *, reshard_after_forward: bool = True,
                 precision: ShardPrecision = FP32,
                 named: list[tuple[str, nn.Parameter]] | None = None,
                 units: list[str] | None = None, axes: DPAxes = DENSE, carry: bool = True,
                 reduce_once: bool = False):
        """`named`/`units`: the parameters and units to shard (default: all of them, in the
        model's units) over `axes`; expert parallel shards the experts apart, each MoE's
        `experts` a unit (parallel/expert_dp.py). `carry`: a backward inside `no_sync()` is
        followed by the next micro-batch's forward (plain accumulation; not so in a pipeline,
        whose stages run other micro-batches' forwards in between). `reduce_once`: inside
        `no_sync()` gradients are summed whole and reduce-scattered by the step's last
        micro-batch only."""
        # Gradients are averaged over data- and context-parallel ranks.
        self.model, self.mesh, self.dp, self.prec = model, mesh, mesh.size("dp_cp"), precision
        self.axes = axes
        self.norm_axes = (axes.shard, *axes.split)
        self.reshard_after_forward = reshard_after_forward
        self.reduce_once = reduce_once
        if named is None:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        with torch.no_grad():
            for _, p in named:
                comm.broadcast(p.data, mesh, axes.whole, src_coord=0)
        unit_names = units if units is not None else units_of(model)
        owner = self._owners(model, named, unit_names)
        n, rank = mesh.size(axes.shard), mesh.coord(axes.shard)
        self.units: list[_Unit] = []
        for unit_name in unit_names:
            mine = [(a, p) for a, p in named if owner[a] == unit_name]
            if mine:
                module = model.get_submodule(unit_name) if unit_name else model
                self.units.append(_Unit(unit_name, module, mine, n, rank, precision,
                                        axes.shard))
        self.root = next((u for u in self.units if u.name == ""), None)
        # The modules whose forward waits for the root's gather (none: before the forward), and
        # the unit that runs last before them (the last block), which starts it. Declared, not
        # observed, order: a pipeline stage's calls run its chunks in the schedule's order.
        self._root_readers, self._root_first = (_root_readers(model, self.root) if self.root
                                                else ([], False))
        self._root_prefetcher = next((u for u in reversed(self.units) if u is not self.root),
                                     None) if self._root_readers else None
        self._unit_of = {p: u for u in self.units for p in u.group.params}
        # Forward order of the units: the last complete forward's (for forward prefetch) and the
        # current one's (for backward prefetch, in reverse).
        self._order: list[_Unit] = []
        self._current: list[_Unit] = []
        self.peak_gathered_bytes = 0
        self.peak_whole_bytes = 0  # reduce_once: the most whole gradient bytes held at once
        self._whole_bytes = 0  # reduce_once: the whole gradient bytes held now
        self._inflight: list[_Unit] = []  # reduce-scatters not yet completed, oldest first
        self._reduced: set[_Unit] = set()  # units reduced in this micro-batch
        self._scope: set[_Unit] | None = None  # the units this backward reaches (None: all)
        self._carry = carry
        self._carrying = False  # in no_sync(): this step's next forward follows this backward
        self._accumulating = False  # in no_sync(): more of this step's micro-batches follow
        self._kept: set[_Unit] = set()  # held gathered for the next forward
        self._input_pass_open = False  # in a zero-bubble input pass not yet ended
        self._root_read = False  # whether this forward has read the root's parameters
        self._hooks = [model.register_forward_pre_hook(self._root_pre_forward),
                       model.register_forward_hook(self._root_post_forward)]
        for u in self.units:
            if u is self.root:
                continue
            self._hooks.append(u.module.register_forward_pre_hook(
                lambda mod, args, u=u: self._pre_forward(u)))
            self._hooks.append(u.module.register_forward_hook(
                lambda mod, args, out, u=u: self._post_forward(u, out)))
        for mod in self._root_readers:
            self._hooks.append(mod.register_forward_pre_hook(
                lambda mod, args: self._wait_root()))
        for p in self._unit_of:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._decay, self._no_decay, self._masters = split_pieces(
            [(u.group, u.shard, u.grad_shard) for u in self.units])
        for u in self.units:
            u.free_grads()

    @staticmethod
    def _owners(model: nn.Module, named: list[tuple[str, nn.Parameter]],
                unit_names: list[str]) -> dict[str, str]:
        """Each parameter belongs to the deepest declared unit that contains it; a parameter
        used under names in different units (tied embeddings) and the rest go to the root."""
        units = sorted((u for u in unit_names if u), key=len, reverse=True)

        def unit_of(name: str) -> str:
            return next((u for u in units if name.startswith(u + ".")), "")

        seen: dict[nn.Parameter, set[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            seen.setdefault(p, set()).add(unit_of(name))
        return {name: next(iter(seen[p])) if len(seen[p]) == 1 else "" for name, p in named}

    # -- hooks

    def _root_pre_forward(self, module: nn.Module, args) -> None:
        if self._current:
            self._order, self._current = self._current, []
        self._kept.clear()  # from here the forward frees them as usual
        self._root_read = False
        if self.root is not None and not self._root_readers:
            self._wait_root()

    def _wait_root(self) -> None:
        self.root.wait_gather(self.mesh)
        self._root_read = True
        self._note_gathered()

    def _root_post_forward(self, module: nn.Module, args, out) -> None:
        # Re-gather the root before its backward: it is freed once its gradients are reduced,
        # and a pipeline stage runs several micro-batches' forwards before their backwards.
        # Only after a forward that read it: a pipeline rank's other chunk never does.
        if (self.root is not None and self._root_read and torch.is_tensor(out)
                and out.requires_grad):
            out.register_hook(lambda grad: self._pre_backward(self.root, grad))
        elif self.root is not None and not torch.is_grad_enabled() and self.reshard_after_forward:
            # No backward follows a forward without gradients (eval, sampling): the root, held
            # only for one, is freed as the blocks were. Without resharding every unit stays
            # gathered, as a training forward leaves them; the next step's finish() frees them.
            self.root.free()

    def _pre_forward(self, u: _Unit) -> None:
        # A unit nested in a recomputed block (one a model declares inside its block,
        # tests/test_fsdp_nested_units.py) runs its forward again inside backward: it keeps its
        # place in the forward order. Appended
        # again, it would be its own successor there: a zero-bubble input pass would free it
        # just before its backward reads it, and the next forward would prefetch it after
        # itself instead of what follows it.
        if u not in self._current:
            self._current.append(u)
        u.wait_gather(self.mesh)
        nxt = self._neighbour(self._order, u, +1)
        if nxt is None and u is self._root_prefetcher:
            nxt = self.root  # the last block's compute hides the root's gather
        if nxt is not None:
            nxt.start_gather(self.mesh)
        self._note_gathered()

    def _note_gathered(self) -> None:
        """High-water mark of gathered bytes (the prefetch-depth allowance is tested on it)."""
        now = sum(v.nbytes for v in self.units if v.gathered or v.work is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, now)

    def _post_forward(self, u: _Unit, out) -> None:
        if self.reshard_after_forward:
            u.free()
        if torch.is_tensor(out) and out.requires_grad and u.backward_needs_params:
            out.register_hook(lambda grad, u=u: self._pre_backward(u, grad))
        return None

    def _pre_backward(self, u: _Unit, grad: torch.Tensor) -> torch.Tensor:
        u.wait_gather(self.mesh)
        if self._scope is not None and not self._scope:
            # A zero-bubble input pass: the unit after u has given its input gradients, and
            # the weight pass reads no parameter (only the kept inputs and output gradients),
            # so it is freed now rather than when its weight gradients are reduced.
            done = self._neighbour(self._current, u, +1)
            if done is not None:
                self._release(done)
        prev = self._neighbour(self._current, u, -1)
        if prev is not None and prev.backward_needs_params:
            prev.start_gather(self.mesh)
        elif prev is not None and self._carrying and prev in self._opening():
            # The next forward opens with it (an embedding): this backward hides its gather.
            prev.start_gather(self.mesh)
            self._kept.add(prev)
        self._note_gathered()
        return grad

    def _release(self, u: _Unit) -> None:
        """Free u unless this step holds it: without resharding while micro-batches follow,
        or kept (carry) for the next forward."""
        if not (self._accumulating and not self.reshard_after_forward) and u not in self._kept:
            u.free()

    def _end_input_pass(self) -> None:
        """After a zero-bubble input pass, what it gathered and nothing holds (the root, the
        chunk's first unit) is freed: its weight pass reads only kept activations."""
        if self._input_pass_open:
            self._input_pass_open = False
            for u in self.units:
                if u.gathered or u.work is not None:
                    self._release(u)

    def _opening(self) -> list[_Unit]:
        """The units the next forward opens with, whose gathers nothing before them would hide:
        its first unit, also the second after one that backward does not gather (an embedding,
        whose lookup hides nothing), and the root where the forward reads it first."""
        cur = self._current
        out = cur[:2] if len(cur) > 1 and not cur[0].backward_needs_params else cur[:1]
        return [*out, self.root] if self._root_first else out

    @staticmethod
    def _neighbour(order: list[_Unit], u: _Unit, step: int) -> _Unit | None:
        if u not in order:
            return None
        i = order.index(u) + step
        return order[i] if 0 <= i < len(order) else None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        u = self._unit_of[p]
        if self._scope is not None and not self._scope:
            # A zero-bubble input pass: its gradient is reduced with the unit's weight pass.
            # Counted there, it would complete the unit early whenever a rank runs a second
            # input pass of a chunk before the first's weight pass (ZB-H1, interleaved_zb).
            u.early.add(p)
            return
        u.pending -= 1
        if u.pending == len(u.early):
            self._reduce(u)

    def _add_whole(self, u: _Unit) -> None:
        """Add the unit's gradients (None: zeros) into its whole fp32 sum, made by the first."""
        g = u.group
        if u.whole is None:
            u.whole = g.pack([p.grad for p in g.params], g.new_flat(torch.float32, empty=True))
            self._whole_bytes += u.whole.numel() * 4
            self.peak_whole_bytes = max(self.peak_whole_bytes, self._whole_bytes)
            return
        for view, p in zip(g.views(u.whole), g.params, strict=True):
            if p.grad is not None:
                view.add_(p.grad)

    def _reduce(self, u: _Unit) -> None:
        g = u.group
        if self.reduce_once and self._accumulating:
            self._add_whole(u)  # no collective: the step's last micro-batch reduces the sum
            for p in g.params:
                p.grad = None
            u.pending = len(g.params)
            self._reduced.add(u)
            self._after_backward(u)
            return
        if u.whole is not None:  # reduce_once: the earlier micro-batches' sum, and this one's
            self._add_whole(u)
            self._whole_bytes -= u.whole.numel() * 4
            packed, u.whole = u.whole.to(self.prec.reduce_dtype), None
        else:
            packed = g.pack([p.grad for p in g.params],
                            g.new_flat(self.prec.reduce_dtype, empty=True))
        for p in g.params:
            p.grad = None
        # The step's first reduce of a unit lands straight in its (new) gradient shard when
        # dtype and device allow; later micro-batches go through a buffer and are added.
        direct = (not u.grad_live and self.prec.reduce_dtype == torch.float32
                  and u.grad_shard.device == g.device)
        out = u.live_grads() if direct else g.new_shard(self.prec.reduce_dtype, empty=True)
        work = comm.reduce_scatter_into(out, packed, self.mesh, self.axes.shard,
                                        async_op=True)
        u.inflight = (work, packed, out, direct)
        u.pending = len(g.params)
        self._reduced.add(u)
        self._after_backward(u)
        # Launching this unit's reduce-scatter completes the previous unit's: that one had this
        # unit's whole backward to finish, and its buffers (a whole unit) are released now.
        self._inflight.append(u)
        while len(self._inflight) > 1:
            self._complete(self._inflight.pop(0))

    def _after_backward(self, u: _Unit) -> None:
        """Held until the step's optimizer: without resharding after forward, every unit (the
        forwards to come would gather it again, and it is gathered at the peak anyway); else,
        carrying, the units the next forward opens with. Freed otherwise."""
        if (self._accumulating and not self.reshard_after_forward
                or self._carrying and u in self._opening()):
            self._kept.add(u)
        else:
            u.free()

    def _complete(self, u: _Unit) -> None:
        work, _, out, direct = u.inflight
        if work is not None:
            work.wait()
        if not direct:
            u.live_grads().add_(out.to(u.grad_shard.device, u.grad_shard.dtype))
        u.inflight = None

    def _drain(self, scope: set[_Unit] | None = None) -> None:
        for u in self.units:
            # No gradient this micro-batch (unused): reduce zeros, as the other ranks reduce it.
            if u not in self._reduced and (scope is None or u in scope):
                self._reduce(u)
        while self._inflight:
            self._complete(self._inflight.pop(0))
        if scope is None:
            self._reduced.clear()
        else:
            self._reduced -= scope

    # -- the GradSync protocol

    def optim_param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return self._decay, self._no_decay

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Every micro-batch is reduced (without `reduce_once`; with it, summed whole for the
        step's last to reduce). With `carry`, the next forward's opening units are held
        gathered for it; without resharding after forward, every unit is."""
        self._carrying, self._accumulating = self._carry, True
        try:
            yield
            self._end_input_pass()  # (while the hold above still applies)
            self._drain(self._scope)
        finally:
            self._carrying = self._accumulating = False

    @contextlib.contextmanager
    def backward_of(self, params: list[nn.Parameter]) -> Iterator[None]:
        """The backward run inside reaches only `params` (a pipeline chunk's; none for a
        zero-bubble input-gradient pass): a `no_sync()` ending in it reduces no other unit, so
        a pipeline rank's other chunks, whose backwards come later, send no zeros."""
        self._scope = {self._unit_of[p] for p in params if p in self._unit_of}
        self._input_pass_open = not self._scope
        try:
            yield
            self._end_input_pass()  # the last micro-batch's (no no_sync() ended it)
        finally:
            self._scope = None
            self._input_pass_open = False

    def finish(self) -> None:
        # Nothing gathered outlives the step, whose optimizer changes the shards: the drain
        # frees every unit it reduces, and any other still gathered (a prefetch no backward
        # used) is freed here.
        self._drain()
        for u in self.units:
            u.free()
        self._kept.clear()
        for u in self.units:
            all_reduce_replicas(u.grad_shard, self.mesh, u.group.device, self.axes.replicas)
            u.grad_shard.div_(self.dp)

    def after_step(self) -> None:
        pass  # the next forward gathers the updated shards

    def zero_grad(self) -> None:
        for u in self.units:
            u.free_grads()
            u.whole = None  # (only a step cut short leaves one)
        self._whole_bytes = 0

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return pieces_state(self.mesh, [u.group for u in self.units], self._masters, optimizer,
                            self.axes.shard)

    def model_state(self) -> dict:
        return pieces_state(self.mesh, [u.group for u in self.units], self._masters, None,
                            self.axes.shard)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, from the fp32 shards (collective over dp_shard)."""
        out = {}
        for u in self.units:
            g = u.group
            full = g.new_flat(torch.float32)
            comm.all_gather_into(full, u.shard.to(g.device, copy=True), self.mesh,
                                 self.axes.shard)
            for name, view in zip(g.names, g.views(full), strict=True):
                out[name] = view.clone()
        return out
