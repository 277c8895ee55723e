"""A torch.compile backend for memory censuses: Inductor up to, not including, its code
generation.

What a compiled block keeps for backward is decided before any code is generated: Inductor's
decompositions, its pre-grad and joint-graph passes and its min-cut partitioner (run with
Inductor's fusion rules) split the joint graph, and the forward graph's extra outputs are what
the backward reads. Code generation then only decides how each graph runs. On this machine's
CPUs that half is C++ written and compiled by gcc, about four fifths of each compile: the
memory census (tests/test_plan_memory_census.py) would spend most of its time there for no
check. This backend runs the partitioned graphs as the FX code they are; the census checks
that it packs exactly what full Inductor packs (`test_inductor_code_generation_packs_*`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx


def _run_as_fx(gm: torch.fx.GraphModule, example_inputs: Sequence, **_: object) -> Callable:
    """Inductor's inner compile for one partitioned graph (forward or backward): the graph
    itself, in AOTAutograd's boxed calling convention."""
    return make_boxed_func(gm.forward)


def inductor_front(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
    """torch.compile backend: Inductor's graph passes and partitioner, without its codegen."""
    return compile_fx(gm, example_inputs, inner_compile=_run_as_fx)
