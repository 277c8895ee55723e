"""Apply a tensor-parallel plan (module-name pattern -> style) to a plain model.

The model declares its plan as data (its `TP_PLAN`, models/contract.py; `hf_llama_tp_plan()`
for a Hugging Face decoder); this module swaps the named submodules for the layers of `tensor.py`
and hooks the region entries, so the model's own code never changes. Styles:

- `vocab`: nn.Embedding -> VocabParallelEmbedding (vocabulary split, padded to a multiple of tp);
- `colwise`: nn.Linear -> ColumnParallelLinear whose input was already prepared by its region;
- `rowwise`: nn.Linear -> RowParallelLinear (sum, or reduce-scatter along the sequence, after);
- `colwise_vocab`: the output head: column-parallel over the padded vocabulary, entering its own
  region; its logits stay split and the loss is `vocab_parallel_cross_entropy`;
- `input`: a module (attention, MLP) whose hidden-states input enters a tensor-parallel region:
  one f operator (identity / all-reduce, or all-gather / reduce-scatter with sequence parallel)
  for all of its column layers;
- `sequence`: a module (a norm) that runs replicated on every tp rank; with sequence parallel it
  sees a slice of the sequence, so its parameters' gradients are summed over tp after backward;
- `head_shared`: a module inside a region whose parameters every attention head uses (a per-head
  q or k norm): replicated on every tp rank, each applying it to its own heads, so its
  parameters' gradients are always summed over tp after backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from meshloom import comm
from meshloom.config import Config, ModelDims
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.contract import name_pattern
from meshloom.parallel.delegate import DelegatingGrads
from meshloom.parallel.tensor import (
    AXIS,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _input_entry,
    padded_vocab,
    vocab_parallel_cross_entropy,
)
from meshloom.placement import (
    carry_tags,
    is_sp_partial,
    is_tp_partial,
    mark_sp_partial,
    mark_tp_partial,
    tp_split,
)

STYLES = ("vocab", "colwise", "rowwise", "colwise_vocab", "input", "sequence", "head_shared")


def check_tp_dims(tp: int, *, n_heads: int, kv_heads: int, ffn_hidden: int,
                  prefix: str = "model.") -> str | None:
    """Why the model cannot be split over tp (None if it can): heads, KV heads and the MLP width
    must each divide by tp. KV heads are not replicated to make up for a smaller count."""
    for key, value in (("n_heads", n_heads), ("n_kv_heads", kv_heads),
                       ("ffn_hidden", ffn_hidden)):
        if value % tp:
            extra = (" (fewer KV heads than tp ranks is not supported: lower parallel.tp or "
                     "raise model.n_kv_heads)" if key == "n_kv_heads" and value < tp else "")
            return f"{prefix}{key}={value} must be divisible by parallel.tp={tp}{extra}"
    return None


def check_tp_config(cfg: Config, dims: ParallelDims, model: ModelDims) -> str | None:
    """The first reason the tensor-parallel settings cannot run this model, as one line; or
    None. Sequence parallel splits the tp group's activations along the sequence, so it needs
    tp > 1 and a sequence length that divides by tp."""
    p, seq_len = cfg.parallel, cfg.data.seq_len
    if p.sequence_parallel and dims.tp == 1:
        return ("parallel.sequence_parallel needs parallel.tp > 1 (it splits the tensor-parallel "
                "group's activations)")
    if dims.tp == 1:
        return None
    problem = check_tp_dims(dims.tp, n_heads=model.n_heads, kv_heads=model.kv_heads,
                            ffn_hidden=model.hidden)
    if problem:
        return problem
    if p.sequence_parallel and seq_len % dims.tp:
        return (f"data.seq_len={seq_len} must be divisible by parallel.tp={dims.tp} with "
                "parallel.sequence_parallel (the sequence is split over tp)")
    return None


class RegionInput:
    """Forward pre-hook applying the region-entry operator to a module's hidden-states input
    (the first positional argument, or the `hidden_states` keyword as Hugging Face passes it)."""

    def __init__(self, mesh: Mesh, sequence_parallel: bool):
        self.mesh, self.sequence_parallel = mesh, sequence_parallel

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (_input_entry(args[0], self.mesh, self.sequence_parallel), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            x = _input_entry(kwargs["hidden_states"], self.mesh, self.sequence_parallel)
            return args, {**kwargs, "hidden_states": x}
        raise TypeError(f"{type(module).__name__} got no hidden-states input to split over tp")


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


class TensorParallel:
    """The result of applying a plan: what the loss, generation and gradients need to know."""

    def __init__(self, model: nn.Module, plan: dict[str, str], mesh: Mesh, *,
                 sequence_parallel: bool = False, strict: bool = True):
        bad = sorted(s for s in plan.values() if s not in STYLES)
        if bad:
            raise ValueError(f"unknown tensor-parallel style(s) {bad}; known: {', '.join(STYLES)}")
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.vocab_size: int | None = None
        self.regions: list[RegionInput] = []
        self.layers: list[nn.Module] = []
        compiled = [(name_pattern(p), p, style) for p, style in plan.items()]
        used = dict.fromkeys(plan, 0)
        todo = []
        for name, module in model.named_modules():
            for rx, pattern, style in compiled:
                if rx.match(name):
                    used[pattern] += 1
                    todo.append((name, module, style))
                    break
        unused = [p for p, n in used.items() if not n]
        if unused and strict:  # a pipeline stage holds only some of the modules
            raise ValueError(f"tensor-parallel plan entries match no module: {unused}")
        shared = {}  # original weight -> its new parameter (tied embedding and head)
        for name, module, style in todo:
            self._apply(model, name, module, style, shared)

    def _apply(self, model: nn.Module, name: str, module: nn.Module, style: str,
               shared: dict) -> None:
        mesh, sp = self.mesh, self.sequence_parallel
        if style == "input":
            hook = RegionInput(mesh, sp)
            module.register_forward_pre_hook(hook, with_kwargs=True)
            self.regions.append(hook)
            return
        if style in ("sequence", "head_shared"):
            mark = mark_sp_partial if style == "sequence" else mark_tp_partial
            for p in module.parameters():
                mark(p)
            return
        kind = nn.Embedding if style == "vocab" else nn.Linear
        if not isinstance(module, kind):
            raise ValueError(f"tensor-parallel style {style!r} needs an {kind.__name__} at "
                             f"{name!r}, found {type(module).__name__}")
        if style == "vocab":
            new = VocabParallelEmbedding.from_module(module, mesh, sequence_parallel=sp)
            self.vocab_size = module.num_embeddings
        elif style == "colwise":
            new = ColumnParallelLinear.from_module(module, mesh, sequence_parallel=sp,
                                                   gather_input=False)
        elif style == "colwise_vocab":
            self.vocab_size = module.out_features
            new = ColumnParallelLinear.from_module(
                module, mesh, sequence_parallel=sp,
                padded_out=padded_vocab(module.out_features, mesh.size(AXIS)))
        else:
            new = RowParallelLinear.from_module(module, mesh, sequence_parallel=sp)
        carry_tags(module.weight, new.weight)
        if module.weight in shared:  # tied: both slices are the same padded rows
            new.weight = shared[module.weight]
        else:
            shared[module.weight] = new.weight
        _set_submodule(model, name, new)
        self.layers.append(new)

    # -- what the training loop uses

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_size, self.mesh)

    def set_sequence_parallel(self, on: bool) -> None:
        self.sequence_parallel = on
        for obj in [*self.regions, *self.layers]:
            obj.sequence_parallel = on

    @contextlib.contextmanager
    def sequence_parallel_off(self) -> Iterator[None]:
        """Any sequence length (generation), at the cost of replicated activations."""
        was = self.sequence_parallel
        self.set_sequence_parallel(False)
        try:
            yield
        finally:
            self.set_sequence_parallel(was)

    def sync_partial_grads(self, tensors: list[torch.Tensor]) -> None:
        """Sum over tp the gradients of replicated parameters that each rank computed from its
        part of the work: its slice of the sequence (sequence parallel), its heads (head_shared
        style). One all-reduce for all of them, once per step."""
        grads = [t.grad for t in tensors if t.grad is not None and (
            is_tp_partial(t) or self.sequence_parallel and is_sp_partial(t))]
        if not grads:
            return
        device = torch.device("cuda", torch.cuda.current_device()) \
            if self.mesh.device_type == "cuda" else torch.device("cpu")
        flat = torch.cat([g.reshape(-1).to(device, torch.float32) for g in grads])
        comm.all_reduce(flat, self.mesh, AXIS, label="all_reduce_sp_grads")
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def gather_full(self, named: dict[str, torch.Tensor],
                    params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """Whole tensors from this rank's slices (collective over tp): for tests and export."""
        out = {}
        for name, t in named.items():
            split = tp_split(params[name]) if name in params else None
            if split is None:
                out[name] = t
                continue
            whole = comm.gather_from_group(t.contiguous(), self.mesh, AXIS, dim=split.dim)
            out[name] = whole.narrow(split.dim, 0, split.global_shape[split.dim]).clone()
        return out


