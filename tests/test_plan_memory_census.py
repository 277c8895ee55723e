"""The planner's activation memory for meshloom's own blocks (plan/memory.py,
`meshloom_block_bytes`) against the blocks themselves: the tensors their autograd graph saves
for backward, each storage counted once, measured on CPU at two sequence lengths so that what
does not grow with the tokens (the weights, or autocast's bf16 copies of them) drops out. Both
families (Llama, GPT-2) and both ways meshloom runs bf16: unsharded layouts keep fp32 parameters
under autocast ("amp"), ZeRO stages compute with bf16 working parameters ("bf16"). On one H100
the amp accounting predicts the 1B Llama's measured peaks within 2.3% (test_plan_validation.py).

Two CPU/CUDA differences are corrected here, not in the planner: with bf16 input and bf16
weights, PyTorch's CPU LayerNorm keeps its mean and rstd in bf16 (layer_norm_cpu's
`param_scalar_type`), its CUDA one in fp32 (the accumulation type), 8 bytes more per token for
GPT-2's two norms; and eager dropout on CPU keeps its scaled mask in the input's dtype (2 bytes,
at::dropout's unfused path), on CUDA a 1-byte bool (native_dropout), 1 byte less per element.

Compiled blocks go through `inductor_front` (tests/inductor_front.py): Inductor's passes and
min-cut partitioner, which decide what a graph saves, without its code generation, which only
decides how the graph runs and is most of a compile on CPU; one test holds the two to the same
bytes."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from inductor_front import inductor_front
from torch.profiler import ProfilerActivity, profile

from meshloom.models.gpt2 import GPT2, GPT2Config
from meshloom.models.llama import Llama, LlamaConfig
from meshloom.parallel.activation_checkpointing import apply_block_options
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout
from meshloom.plan.memory import (
    layer_activation_bytes,
    memory_per_gpu,
    meshloom_block_bytes,
    rank_param_split,
)
from meshloom.plan.models import PRESETS, from_dims, from_llama_config
from meshloom.plan.moe import load_factor

CONFIGS = {
    "gqa": dict(dim=256, n_heads=8, n_kv_heads=2, ffn_hidden=768),
    "mha": dict(dim=192, n_heads=6, n_kv_heads=6, ffn_hidden=640),
    "qk_norm+bias": dict(dim=256, n_heads=8, n_kv_heads=4, ffn_hidden=512, qk_norm=True,
                         attention_bias=True),
    "gpt2": dict(dim=256, n_heads=8, ffn_hidden=768),
}
# meshloom's Llama block with an MoE feed-forward (models/moe.py): Mixtral-like, top-1, and
# with a gated shared expert (Qwen2-MoE-like).
MOE_CONFIGS = {
    "mixtral": dict(dim=256, n_heads=8, n_kv_heads=2, n_experts=8, top_k=2, moe_hidden=384),
    "top1": dict(dim=192, n_heads=6, n_kv_heads=6, n_experts=4, top_k=1, moe_hidden=256),
    "shared+gate": dict(dim=256, n_heads=8, n_kv_heads=4, n_experts=8, top_k=4, moe_hidden=128,
                        shared_hidden=512, shared_gate=True),
}
CPU_LAYERNORM_STATS = 8  # see the module docstring
LAYOUT = {"amp": Layout(), "bf16": Layout(zero=1, dp=2)}  # what decides meshloom's precision


def _block(overrides: dict, precision: str = "amp", layers: int = 1):
    torch.manual_seed(0)
    if "n_kv_heads" in overrides:
        cfg = LlamaConfig(n_layers=layers, vocab_size=300, max_seq_len=1024, **overrides)
        model = Llama(cfg)
    else:
        cfg = GPT2Config(n_layers=layers, vocab_size=300, max_seq_len=1024, **overrides)
        model = GPT2(cfg)
    if precision == "bf16":  # a ZeRO stage's working parameters (buffers such as RoPE stay)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    for module in model.modules():  # MoE experts: the grouped GEMM CUDA runs, not the loop
        if hasattr(module, "experts"):
            module.experts.kernel = "grouped"
    return cfg, model


def _shape(cfg):
    if isinstance(cfg, GPT2Config):
        return from_dims("gpt", cfg.dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size,
                         ffn_hidden=cfg.hidden, positions=cfg.max_seq_len,
                         dropout=cfg.dropout > 0)
    return from_llama_config(cfg)


def _cpu_offset(cfg, precision: str) -> int:
    return CPU_LAYERNORM_STATS if isinstance(cfg, GPT2Config) and precision == "bf16" else 0


def _inputs(model, s: int) -> tuple[torch.Tensor, tuple]:
    """A block's input (a leaf, as the embedding's output is to the first block: fp32 under
    amp, bf16 with bf16 parameters) and its extra arguments (Llama's RoPE table)."""
    with torch.no_grad():
        if isinstance(model, Llama):
            h, extra = model.tok_embeddings(torch.randint(0, 300, (1, s))), (model.rope(s),)
        else:
            h, extra = model.wte(torch.randint(0, 300, (1, s))), ()
    return h.clone().requires_grad_(), extra


def _autocast(precision: str):
    return (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "amp"
            else contextlib.nullcontext())


def _run(model, block, s: int, precision: str):
    h, extra = _inputs(model, s)
    with _autocast(precision):
        return block(h, *extra)


def _graph_bytes(out: torch.Tensor) -> int:
    """Bytes of every distinct storage the autograd graph behind `out` saved."""
    seen, storages = set(), {}
    stack = [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for attr in dir(fn):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(fn, attr)
                except RuntimeError:  # a saved tensor already freed
                    continue
                if isinstance(value, torch.Tensor):
                    st = value.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
        stack.extend(f for f, _ in fn.next_functions)
    return sum(storages.values())


@contextlib.contextmanager
def _saved_storages(precision: str, only=None):
    """Under `precision`'s autocast, a dict filled with the bytes of every distinct storage
    packed for backward (a compiled graph's saves too), by storage; `only` filters tensors.
    Each packed tensor is held until the count is read, so that no address is freed and
    reused meanwhile (without, compiled MoE blocks under tp came out 32 bytes short on one
    rank now and then). The hook runs as plain Python: called from the eager stretches of a
    compiled block, it would otherwise be compiled by dynamo too, once more for each new shape
    and dtype up to the recompile limit: seconds a rank, for the same count."""
    storages: dict[int, int] = {}
    held = []

    @torch.compiler.disable
    def pack(t: torch.Tensor) -> torch.Tensor:
        held.append(t)
        if only is None or only(t):
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        return t

    with _autocast(precision), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield storages


def _packed_bytes(model, block, s: int, precision: str) -> int:
    """Bytes of every distinct storage packed for backward (sees a compiled graph's saves)."""
    h, extra = _inputs(model, s)
    with _saved_storages(precision) as storages:
        block(h, *extra)
    return sum(storages.values())


def _alive_bytes(model, block, s: int, precision: str) -> int:
    """Bytes the forward allocated and left alive, its output aside: what a checkpointed block
    keeps (selective recompute's saved matmul outputs sit in the checkpoint's own cache, out of
    reach of saved-tensor hooks), from the CPU profiler's allocation records. The input was
    allocated before, so it is not among them."""
    h, extra = _inputs(model, s)
    # Garbage collected inside the profile would free blocks allocated before it: not counted.
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
                _autocast(precision):
            out = block(h, *extra)
    finally:
        gc.enable()
    return sum(e.self_cpu_memory_usage for e in prof.events()) - out.untyped_storage().nbytes()


@contextlib.contextmanager
def _sac_caches():
    """A list filled with the cache of every selectively checkpointed call (the matmul outputs
    meshloom's policy keeps), for blocks checkpointed while it is open. Unlike the profiler it
    works beside Gloo's threads; one process checks that the two agree."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    import meshloom.parallel.activation_checkpointing as ac

    caches, plain = [], ac._selective_context

    def context():
        caching, cached = create_selective_checkpoint_contexts(ac._policy)
        caches.append(caching.storage)
        return caching, cached

    ac._selective_context = context
    try:
        yield caches
    finally:
        ac._selective_context = plain


def _cached_bytes(cache) -> int:
    """Bytes of the distinct storages one selective checkpoint cached."""
    from torch.utils._pytree import tree_leaves

    storages = {}
    for per_op in cache.values():
        for leaf in tree_leaves(list(per_op.values())):
            leaf = getattr(leaf, "val", leaf)  # the cache wraps tensors with their version
            if isinstance(leaf, torch.Tensor):
                st = leaf.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("precision", ["amp", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_block_saves_what_the_planner_counts(name, precision):
    cfg, model = _block(CONFIGS[name], precision)
    block = model.layers[0]
    longer = _graph_bytes(_run(model, block, 256, precision))
    shorter = _graph_bytes(_run(model, block, 128, precision))
    per_token = (longer - shorter) / 128
    counted = meshloom_block_bytes(_shape(cfg), 1, 1, LAYOUT[precision], "none", fused=False)
    assert counted - _cpu_offset(cfg, precision) == per_token


@pytest.mark.parametrize("name, precision", [("gpt2", "bf16"), ("mixtral", "amp")])
def test_inductor_code_generation_packs_what_its_partition_says(name, precision):
    """The census compiles with `inductor_front` (Inductor without its C++ code generation):
    full Inductor packs the same storages, byte for byte, at both lengths. AOTAutograd's
    default partitioner packs other bytes on these blocks, so the census does see which
    partitioner ran."""
    def packed(backend) -> list[int]:
        torch._dynamo.reset()
        _, model = _block({**CONFIGS, **MOE_CONFIGS}[name], precision)
        block = torch.compile(model.layers[0], backend=backend, dynamic=False)
        return [_packed_bytes(model, block, s, precision) for s in (256, 512)]

    front = packed(inductor_front)
    assert packed("inductor") == front
    assert packed("aot_eager") != front


@pytest.mark.parametrize("name, precision", [("gqa", "amp"), ("gqa", "bf16"), ("gpt2", "amp"),
                                             ("gpt2", "bf16")])
def test_compiled_block_saves_what_the_planner_counts(name, precision):
    cfg, model = _block(CONFIGS[name], precision)
    block = torch.compile(model.layers[0], backend=inductor_front, dynamic=False)
    per_token = (_packed_bytes(model, block, 512, precision)
                 - _packed_bytes(model, block, 256, precision)) / 256
    counted = meshloom_block_bytes(_shape(cfg), 1, 1, LAYOUT[precision], "none", fused=True)
    assert counted - _cpu_offset(cfg, precision) == per_token


@pytest.mark.parametrize("precision", ["amp", "bf16"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("name", ["gqa", "gpt2", "gpt2+dropout"])
def test_checkpointed_block_keeps_what_the_planner_counts(name, recompute, precision):
    """`gpt2+dropout`: CPU's SDPA runs attention dropout on its math path, whose batched
    matmuls selective reruns with the rest of the attention core (it kept their scores, growing
    with the square of the sequence, until batched matmuls were left out of the saved ops)."""
    overrides = CONFIGS["gpt2"] | {"dropout": 0.1} if name == "gpt2+dropout" else CONFIGS[name]
    cfg, model = _block(overrides, precision)
    with _sac_caches() as caches:
        apply_block_options(model, recompute)  # meshloom's own checkpointing and policy
        block = model.layers[0]
        per_token = (_alive_bytes(model, block, 512, precision)
                     - _alive_bytes(model, block, 256, precision)) / 256
    held_input = (4 if precision == "amp" else 2) * cfg.dim  # the checkpoint keeps its input
    counted = meshloom_block_bytes(_shape(cfg), 1, 1, LAYOUT[precision], recompute, fused=False)
    assert counted == per_token + held_input
    if recompute == "selective":  # what stays alive is the cache: the two measures agree
        assert (_cached_bytes(caches[0]) - _cached_bytes(caches[1])) / 256 == per_token  # 512, 256


@pytest.mark.parametrize("precision", ["amp", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_moe_block_keeps_what_the_planner_counts(name, recompute, precision):
    """meshloom's MoE block (dropless, every expert here: load factor 1), eager, on the grouped
    GEMM path CUDA runs: what its graph saves, or with recompute what stays alive."""
    cfg, model = _block(MOE_CONFIGS[name], precision)
    model.eval()  # routing statistics are bookkeeping, allocated on the first call only
    counted = meshloom_block_bytes(_shape(cfg), 1, 1, LAYOUT[precision], recompute,
                                   fused=False)
    if recompute == "none":
        block = model.layers[0]
        per_token = (_packed_bytes(model, block, 512, precision)
                     - _packed_bytes(model, block, 256, precision)) / 256
        assert counted == per_token
        return
    apply_block_options(model, recompute)
    block = model.layers[0]
    per_token = (_alive_bytes(model, block, 512, precision)
                 - _alive_bytes(model, block, 256, precision)) / 256
    assert counted == per_token + (4 if precision == "amp" else 2) * cfg.dim  # held input


@pytest.mark.parametrize("name, compiled", [(n, False) for n in MOE_CONFIGS]
                         + [("mixtral", True)])
def test_moe_block_saves_bf16_copies_of_every_weight_under_autocast(name, compiled):
    """The bf16 tensors an amp MoE block saves that do not grow with the tokens: the weight
    copies `weight_copy_bytes` counts (attention, router, shared expert, the stacked experts),
    eager or compiled."""
    from meshloom.plan.memory import weight_copy_bytes

    torch._dynamo.reset()
    cfg, model = _block(MOE_CONFIGS[name], "amp")
    model.eval()
    block = torch.compile(model.layers[0], backend=inductor_front, dynamic=False) if compiled \
        else model.layers[0]

    def bf16_saved(s: int) -> int:
        h, extra = _inputs(model, s)
        with _saved_storages("amp", lambda t: t.dtype == torch.bfloat16) as storages:
            block(h, *extra)
        return sum(storages.values())

    if compiled:  # compile at both lengths first, then count
        bf16_saved(256), bf16_saved(512)
    constant = 2 * bf16_saved(256) - bf16_saved(512)
    shape = _shape(cfg)
    head = 2 * shape.vocab * shape.hidden  # the last rank's head copy, not in the block
    impl = Implementation(compile=compiled)
    assert weight_copy_bytes(shape, Layout(), 0, "bf16", impl) - head == constant


# Compiled MoE blocks: the Mixtral-like base and variants in each dimension of the count.
MOE_COMPILED = {
    "mixtral": MOE_CONFIGS["mixtral"],
    "wider experts, top 1": MOE_CONFIGS["mixtral"] | dict(moe_hidden=256, top_k=1, n_experts=4),
    "h192": MOE_CONFIGS["mixtral"] | dict(dim=192, n_heads=6),
    "shared+gate": MOE_CONFIGS["shared+gate"],
    "shared": MOE_CONFIGS["mixtral"] | dict(shared_hidden=512),
}


@pytest.mark.parametrize("name, precision", [(n, "amp") for n in MOE_COMPILED]
                         + [("mixtral", "bf16"), ("shared+gate", "bf16")])
def test_compiled_moe_block_saves_what_the_planner_counts(name, precision):
    torch._dynamo.reset()  # a fresh compile per case (dynamo's recompile limit)
    cfg, model = _block(MOE_COMPILED[name], precision)
    model.eval()
    block = torch.compile(model.layers[0], backend=inductor_front, dynamic=False)
    per_token = (_packed_bytes(model, block, 512, precision)
                 - _packed_bytes(model, block, 256, precision)) / 256
    assert meshloom_block_bytes(_shape(cfg), 1, 1, LAYOUT[precision], "none", fused=True) \
        == per_token


# Router options against the Mixtral-like base (softmax, renormalised top 2 of 8): each rule of
# `router_weight_bytes` on both sides of its threshold (inductor keeps a reduction's output only
# when it is over 4x smaller than its input: the sum of k > 4 weights, of E > 4 sigmoid scores).
ROUTERS = {
    "sigmoid": MOE_CONFIGS["mixtral"] | dict(router_score="sigmoid"),
    "unnormalised": MOE_CONFIGS["mixtral"] | dict(router_norm=False),
    "sigmoid, unnormalised, top 1 of 4": MOE_CONFIGS["mixtral"] | dict(
        router_score="sigmoid", router_norm=False, n_experts=4, top_k=1),
    "top 8 of 16": MOE_CONFIGS["mixtral"] | dict(n_experts=16, top_k=8, moe_hidden=128),
    "sigmoid, top 5 of 16": MOE_CONFIGS["mixtral"] | dict(
        router_score="sigmoid", n_experts=16, top_k=5, moe_hidden=128),
}


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name, precision", [(n, "amp") for n in ROUTERS] + [("sigmoid", "bf16")])
def test_router_options_save_what_the_planner_counts(name, precision, compiled):
    torch._dynamo.reset()
    cfg, model = _block(ROUTERS[name], precision)
    model.eval()
    block = torch.compile(model.layers[0], backend=inductor_front, dynamic=False) if compiled \
        else model.layers[0]
    per_token = (_packed_bytes(model, block, 512, precision)
                 - _packed_bytes(model, block, 256, precision)) / 256
    assert meshloom_block_bytes(_shape(cfg), 1, 1, LAYOUT[precision], "none", fused=compiled) \
        == per_token


# The expert-parallel censuses: the experts over 2 data-parallel ranks, over 2 context-parallel
# ranks (each with its zigzag slice of one sequence), over 2 data-parallel ranks that are
# each a 2-rank tensor-parallel group (4 ranks), or over 2 context-parallel ranks that are
# (tp, cp and ep at once, 4 ranks).
EP_MESHES = {"dp": dict(dp_shard=2), "cp": dict(cp=2), "tp": dict(dp_shard=2, tp=2),
             "tp+cp": dict(cp=2, tp=2)}


def _ep_census_job(world: int, precision: str, name: str, compiled: bool, axis: str,
                   sp: bool, recompute: str = "none") -> dict:
    """Per (layers, the rank's tokens) on one rank of an expert-parallel layout (`EP_MESHES`):
    the bytes its model keeps for backward (with selective recompute the checkpoints' caches
    too), and the routed rows its experts received."""
    import os

    import torch.distributed as dist

    import meshloom.parallel.context as context
    from meshloom.comm import CommCounter
    from meshloom.config import ParallelConfig
    from meshloom.mesh import Mesh, ParallelDims
    from meshloom.models.moe import moe_blocks
    from meshloom.parallel import parallelize

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    # One fresh compile per job, and one mesh: the 2-layer model's blocks reuse the 1-layer
    # model's code, as a model's blocks share theirs (a second mesh's new process groups would
    # fail the guards on the compiled collectives' group names: all compiled again).
    torch._dynamo.reset()
    dims = {"dp_shard": 1, **EP_MESHES[axis]}
    mesh = Mesh(ParallelDims(**dims, ep=2), rank, "cpu", CommCounter())
    for layers in (1, 2):
        _, model = _block(MOE_COMPILED[name], precision, layers)
        pcfg = ParallelConfig(**dims, ep=2, zero_stage=0, sequence_parallel=sp)
        with _sac_caches() as caches:  # open from the wrapping on (it binds the context)
            par = parallelize(model, mesh, pcfg, activation_checkpointing=recompute,
                              compile_blocks=compiled, compile_backend=inductor_front)
            for s in (128, 256):
                if "cp" in axis:  # one sequence, the rank's zigzag slice of it
                    torch.manual_seed(100 + s)
                    idx = context.zigzag_indices(2 * s, 2, mesh.coord("cp"))
                    args = (torch.randint(0, 300, (1, 2 * s))[:, idx], idx)
                else:  # each data-parallel rank its own tokens (a tp group shares them)
                    torch.manual_seed(100 + mesh.coord("dp_shard") + s)
                    args = (torch.randint(0, 300, (1, s)),)
                if compiled:  # compile first, then count
                    with _autocast(precision):
                        par.model(*args)
                for _, moe in moe_blocks(par.model):
                    moe.reset_stats()
                caches.clear()
                with _saved_storages(precision) as storages:
                    par.model(*args)
                rows, e = 0.0, mesh.coord("ep")
                for _, moe in moe_blocks(par.model):  # the ep group's assignments per expert
                    load = moe.stats.load.clone().float()
                    dist.all_reduce(load, group=mesh.group("ep"))
                    mine = load.numel() // 2
                    rows += float(load[e * mine:(e + 1) * mine].sum())
                kept = sum(storages.values()) + sum(map(_cached_bytes, caches))
                out[(layers, s)] = (kept, rows)
    dist.destroy_process_group()
    return out


def _ep_leftovers(precision: str, name: str, compiled: bool, axis: str = "dp",
                  sp: bool = False, recompute: str = "none") -> set:
    """With expert parallel, routing (and so each rank's received rows) differs from rank to
    rank and run to run: what is left of a rank's saved bytes per layer once the planner's
    per-token and per-row terms are taken off, for each rank and length. Right terms leave one
    value, the weights a layer adds; a wrong term leaves one that moves with the length or the
    rows."""
    from dist_harness import run_ranks

    from meshloom.plan.memory import (
        moe_compiled_local_bytes_per_token,
        moe_local_bytes_per_token,
        moe_routed_row_bytes,
    )

    cfg, _ = _block(MOE_COMPILED[name])
    axes = {"dp": 2} | {k: v for k, v in EP_MESHES[axis].items() if k != "dp_shard"}
    shape = _shape(cfg)
    lay = Layout(**axes, ep=2, sp=sp, zero=LAYOUT[precision].zero)
    if recompute == "none":
        local = moe_compiled_local_bytes_per_token if compiled else moe_local_bytes_per_token
        per_token = local(shape, lay, precision == "amp")
        per_row = moe_routed_row_bytes(shape, lay, compiled)
    else:  # the checkpoint's input; selective: the matmul outputs, the experts' per row
        per_row = 2 * (2 * shape.moe_hidden + shape.hidden) if recompute == "selective" else 0
        routed = load_factor(shape, lay) * shape.top_k * per_row / (lay.tp if sp else 1)
        per_token = meshloom_block_bytes(shape, 1, 1, lay, recompute, compiled) - routed
    world = 4 if "tp" in axis else 2
    per_layer = set()
    for runs in run_ranks(_ep_census_job, world, world, precision, name, compiled, axis, sp,
                          recompute, timeout=900):
        left = {key: saved - per_token * key[0] * key[1] - per_row * rows
                for key, (saved, rows) in runs.items()}
        per_layer |= {left[(2, s)] - left[(1, s)] for s in (128, 256)}
    return per_layer


@pytest.mark.parametrize("precision, axis, sp", [("amp", "dp", False), ("bf16", "dp", False),
                                                 ("amp", "cp", False), ("amp", "tp", True),
                                                 ("amp", "tp+cp", True)])
def test_expert_parallel_block_saves_what_the_planner_counts(precision, axis, sp):
    """The experts over data-parallel ranks; over context-parallel ones, where the ring's 4 kv
    per token comes on top; over data-parallel ranks that are tensor-parallel groups with SP,
    where the norms and the whole feed-forward run on the rank's 1/t slice; and over
    context-parallel ranks that are such groups, where the terms compose."""
    assert len(_ep_leftovers(precision, "mixtral", False, axis, sp)) == 1


@pytest.mark.parametrize("recompute, compiled", [("selective", False), ("full", False),
                                                ("selective", True)])
def test_recomputed_expert_parallel_block_keeps_what_the_planner_counts(recompute, compiled):
    """Recompute reruns the dispatch (its all-to-alls too): selective keeps the block input and
    the matmul outputs, on the expert's rank the grouped GEMMs' three per routed row (2F_e + h),
    and none of the received rows or regrouping indices; full keeps the input alone. Compiled,
    routing's host reads break the block, so the checkpoint runs eagerly and keeps the same."""
    assert len(_ep_leftovers("amp", "mixtral", compiled, recompute=recompute)) == 1


@pytest.mark.parametrize("name, precision, axis", [("wider experts, top 1", "amp", "dp"),
                                                   ("wider experts, top 1", "amp", "cp"),
                                                   ("shared+gate", "bf16", "tp"),
                                                   ("wider experts, top 1", "amp", "tp+cp")])
def test_compiled_expert_parallel_block_saves_what_the_planner_counts(name, precision, axis):
    """Compiled, the all-to-all breaks the block where one graph spanned the dispatch: the
    combined output is no longer kept (amp 4h), the routed rows keep SwiGLU's three tensors and
    the regrouping indices. Top 1 tells that 4h per token from 2h per assignment (at top 2 the
    two are equal). Over context-parallel ranks the ring adds its 4 kv; under tp with SP
    (4 ranks) everything but attention's heads and the gathered first norm is a 1/t slice."""
    assert len(_ep_leftovers(precision, name, True, axis, sp="tp" in axis)) == 1


def test_census_for_meshloom_dense_bf16_blocks_only():
    lay, zero = Layout(micro_batch=1), Layout(micro_batch=1, zero=1, dp=2)
    ideal = Implementation(meshloom_block=False, expand_kv=False)  # Korthikanti's block
    for shape in (PRESETS["llama3-1b"], PRESETS["gpt2-large"]):
        for layout in (lay, zero):
            census = layer_activation_bytes(shape, 2048, 1, layout, "bf16",
                                            impl=Implementation())
            assert census == meshloom_block_bytes(shape, 2048, 1, layout, "none", fused=False)
            assert layer_activation_bytes(shape, 2048, 1, layout, "bf16", impl=ideal) \
                == layer_activation_bytes(shape, 2048, 1, layout, "bf16")  # Korthikanti's
        # Under autocast the fp32 residual stream and per-projection casts keep more than
        # bf16 working parameters do.
        assert layer_activation_bytes(shape, 2048, 1, lay, "bf16", impl=Implementation()) \
            > layer_activation_bytes(shape, 2048, 1, zero, "bf16", impl=Implementation())
    # MoE blocks: census eager and compiled, with and without ep (tensor and context parallel
    # too); another trainer's block (meshloom_block off): Korthikanti's count.
    moe = PRESETS["mixtral-8x7b"]
    compiled = Implementation(compile=True)
    for layout, impl, census in ((lay, Implementation(), True),
                                 (Layout(micro_batch=1, tp=2, sp=True), Implementation(), True),
                                 (lay, compiled, True),
                                 (Layout(micro_batch=1, tp=2), compiled, True),
                                 (Layout(micro_batch=1, dp=8, ep=2), compiled, True),
                                 (Layout(micro_batch=1, dp=4, cp=2, ep=2), compiled, True),
                                 (Layout(micro_batch=1, dp=4, tp=2, ep=2), compiled, True),
                                 (Layout(micro_batch=1, dp=8, ep=2),
                                  Implementation(compile=True, meshloom_block=False), False)):
        got = layer_activation_bytes(moe, 2048, 1, layout, "bf16", impl=impl)
        assert (got == meshloom_block_bytes(moe, 2048, 1, layout, "none", impl.compile)) \
            == census
    # fp32 runs without autocast: not the census but the per-tensor count, in which the K and
    # V meshloom's block copies out to every query head (expand_kv) are saved at q's width.
    llama = PRESETS["llama3-1b"]
    native = Implementation(expand_kv=False)
    assert layer_activation_bytes(llama, 2048, 1, lay, "fp32", impl=native) \
        == layer_activation_bytes(llama, 2048, 1, lay, "fp32")
    assert layer_activation_bytes(llama, 2048, 1, lay, "fp32", impl=Implementation()) \
        == layer_activation_bytes(llama, 2048, 1, lay, "fp32", impl=native) \
        + 2048 * 2 * (llama.q_dim - llama.kv_dim) * 4


def test_compiled_keeps_less_than_eager_and_recompute_less_again():
    shape = PRESETS["llama3-1b"]
    eager, fused = Implementation(), Implementation(compile=True)
    total = {(rec, impl.compile): memory_per_gpu(
        shape, Layout(micro_batch=8, recompute=rec), 2048, 8, impl=impl).activations
        for rec in ("none", "selective", "full") for impl in (eager, fused)}
    for c in (False, True):
        assert total[("none", c)] > total[("selective", c)] > total[("full", c)]
    for rec in ("none", "selective", "full"):
        assert total[(rec, True)] < total[(rec, False)]


def test_gradients_leave_the_peak_only_for_a_loop_that_frees_them():
    shape = PRESETS["llama3-1b"]
    lay = Layout(micro_batch=8)
    kept = memory_per_gpu(shape, lay, 2048, 8, impl=Implementation(free_unbucketed_grads=False))
    freed = memory_per_gpu(shape, lay, 2048, 8, impl=Implementation(grad_clip=False))
    assert kept.grads == 4 * shape.params and freed.grads == 0  # fp32 gradients, unsharded
    accumulating = memory_per_gpu(shape, lay, 2048, 16, impl=Implementation(grad_clip=False))
    assert accumulating.grads == kept.grads  # the second micro-batch adds into them
    # meshloom's loop frees what no data-parallel bucket holds (one GPU), keeps its buckets
    assert memory_per_gpu(shape, lay, 2048, 8).grads == 0
    ddp = memory_per_gpu(shape, Layout(dp=2, micro_batch=8), 2048, 16)
    assert ddp.grads == kept.grads


def _census_job(world: int, axis: str, precision: str, name: str, recompute: str = "none",
                compiled: bool = False, sp: bool = False, explicit_ring: bool = False) -> float:
    """Per token and layer, the bytes one rank of a tp or cp group keeps for backward: what the
    whole model packs (a checkpoint's input too: it saves its arguments), plus with selective
    recompute the checkpoints' caches, at 1 and 2 layers and two lengths (what does not scale
    with both, the weights and the rest of the model, drops out of the double difference).
    Per token of the sequence under tp, of the rank's slice under cp. `axis` "tp+cp": 2 x 2
    on 4 ranks. `explicit_ring`: the ring's per-block matmuls (what devices without CPU's fused
    kernel run)."""
    import os

    import torch.distributed as dist

    import meshloom.parallel.context as context
    from meshloom.comm import CommCounter
    from meshloom.config import ParallelConfig
    from meshloom.mesh import Mesh, ParallelDims
    from meshloom.parallel import parallelize

    if explicit_ring:
        context._fused_cpu = lambda q: False
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = {"tp": 2, "cp": 2} if axis == "tp+cp" else {axis: world}
    kept = {}
    # One mesh for both models, so that the 2-layer model's blocks run the code compiled for
    # the 1-layer model's, as a model's blocks share theirs (a new mesh's process groups would
    # fail the compiled graphs' guards on their collectives' group names: all compiled again).
    mesh = Mesh(ParallelDims(**dims), rank, "cpu", CommCounter())
    for layers in (1, 2):
        _, model = _block({**CONFIGS, **MOE_CONFIGS}[name], precision, layers)
        model.eval()  # MoE routing statistics: bookkeeping, allocated on the first call only
        with _sac_caches() as caches:
            pcfg = ParallelConfig(**dims, dp_shard=1, sequence_parallel=sp)
            par = parallelize(model, mesh, pcfg, activation_checkpointing=recompute,
                              compile_blocks=compiled, compile_backend=inductor_front)
            for s in (256, 512):
                tokens = torch.randint(0, 300, (1, s))
                args = (tokens,)
                if "cp" in dims:  # the rank's zigzag slice, with its positions
                    idx = context.zigzag_indices(s, dims["cp"], mesh.coord("cp"))
                    args = (tokens[:, idx], idx)
                if compiled:  # compile first, then count
                    with _autocast(precision):
                        par.model(*args)
                caches.clear()
                with _saved_storages(precision) as packed:
                    par.model(*args)
                kept[(layers, s)] = sum(packed.values()) + sum(map(_cached_bytes, caches))
    dist.destroy_process_group()
    twice = kept[(2, 512)] - kept[(1, 512)] - kept[(2, 256)] + kept[(1, 256)]
    return twice / (256 / dims.get("cp", 1))


def _counted(name: str, precision: str, recompute: str = "none", compiled: bool = False,
             **axes) -> float:
    """The planner's count for one rank of a 2-rank tp or cp group (`axes`), with the CPU
    LayerNorm correction when the norms' statistics are kept (a 1/t slice under SP, as the
    norms are)."""
    cfg, _ = _block({**CONFIGS, **MOE_CONFIGS}[name])
    lay = Layout(**axes, zero=LAYOUT[precision].zero, dp=LAYOUT[precision].dp)
    counted = meshloom_block_bytes(_shape(cfg), 1, 1, lay, recompute, fused=compiled)
    if recompute != "none":  # the norms are rerun
        return counted
    return counted - _cpu_offset(cfg, precision) / (lay.tp if lay.sp else 1)


@pytest.mark.parametrize("precision", ["amp", "bf16"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("name", ["gqa", "gpt2", "mixtral", "shared+gate"])
def test_tensor_parallel_block_saves_what_the_planner_counts(name, sp, precision):
    from dist_harness import run_ranks

    counted = _counted(name, precision, tp=2, sp=sp)
    assert run_ranks(_census_job, 2, 2, "tp", precision, name, "none", False, sp) \
        == [counted, counted]


# Compiled under tp: Llama amp with and without SP, and one SP case each of Llama in bf16 and
# GPT-2 (each case is 15-20 s of tracing and partitioning here; the other combinations matched
# when checked).
@pytest.mark.parametrize("name, precision, sp", [("gqa", "amp", False), ("gqa", "amp", True),
                                                 ("gqa", "bf16", True), ("gpt2", "amp", True)])
def test_compiled_tensor_parallel_block_saves_what_the_planner_counts(name, precision, sp):
    from dist_harness import run_ranks

    counted = _counted(name, precision, compiled=True, tp=2, sp=sp)
    assert run_ranks(_census_job, 2, 2, "tp", precision, name, "none", True, sp,
                     timeout=600) == [counted, counted]


@pytest.mark.parametrize("precision", ["amp", "bf16"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("name", ["gqa", "gpt2", "mixtral", "shared+gate"])
def test_tensor_parallel_selective_block_keeps_what_the_planner_counts(name, sp, precision):
    from dist_harness import run_ranks

    counted = _counted(name, precision, "selective", tp=2, sp=sp)
    assert run_ranks(_census_job, 2, 2, "tp", precision, name, "selective", False, sp) \
        == [counted, counted]


@pytest.mark.parametrize("name, precision", [("gqa", "amp"), ("gpt2", "bf16"),
                                             ("gpt2+dropout", "amp")])
def test_compiled_selective_block_keeps_what_the_planner_counts(name, precision):
    """Compiled as one graph, the checkpointed block's saves are its graph's: the policy's
    matmul outputs but the down projection's, which the backward never reads. With attention
    dropout the compiled graph multiplies the scores itself (SDPA's math path); they are rerun,
    not kept."""
    torch._dynamo.reset()
    overrides = CONFIGS["gpt2"] | {"dropout": 0.1} if name == "gpt2+dropout" else CONFIGS[name]
    cfg, model = _block(overrides, precision)
    apply_block_options(model, "selective", compile_blocks=True,
                        compile_backend=inductor_front)
    block = model.layers[0]
    per_token = (_packed_bytes(model, block, 512, precision)
                 - _packed_bytes(model, block, 256, precision)) / 256
    counted = meshloom_block_bytes(_shape(cfg), 1, 1, LAYOUT[precision], "selective", fused=True)
    assert counted == per_token  # the input is packed too: the checkpoint saves its arguments
    eager = meshloom_block_bytes(_shape(cfg), 1, 1, LAYOUT[precision], "selective", fused=False)
    assert eager - counted == 2 * cfg.dim


def test_compiled_selective_tensor_parallel_block_keeps_the_eager_count():
    """Under tp the compiled block is one graph with its collectives, whose outputs the compiler
    keeps rather than rerun: it keeps the eager count, down projection included (also measured
    on 4 ranks, with and without SP, for GPT-2)."""
    from dist_harness import run_ranks

    cfg, _ = _block(CONFIGS["gqa"])
    lay = Layout(tp=2, sp=True)
    counted = meshloom_block_bytes(_shape(cfg), 1, 1, lay, "selective", fused=True)
    assert counted == meshloom_block_bytes(_shape(cfg), 1, 1, lay, "selective", fused=False)
    assert run_ranks(_census_job, 2, 2, "tp", "amp", "gqa", "selective", True, True,
                     timeout=600) == [counted, counted]


@pytest.mark.parametrize("name, compiled", [("gqa", False), ("gpt2", True)])
def test_tensor_and_context_parallel_block_saves_what_the_planner_counts(name, compiled):
    """tp 2 x cp 2 with SP, 4 ranks: the tp and cp terms compose. Compiled GPT-2 under amp
    keeps the fp32 residual around the ring in place of the attention's reduced output.
    (Also measured: Llama eager without SP, compiled amp and bf16 with SP, compiled amp
    without; GPT-2 compiled amp without SP and bf16 with; selective, eager and compiled.)"""
    from dist_harness import run_ranks

    counted = _counted(name, "amp", compiled=compiled, tp=2, cp=2, sp=True)
    assert run_ranks(_census_job, 4, 4, "tp+cp", "amp", name, "none", compiled, True,
                     timeout=900) == [counted] * 4


@pytest.mark.parametrize("precision", ["amp", "bf16"])
@pytest.mark.parametrize("name", ["gqa", "mha", "gpt2", "mixtral"])
def test_context_parallel_block_saves_what_the_planner_counts(name, precision):
    """Ring attention keeps K and V with their own heads and an fp32 output (4 kv more per
    token than SDPA's repeated K and V): the count on each of 2 cp ranks."""
    from dist_harness import run_ranks

    counted = _counted(name, precision, cp=2)
    assert run_ranks(_census_job, 2, 2, "cp", precision, name) == [counted, counted]


@pytest.mark.parametrize("name, precision", [("gqa", "bf16"), ("gpt2", "amp"),
                                             ("mixtral", "amp")])
def test_compiled_context_parallel_block_saves_what_the_planner_counts(name, precision):
    from dist_harness import run_ranks

    counted = _counted(name, precision, compiled=True, cp=2)
    assert run_ranks(_census_job, 2, 2, "cp", precision, name, "none", True,
                     timeout=600) == [counted, counted]


@pytest.mark.parametrize("name, precision, sp", [("mixtral", "amp", False),
                                                 ("mixtral", "bf16", True),
                                                 ("shared+gate", "amp", True)])
def test_compiled_tensor_parallel_moe_block_saves_what_the_planner_counts(name, precision, sp):
    from dist_harness import run_ranks

    counted = _counted(name, precision, compiled=True, tp=2, sp=sp)
    assert run_ranks(_census_job, 2, 2, "tp", precision, name, "none", True, sp,
                     timeout=600) == [counted, counted]


@pytest.mark.parametrize("explicit_ring", [False, True])
def test_selective_recompute_reruns_the_whole_ring(explicit_ring):
    """Under cp, selective recompute keeps the matmul outputs and the input, not the ring's
    tensors; with the ring's explicit per-block matmuls (CUDA's path) the policy must not keep
    their score blocks either (it did: 2.5x the count at these lengths, growing with them)."""
    from dist_harness import run_ranks

    counted = _counted("gqa", "amp", "selective", cp=2)
    assert run_ranks(_census_job, 2, 2, "cp", "amp", "gqa", "selective", False, False,
                     explicit_ring) == [counted, counted]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("precision", ["amp", "bf16"])
def test_gpt2_dropout_keeps_its_residual_masks(precision, compiled):
    cfg, model = _block(CONFIGS["gpt2"] | {"dropout": 0.1}, precision)
    model.train()
    block = model.layers[0]
    # CPU's SDPA runs attention dropout on its math path, which keeps the probabilities; CUDA's
    # flash kernel keeps only its RNG state, so the attention's own dropout is left out here.
    block.attn.attn_dropout = 0.0
    if compiled:
        block = torch.compile(block, backend=inductor_front, dynamic=False)
    per_token = (_packed_bytes(model, block, 512, precision)
                 - _packed_bytes(model, block, 256, precision)) / 256
    counted = meshloom_block_bytes(_shape(cfg), 1, 1, LAYOUT[precision], "none",
                                   fused=compiled)
    cpu_masks = 0 if compiled else 2 * cfg.dim  # see the module docstring
    assert counted - _cpu_offset(cfg, precision) + cpu_masks == per_token
    plain = from_dims("gpt", cfg.dim, 1, cfg.n_heads, cfg.vocab_size, ffn_hidden=cfg.hidden,
                      positions=cfg.max_seq_len, dropout=False)
    assert counted - meshloom_block_bytes(plain, 1, 1, LAYOUT[precision], "none",
                                          fused=compiled) == 2 * cfg.dim  # two 1-byte masks


def test_explain_says_how_activations_were_counted():
    from meshloom.plan.memory import activation_accounting

    shape, lay = PRESETS["llama3-8b"], Layout(micro_batch=1)
    assert activation_accounting(shape, lay, "bf16", True, Implementation()) \
        == "meshloom's Llama block census: fp32 parameters under autocast, eager, no recompute"
    assert "bf16 working parameters (ZeRO), compiled" in activation_accounting(
        shape, Layout(zero=3, dp=2), "bf16", True, Implementation(compile=True))
    assert activation_accounting(shape, lay, "bf16", True, Implementation(meshloom_block=False)) \
        .startswith("Korthikanti")
    assert activation_accounting(shape, lay, "bf16", False, Implementation()) \
        .startswith("Korthikanti")  # eager attention: not meshloom's block
    assert memory_per_gpu(shape, lay, 2048, 1).counted_as.startswith("meshloom's Llama")


def test_a_run_spread_over_rank_devices_gets_no_per_device_prediction():
    """`parallel.rank_devices` puts one rank's blocks on several devices; the planner's figure
    is for one device per rank, so the run's summary gets the reason instead of a wrong total.
    ZeRO-3 with `parallel.reshard_after_forward=false` gets its own figure: every unit
    gathered at the peak."""
    from dataclasses import replace

    from meshloom.config import Config
    from meshloom.mesh import ParallelDims
    from meshloom.plan import PlanError
    from meshloom.plan.memory import predict_run_memory

    cfg, _ = _block(CONFIGS["gqa"])
    run = Config()
    assert predict_run_memory(cfg, run, ParallelDims(), 1).total > 0
    spread = replace(run, parallel=replace(run.parallel, rank_devices=2))
    with pytest.raises(PlanError, match="parallel.rank_devices"):
        predict_run_memory(cfg, spread, ParallelDims(), 1)
    zero3, dims = replace(run.parallel, zero_stage=3), ParallelDims(dp_shard=2)
    deep = replace(cfg, n_layers=4)  # more blocks than ZeRO-3 gathers at once when resharding
    resharded = predict_run_memory(deep, replace(run, parallel=zero3), dims, 1)
    kept = predict_run_memory(
        deep, replace(run, parallel=replace(zero3, reshard_after_forward=False)), dims, 1)
    assert resharded.held_units == 0 < resharded.root_unit
    assert kept.root_unit == 0 < kept.held_units
    assert kept.total > resharded.total
    # `parallel.reduce_once` holds whole fp32 gradients when the step has several
    # micro-batches: 4 bytes for each of the rank's parameters, at the peak instead of the
    # shards (made by the last reduce).
    once = replace(run, parallel=replace(zero3, reduce_once=True))
    several = replace(once, train=replace(run.train, global_batch=8))
    plain = replace(run, train=replace(run.train, global_batch=8), parallel=zero3)
    params = sum(rank_param_split(from_llama_config(deep, "run"), Layout(dp=2, zero=3), 0))
    assert predict_run_memory(deep, plain, dims, 1).grads > 0
    assert predict_run_memory(deep, several, dims, 1).grads == pytest.approx(4 * params)
    assert predict_run_memory(deep, once, dims, run.train.global_batch // 2).total == \
        predict_run_memory(deep, replace(run, parallel=zero3), dims,
                           run.train.global_batch // 2).total
