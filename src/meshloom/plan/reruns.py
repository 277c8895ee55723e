"""Which of a layer's forward collectives the backward runs again under activation recompute.

Recompute reruns a block's forward, or part of it, and with it whatever communication that part
issues. How much depends on the implementation, not only on the mode:
- meshloom's eager checkpoint reruns forward ops up to the last one the backward needs. Under
  tp that is the attention's all-reduce (its output rebuilds the residual the second norm
  reruns on), not the MLP's; with SP the attention's reduce-scatter and both all-gathers (the
  projections' inputs), or one all-gather in an MoE block, whose experts work on the rank's
  own slice (the MoE feed-forward is not split over tp: its block has one pair). The same for
  `selective` and `full`: selective's policy keeps only matmul outputs, and the collectives
  are ops like the norms around them.
- Compiled (`train.compile`), `full` runs the compiled block inside the checkpoint, which
  reruns it whole: every forward collective of the block. `selective` runs the checkpoint
  inside the compiled graph: a dense block is one graph, its collectives in it (comm.py), and
  the compiler never reruns a collective, so none runs twice; an MoE block (routing reads
  sizes on the host) or one around the context-parallel ring (its sends) is compiled in
  pieces, and its checkpoint reruns as eager does.
- Megatron-style full recompute reruns each layer's forward (both pairs); its selective one
  reruns the attention core only, no tp collective.
- torchtitan's per-op selective policy (`op_sac`) keeps the outputs of the reduce-scatters it
  lists (`_save_list` in its activation-checkpoint code) and marks every other op to be
  recomputed, all-gathers included, so under SP the backward gathers each projection's input
  again: the forward's two all-gathers, half of its tp traffic (compiled too: the partitioner
  recomputes what the policy marks).
- Context parallel's ring lives in the attention core, which both recompute modes rerun
  (meshloom's and Megatron's alike), except torchtitan's per-op policy, which keeps the attention
  kernel's outputs.
- An MoE block's dispatch and combine: full recompute reruns them; so does meshloom's selective
  (the rerun repeats the routing and the dispatch rather than keep the received rows), where
  Megatron's selective, attention only, does not.
tests/test_plan_reruns.py counts each of meshloom's cases with the comm counter.

How many collectives a block's pass issues in the first place (`tp_pass_worths`): two
all-gathers and two reduce-scatters (with SP; else two all-reduces), the column-parallel
projections that read a norm's output all reading the one gathered input
(`tp_input_gathers=shared`), or, as DTensor's `ColwiseParallel(input_layouts=Shard(1))` on each
projection runs it (`per_linear`, KempnerForge), each projection gathering its own copy
forward and reduce-scattering its own input gradient backward (without SP, all-reducing it).
"""

from __future__ import annotations

from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout
from meshloom.plan.models import ModelShape
from meshloom.plan.step_kernels import norm_casts


def tp_reruns(shape: ModelShape, lay: Layout, impl: Implementation) -> float:
    """Tensor-parallel collectives per layer that backward runs again, in all-reduces (an
    all-gather or reduce-scatter is half of one: the pair moves what an all-reduce does)."""
    if lay.recompute == "none" or lay.tp == 1:
        return 0.0
    full = lay.recompute == "full"
    if not impl.meshloom_block:  # Megatron's: the layer's forward again, or attention only
        if full:
            return 2.0
        # torchtitan's per-op policy keeps reduce-scatter outputs, not all-gathers'
        return 1.0 if impl.op_sac and lay.sp else 0.0
    if full and impl.compile:  # the compiled block, inside the checkpoint, reruns whole
        return 1.0 if shape.is_moe else 2.0  # an MoE feed-forward is not split over tp
    if impl.compile and not shape.is_moe and lay.cp == 1:  # one graph keeps their outputs
        return 0.0
    # The checkpoint reruns up to the last collective the backward needs.
    if not lay.sp:
        return 1.0
    return (1 + (1 if shape.is_moe else 2)) / 2  # the reduce-scatter and the all-gathers


def ring_reruns(lay: Layout, impl: Implementation) -> bool:
    """Whether backward runs context parallel's ring of the forward again."""
    if lay.recompute == "none" or lay.cp == 1:
        return False
    return lay.recompute == "full" or not impl.op_sac


def dispatch_reruns(lay: Layout, impl: Implementation) -> bool:
    """Whether backward runs an MoE block's forward dispatch and combine again."""
    if lay.recompute == "full":
        return True
    return lay.recompute == "selective" and impl.meshloom_block


def tp_extra_readers(shape: ModelShape, impl: Implementation) -> int:
    """Column-parallel projections beyond the first reading each gathered norm output: the
    norms' readers (step_kernels.norm_casts: q, k and v, one under `fused_qkv` and in GPT
    blocks; a SwiGLU's gate and up, GPT's fc1) less one per norm; an MoE block's router and
    dispatch read the second norm's output outside the tp group."""
    readers = norm_casts(shape, impl.fused_qkv, impl.fused_swiglu)
    return readers - (3 if shape.is_moe else 2)


def tp_pass_worths(shape: ModelShape, lay: Layout, impl: Implementation) -> tuple[float, float]:
    """A block's tensor-parallel collectives per micro-batch, (forward, backward with what
    recompute reruns), in all-reduces' worth (an all-gather or a reduce-scatter is half of one):
    2 and 2 + `tp_reruns` with shared gathers (`tp_input_gathers`). Per linear, each extra
    projection reading a norm adds an all-gather forward and a reduce-scatter backward (half
    each), or without SP an all-reduce backward; full recompute reruns the whole forward and
    torchtitan's per-op policy every all-gather."""
    if lay.tp == 1:
        return 0.0, 0.0
    reruns = tp_reruns(shape, lay, impl)
    if impl.tp_input_gathers == "shared":
        return 2.0, 2.0 + reruns
    extra = tp_extra_readers(shape, impl)
    if not lay.sp:  # the forward's all-reduces are the row-parallel ones, as shared
        return 2.0, 2.0 + extra + reruns
    fwd = 2.0 + extra / 2
    if lay.recompute == "full":
        reruns = fwd
    elif reruns and impl.op_sac:  # every all-gather again
        reruns += extra / 2
    return fwd, 2.0 + extra / 2 + reruns
