"""How many layers each pipeline stage runs, as the training code splits them.

- `balanced` (meshloom): `parallel.pipeline_stage.split_layers` itself, fed the FLOPs per token
  that meshloom's models report for pipeline balance (`layer_costs`: 6 x matmul weights + 6 x
  attended keys x attention width per block; 6 x vocabulary x hidden for the head on the last
  stage). The planner builds the same numbers from the shape, so it prices the split meshloom
  will run, not an idealised one: with a large vocabulary the last stage gets fewer blocks, and
  when pp x v does not divide the blocks some stage carries one more.
- `even`: every stage gets L // (pp x v) blocks and the first L mod (pp x v) one more, the head
  on top of the last (Megatron-LM, which requires an even split; DeepSpeed's uniform
  partition, which gives the remainder to the first stages).
- `even_ends`: the embedding and the head count as one block each (Megatron-DeepSpeed's
  `--pp-partition-method 'type:transformer|embedding'`, BLOOM's): DeepSpeed's
  `partition_balanced` over L + 2 equal items, which fills stages in order up to
  ceil((L + 2) / stages) items, so the first and last stages run one block fewer.

Stage s runs on pipeline rank s mod pp (chunk s // pp), as in meshloom and Megatron.
"""

from __future__ import annotations

from functools import lru_cache

from meshloom.parallel.pipeline_stage import split_layers
from meshloom.plan import PlanError
from meshloom.plan.models import ModelShape

PP_SPLITS = ("balanced", "even", "even_ends")


def meshloom_layer_costs(shape: ModelShape, seq: int) -> tuple[list[float], float]:
    """What meshloom's model of this shape returns from `layer_costs(seq)`: training FLOPs per
    token of each block and of the head (models/llama.py, models/gpt2.py)."""
    w = shape.sliding_window
    attended = float(seq) if w is None or w >= seq else 2.0 * w - w * w / seq
    block = 6.0 * shape.layer_matmul_params + 6.0 * attended * shape.q_dim
    return [block] * shape.layers, 6.0 * shape.vocab * shape.hidden


@lru_cache(maxsize=4096)
def stage_layers(shape: ModelShape, pp: int, v: int, seq: int, split: str = "balanced"
                 ) -> tuple[int, ...]:
    """Blocks per pipeline stage, in stage order (pp x v stages)."""
    n = pp * v
    if n > shape.layers:
        raise PlanError(f"{n} pipeline stages need at least as many layers "
                        f"(the model has {shape.layers})")
    if split == "even":
        q, r = divmod(shape.layers, n)
        return tuple(q + (1 if i < r else 0) for i in range(n))
    if split == "even_ends":
        items, cap = shape.layers + 2, -(-(shape.layers + 2) // n)
        ends = [min(cap, max(0, items - cap * i)) for i in range(n)]  # items per stage
        counts = [c - (i == 0) - (i == n - 1) for i, c in enumerate(ends)]
        if min(counts) < 0:
            raise PlanError(f"pp_split=even_ends cannot cut {shape.layers} layers into {n} "
                            "stages")
        return tuple(counts)
    if split != "balanced":
        raise PlanError(f"pp_split={split!r} must be one of {', '.join(PP_SPLITS)}")
    if n == 1:
        return (shape.layers,)
    costs, head = meshloom_layer_costs(shape, seq)
    return tuple(hi - lo for lo, hi in split_layers(shape.layers, n, costs, head))


@lru_cache(maxsize=4096)
def rank_layers(stages: tuple[int, ...], pp: int) -> tuple[int, ...]:
    """Blocks held by each pipeline rank: the sum over its chunks."""
    return tuple(sum(stages[r::pp]) for r in range(pp))
