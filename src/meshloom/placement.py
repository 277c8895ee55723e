"""Where the tensor a rank holds sits inside the global parameter.

Strategies tag what they create, and everything that must see the layout-independent picture
(checkpoints, the global grad norm, the sequence-parallel gradient sync) reads the tags here:
- a tensor-parallel slice carries a `TPSplit` (split dimension, global unpadded shape, offset);
- a tensor the sharded optimizer updates (a ZeRO piece) points at the model parameter it is a
  piece of (`source`);
- a replicated parameter whose gradient is only partial per tp rank under sequence parallel (norm
  gains, row-parallel biases: they see a slice of the sequence) is marked `sp_partial`; one whose
  gradient is partial per tp rank always (a gain all heads share, each rank applying it to its
  own heads) is marked `tp_partial`;
- a pipeline stage's copy of a tied table is saved under the embedding's name and marked as a
  duplicate (counted once in the grad norm).

`rects()` maps a range of a rank's flattened local tensor to rectangles of the global tensor, so
a checkpoint stores every parameter in its natural global shape whatever the layout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from meshloom.mesh import Mesh

_TP, _SOURCE, _SP_PARTIAL = "_meshloom_tp", "_meshloom_source", "_meshloom_sp_partial"
_NAME, _DUPLICATE = "_meshloom_checkpoint_name", "_meshloom_duplicate"
_TP_PARTIAL = "_meshloom_tp_partial"
_EP = "_meshloom_ep"


@dataclass(frozen=True)
class TPSplit:
    """This rank holds indices [offset, offset + local size) along `dim` of a tensor of
    `global_shape`; indices past the global size are padding (a padded vocabulary)."""

    dim: int
    global_shape: tuple[int, ...]
    offset: int


def set_tp_split(p: nn.Parameter, split: TPSplit) -> None:
    setattr(p, _TP, split)


def set_ep_split(p: nn.Parameter, split: TPSplit) -> None:
    """An expert-parallel slice: this rank's experts along dim 0 (parallel/expert.py)."""
    setattr(p, _EP, split)


def ep_split(t: torch.Tensor) -> TPSplit | None:
    return getattr(source(t), _EP, None)


def mark_sp_partial(p: nn.Parameter) -> None:
    setattr(p, _SP_PARTIAL, True)


def mark_tp_partial(p: nn.Parameter) -> None:
    setattr(p, _TP_PARTIAL, True)


def set_source(t: torch.Tensor, param: nn.Parameter) -> None:
    setattr(t, _SOURCE, param)


def source(t: torch.Tensor) -> torch.Tensor:
    """The model parameter an optimizer tensor belongs to (itself if it is one)."""
    return getattr(t, _SOURCE, t)


def tp_split(t: torch.Tensor) -> TPSplit | None:
    return getattr(source(t), _TP, None)


def is_sp_partial(t: torch.Tensor) -> bool:
    return getattr(source(t), _SP_PARTIAL, False)


def is_tp_partial(t: torch.Tensor) -> bool:
    return getattr(source(t), _TP_PARTIAL, False)


def set_checkpoint_name(p: nn.Parameter, name: str) -> None:
    """Save `p` under another parameter's name (a pipeline stage's copy of a tied table)."""
    setattr(p, _NAME, name)


def checkpoint_name(name: str, p: torch.Tensor) -> str:
    return getattr(source(p), _NAME, name)


def mark_duplicate(p: nn.Parameter) -> None:
    """`p` is a kept-equal copy of a parameter another rank also holds: count it once."""
    setattr(p, _DUPLICATE, True)


def is_duplicate(t: torch.Tensor) -> bool:
    return getattr(source(t), _DUPLICATE, False)


def carry_tags(old: nn.Parameter, new: nn.Parameter) -> None:
    """`new` replaces `old` (its tensor-parallel slice): keep the name it is saved under and
    whether it is a duplicate (a pipeline stage's copy of a tied table stays counted once)."""
    for attr in (_NAME, _DUPLICATE):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))


def global_shape(param: torch.Tensor) -> tuple[int, ...]:
    split = tp_split(param) or ep_split(param)
    return split.global_shape if split else tuple(param.shape)


Rect = tuple[tuple[int, ...], tuple[int, ...], int, int]  # global offsets, sizes, flat [a, b)


def rects(param: torch.Tensor, lo: int, hi: int) -> list[Rect]:
    """Rectangles of the global tensor covered by elements [lo, hi) of `param`'s flattened local
    tensor (row-major), each with the flat sub-range [a, b) holding it: per dimension a partial
    first slice, whole slices and a partial last slice; padding is clipped away."""
    shape = tuple(param.shape)
    local = _rects(shape, lo, hi)
    experts = ep_split(param)
    if experts is not None:  # this rank's experts start at `offset` of the global dim 0
        local = [((offs[0] + experts.offset, *offs[1:]), sizes, a, b)
                 for offs, sizes, a, b in local]
    split = tp_split(param)
    if split is None:
        return local
    out = []
    limit = split.global_shape[split.dim]
    for offs, sizes, a, b in local:
        offs = list(offs)
        offs[split.dim] += split.offset
        start, size = offs[split.dim], sizes[split.dim]
        keep = max(0, min(size, limit - start))  # clip the padding
        if keep == 0:
            continue
        if keep < size:
            sizes = tuple(keep if d == split.dim else s for d, s in enumerate(sizes))
            # Only dim 0 is ever padded (vocabulary rows), so the kept part is a flat prefix.
            b = a + keep * (sizes[1] if len(sizes) == 2 else 1)
        out.append((tuple(offs), tuple(sizes), a, b))
    return out


def _rects(shape: tuple[int, ...], lo: int, hi: int) -> list[Rect]:
    if hi <= lo:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo, hi)]
    inner = 1
    for d in shape[1:]:
        inner *= d
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)

    def within(r: int, a: int, b: int) -> list[Rect]:  # part of slice r of dim 0
        return [((r, *offs), (1, *sizes), r * inner + x, r * inner + y)
                for offs, sizes, x, y in _rects(shape[1:], a, b)]

    if r0 == r1:
        return within(r0, c0, c1)
    out = []
    if c0:
        out += within(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner,
                    r1 * inner))
    if c1:
        out += within(r1, 0, c1)
    return out


def checkpoint_entry(param: torch.Tensor, values: torch.Tensor, lo: int, mesh: Mesh,
                     shard_axis: str | None = None):
    """The checkpoint value for `values` (1-D: elements [lo, lo + numel) of `param`'s flattened
    local tensor; may be empty): a plain tensor of the global shape when this rank holds it
    whole, otherwise a ShardedTensor over the group of ranks that together hold it (`shard_axis`
    and/or tp). The pieces are views of `values`, so a load fills them in place. Collective
    over that group."""
    shape = global_shape(param)
    split = tp_split(param)
    experts = "ep" if ep_split(param) is not None else None
    axes = [a for a in (shard_axis, experts, "tp" if split else None)
            if a and mesh.size(a) > 1]
    if not axes:
        return values.view(shape)
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    hi = lo + values.numel()
    shards = []
    for offs, sizes, a, b in (rects(param, lo, hi) if hi > lo else []):
        # ShardedTensor placements name global ranks.
        meta = ShardMetadata(list(offs), list(sizes), f"rank:{mesh.rank}/{values.device}")
        shards.append(Shard(values[a - lo:b - lo].view(sizes), meta))
    group = mesh.group("_".join(axes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's deprecation notices
        return init_from_local_shards(shards, *shape, process_group=group)