class GatheredLogits(nn.Module):
    """A tensor-parallel model seen as a plain one: whole-vocabulary logits, any sequence length
    (sequence parallel is switched off inside). For sampling; every tp rank must call it."""

    def __init__(self, model: nn.Module, tp: TensorParallel):
        super().__init__()
        self.model, self.tp = model, tp
        self.cfg = getattr(model, "cfg", None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with self.tp.sequence_parallel_off():
            logits = self.model(tokens)
        logits = getattr(logits, "logits", logits)  # a Hugging Face output object
        whole = comm.gather_from_group(logits.contiguous(), self.tp.mesh, AXIS, dim=-1)
        return whole[..., :self.tp.vocab_size]


class TensorParallelGrads(DelegatingGrads):
    """Wraps the data-parallel strategy of a tensor-parallel model: after it has reduced the
    gradients over dp, the partial ones (sync_partial_grads) are summed over tp; the global norm
    adds tp to its axes (slices are disjoint across tp, replicated tensors counted once)."""

    def __init__(self, inner, tp: TensorParallel):
        super().__init__(inner)
        self.tp = tp
        self.norm_axes = (*inner.norm_axes, AXIS)
        if hasattr(inner, "expert_norm_axes"):  # expert parallel's own part of the norm
            self.expert_norm_axes = (*inner.expert_norm_axes, AXIS)

    def finish(self) -> None:
        self.inner.finish()
        decay, no_decay = self.inner.optim_param_groups()
        self.tp.sync_partial_grads(decay + no_decay)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole and unpadded (collective over dp_shard and tp)."""
        model = self.inner.model
        if hasattr(self.inner, "full_state_dict"):
            local = self.inner.full_state_dict()
        else:
            local = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return self.tp.gather_full(local, dict(model.named_parameters(remove_duplicate=False)))
