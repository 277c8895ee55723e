"""Memory per GPU of a layout: model states, activations, buffers and the CUDA context.

Model states come from `formulas.model_state_bytes` (the formulas the ZeRO code is tested
against). Activations follow Korthikanti et al. (arXiv 2205.05198, Table 2): per layer
sbh(10 + 24/t + 5as/(ht)) bytes for the GPT block in 16-bit, all of it divided by t with
sequence parallelism, the attention-core term dropped by selective recompute, and only the
layer input (2sbh) kept by full recompute. We derive the same terms for the Llama block (below).
How many micro-batches a pipeline rank holds comes from walking the schedule's own action
lists (`pipeline_schedule.compute_lists`), the lists the pipeline executor runs.
A mixture-of-experts block's routed experts are counted apart from the rest (plan/moe.py): split
over ep, ZeRO-sharded over the expert shard degree, not split over tp.

With `Implementation.meshloom_block` (the default) a dense Llama or GPT-2 block in bf16, and
an MoE Llama block (eager, or compiled without tensor or expert parallel), is counted as
meshloom's own block keeps it (`meshloom_block_bytes`), term by term from its autograd graph,
both as unsharded layouts run it (fp32 parameters under autocast) and as ZeRO stages do (bf16
working parameters); tests/test_plan_memory_census.py walks that graph on CPU and checks the
count. On one H100 this predicts the 1B Llama's measured peaks, eager and
compiled, with and without recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from meshloom.parallel.pipeline_schedule import compute_lists
from meshloom.plan import PlanError
from meshloom.plan.formulas import FP32, MIXED, Precision, model_state_bytes
from meshloom.plan.implementation import (
    MESHLOOM,
    OPTIMIZER_STATES,
    TORCH_BUCKET_BYTES,
    Implementation,
    autocast_weights,
    fp32_gradient_shards,
    fp32_working_params,
    head_tp,
    keeps_grads,
    loss_kind,
    loss_vocab_share,
    residual_stream,
    table_tp,
    whole_fp32_states,
    whole_grad_bytes,
    zero3_no_sync,
    zero3_resharded,
)
from meshloom.plan.layout import Layout
from meshloom.plan.models import ModelShape
from meshloom.plan.moe import (
    activation_bytes_per_token,
    dispatch_bytes,
    expert_shard,
    expert_tp,
    ffn_tokens,
    load_factor,
)
from meshloom.plan.stages import rank_layers, stage_layers
from meshloom.plan.step_kernels import ATTENTION_GEMMS, block_gemms, stream_casts

# The CUDA context plus library workspaces (cuBLAS, NCCL) per GPU, outside the allocator's
# count. A layout fits when its peak of allocated bytes plus this is at most the GPU's memory:
# PyTorch's allocator frees its cached blocks and retries before it fails, so the cache it
# reserves above the allocated peak (0.2-5.5 GB on the H100 runs, docs/plan.md) is not a limit.
CONTEXT_BYTES = 1.0e9


def precision(dtype: str):
    return MIXED if dtype == "bf16" else FP32


@lru_cache(maxsize=64)
def _state_precision(dtype: str, fp32_masters: bool, optimizer_state: str) -> Precision:
    """Bytes per parameter of the model states. `fp32_masters`: meshloom's unsharded layouts
    and any layout under `fp32_params`, whose parameters are the fp32 masters (autocast
    computes)."""
    prec = precision(dtype)
    if fp32_masters:
        return FP32
    if prec.master_bytes:
        master, moments = OPTIMIZER_STATES[optimizer_state]
        return replace(prec, master_bytes=master, optim_bytes=moments)
    return prec


def act_elem_bytes(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def layers_on_rank(shape: ModelShape, pp: int) -> int:
    """Layers on the most loaded pipeline rank (balanced split, remainder to the first)."""
    return -(-shape.layers // pp)


def rank_params(shape: ModelShape, lay: Layout, rank: int,
                impl: Implementation | None = None) -> float:
    """Parameters one GPU of pipeline rank `rank` holds before ZeRO sharding: its layers' matrices
    split over tp (norms and biases kept whole), the vocabulary-parallel embedding on the first
    rank, the head (or, tied across pp > 1, a copy of the embedding) and final norm on the last;
    with experts, its ep share of each block's routed experts; the ends whole where `impl`
    runs them so (`tp_ends`)."""
    dense, experts = rank_param_split(shape, lay, rank, impl=impl)
    return dense + experts


def rank_param_split(shape: ModelShape, lay: Layout, rank: int, layers: int | None = None,
                     etp: int = 1, impl: Implementation | None = None) -> tuple[float, float]:
    """`rank_params` as (dense, routed experts): the first part ZeRO shards over dp_shard, the
    second over the expert shard degree (moe.expert_shard); 0 experts for a dense model.
    `layers`: the blocks this rank holds (plan/stages.py); by default the even split's most."""
    split = shape.tp_split_params
    small = shape.layer_params - split - shape.expert_layer_params
    layers = layers_on_rank(shape, lay.pp) if layers is None else layers
    n = layers * (split / lay.tp + small) + outer_params(shape, lay, rank, impl)
    return n, layers * shape.expert_layer_params / (lay.ep * etp)


def outer_params(shape: ModelShape, lay: Layout, rank: int,
                 impl: Implementation | None = None) -> float:
    """A GPU's parameters outside its blocks: the vocabulary-parallel embedding (and learned
    positions) on the first pipeline rank, the final norm and the head (or, tied across
    pp > 1, a copy of the token table) on the last; either whole on every tp rank where `impl`
    runs it so (`tp_ends`)."""
    n = shape.embedding_params / table_tp(impl, lay) if rank == 0 else 0.0
    if rank == lay.pp - 1:
        n += shape.final_norm_params
        if not shape.tied or lay.pp > 1:
            n += shape.vocab * shape.hidden / head_tp(impl, lay)
    return n


def gathered_param_bytes(impl: Implementation, lay: Layout, dtype: str) -> int:
    """Bytes a parameter takes as ZeRO gathers it: the bf16 working copy's, or 4 under
    `fp32_params`."""
    return 4 if fp32_working_params(impl, lay, dtype) else precision(dtype).param_bytes


def zero3_root_params(shape: ModelShape, lay: Layout, rank: int,
                      impl: Implementation) -> float:
    """Parameters ZeRO-3 keeps gathered from a micro-batch's forward to its backward, beside
    the blocks it gathers one by one: the root unit's (`fsdp_root`), held at the peak, where
    the forward ends and the backward begins.
    meshloom's root holds the final norm and the head (a tied head: the token table) on the
    last pipeline rank; FSDP1 and FSDP2 wrapping the blocks leave every parameter outside
    them to the root (`outer_params`)."""
    if lay.zero != 3 or lay.dp_shard <= 1:
        return 0.0
    if impl.fsdp_root == "outer":
        return outer_params(shape, lay, rank, impl)
    if rank != lay.pp - 1:
        return 0.0
    return shape.final_norm_params + shape.vocab * shape.hidden / head_tp(impl, lay)


def zero3_gathered_params(shape: ModelShape, lay: Layout, rank: int, impl: Implementation,
                          layers: int | None = None, etp: int = 1) -> float:
    """Parameters ZeRO-3 holds gathered at the peak, where the forward ends and the backward
    begins, beside the running unit's gradient: the root's (`zero3_root_params`), or without
    resharding after forward (`reshard_after_forward` off) every sharded parameter of the rank,
    the dense ones (sharded over dp_shard) and the experts (over their shard degree)."""
    if zero3_resharded(impl, lay):
        return zero3_root_params(shape, lay, rank, impl)
    dense, experts = rank_param_split(shape, lay, rank, layers, etp, impl)
    return ((dense if lay.dp_shard > 1 else 0.0)
            + (experts if experts and expert_shard(lay) > 1 else 0.0))


def zero3_first_outer_params(shape: ModelShape, lay: Layout, rank: int,
                             impl: Implementation) -> float:
    """The parameters outside the blocks whose ZeRO-3 gather opens a micro-batch's forward,
    with nothing yet to run beside it: under `fsdp_root=outer` all of them (one root unit,
    gathered as the forward begins); meshloom's the embedding's, and its root's only where the
    root holds the token table the embedding reads (tied, pp = 1): otherwise the last block's
    forward hides the root's gather as its prefetch (parallel/fsdp.py)."""
    if impl.fsdp_root == "outer" or (shape.tied and lay.pp == 1):
        return outer_params(shape, lay, rank, impl)
    return shape.embedding_params / table_tp(impl, lay) if rank == 0 else 0.0


def rank_model_states(shape: ModelShape, lay: Layout, rank: int, prec,
                      layers: int | None = None, etp: int = 1,
                      whole_fp32: bool = False, whole_grads: bool = False,
                      fp32_grad_shards: bool = False,
                      whole_grad_bytes: int | None = None,
                      impl: Implementation | None = None) -> dict[str, float]:
    """Per-GPU bytes of params, grads and optimizer state: the dense part sharded by ZeRO over
    dp_shard, the routed experts (already split over ep) over the expert shard degree.
    `whole_fp32` (DeepSpeed's BF16_Optimizer, implementation.whole_fp32_states): every rank
    also keeps whole fp32 gradients beside the bf16 ones and the whole master copy; only the
    moments are sharded. `whole_grads` (ZeRO-3 under `fsdp_no_sync`, or PyTorch's
    pipelining, `pp_fsdp`): whole unsharded gradients accumulate over the step, of
    `whole_grad_bytes` each (default the precision's gradient bytes), in the shards' place:
    the previous step's shards were freed (`zero_grad(set_to_none=True)`, PyTorch's default
    since 2.0), and the step's last reduce makes the new ones as it frees the whole gradients
    unit by unit (meshloom's `parallel.reduce_once`; FSDP1's `_saved_grad_shard` is None then;
    FSDP2 assigns a None `.grad`), so the peak holds the larger of the two. `fp32_grad_shards`
    (FSDP1's SHARD_GRAD_OP, `fp32_gradient_shards`): the gradient shards are fp32 whatever
    the compute dtype. `impl`: the ends' split (`tp_ends`)."""
    dense, experts = rank_param_split(shape, lay, rank, layers, etp, impl)
    states = model_state_bytes(dense, lay.dp_shard, lay.zero, prec)
    if experts:
        more = model_state_bytes(experts, expert_shard(lay), lay.zero, prec)
        states = {k: v + more[k] for k, v in states.items()}
    if fp32_grad_shards and prec.grad_bytes < 4:
        states["grads"] *= 4 / prec.grad_bytes
    if whole_grads:  # ZeRO-3 under `fsdp_no_sync`: whole gradients, then the shards
        states["whole_grads"] = (whole_grad_bytes or prec.grad_bytes) * (dense + experts)
        states["grads"] = max(states["whole_grads"], states["grads"])
    if whole_fp32:
        psi = dense + experts
        sharded = dense / lay.dp_shard + experts / expert_shard(lay)
        states["grads"] += 4 * psi
        states["optimizer"] = prec.master_bytes * psi + prec.optim_bytes * sharded
    return states


def uses_meshloom_block(shape: ModelShape, dtype: str, impl: Implementation | None) -> bool:
    """Whether the activations are meshloom's own block's census: a Llama or GPT-2 block in
    bf16, with an MoE feed-forward too, eager or compiled (`meshloom_block_bytes`). A gpt shape
    meshloom does not build (grouped-query attention, no biases, RoPE) gets the per-tensor
    count."""
    meshloom_arch = shape.arch == "llama" or shape.is_gpt2_block
    split_experts = impl is not None and impl.expert_tp and shape.is_moe  # not meshloom's
    return (impl is not None and impl.meshloom_block and dtype == "bf16" and meshloom_arch
            and not split_experts)


def meshloom_block_bytes(shape: ModelShape, s: int, b: int, lay: Layout, rec: str,
                         fused: bool) -> float:
    """Bytes meshloom's block (models/llama.py, models/gpt2.py) keeps for backward per
    micro-batch in bf16, read off its autograd graph (the saved tensors, each storage once).
    Unsharded layouts keep fp32 parameters and an fp32 residual stream and run the forward under
    autocast ("amp"); ZeRO stages compute with bf16 working parameters, no autocast ("bf16",
    docs/mixed-precision.md). Per token, with q = q_dim, F = ffn_hidden, a = heads; 8q is SDPA's
    q, k and v (repeated to every head) and its output, which the output projection reads, 4a
    its fp32 log-sum-exp.
    Llama:
    - amp eager: 8F (w1 and w3 outputs, silu, product) + 26h (each RMSNorm keeps its fp32 input
      and its fp32 normalised value, 16h; autocast casts a norm's fp32 output to bf16 once for
      each of wq, wk, wv, w1, w3, 10h) + 8q + 4a + 8 (two fp32 rsqrt);
    - bf16 eager: 8F + 20h (each norm keeps the fp32 copy of its bf16 input and the normalised
      value, 16h, and its bf16 output, shared by the matmuls that read it, 4h) + 8q + 4a + 8;
    - qk-norm adds its fp32 pair per head for q and k, 8(q + kv) + 4(a + kv heads), either way;
    - compiled (inductor's partition: silu rerun, one bf16 copy per norm output, wo's input):
      amp 6F + 10h (the fp32 block input, 4h, and 6h) + 8q + 4a + 8, bf16 6F + 8h + 8q + 4a + 8;
      under tp the attention's all-reduced (SP: reduce-scattered) output too, in bf16 (the
      compiler keeps collectives' outputs, never reruns them), and wo's input is not.
    GPT-2 (LayerNorm keeps its input and fp32 mean and rstd, 16 bytes for two):
    - amp eager: 4F (fc output, GELU's output) + 16h (each norm's fp32 input, 8h; the bf16 casts
      of ln_1's output for q, k, v and of ln_2's for fc, 8h) + 8q + 4a + 16;
    - amp compiled: 4F + 10h (the fp32 block input, 4h, one bf16 copy per norm output and the
      projection's input, 6h) + 8q + 4a + 16;
    - bf16, eager or compiled: 4F + 8h (each norm's bf16 input and output) + 8q + 4a + 16;
    - with dropout, eager or compiled: + 2h, the residual dropouts' 1-byte masks (selective and
      full recompute rerun dropout from the saved RNG state instead).
    Recompute, either family: selective (meshloom's policy keeps every matmul's output) the
    block's input, which the checkpoint holds (amp 4h, bf16 2h), plus the matmul outputs in bf16,
    but compiled as one graph (tp = cp = 1) not the down projection's (2h): inductor's partition
    keeps only what the backward reads, and nothing reruns after it; full, the input alone.
    Split over tp as the projections are; h-wide terms whole on each rank. Under SP the block
    input and the norms' own tensors are a 1/t slice, but what the projections read (a norm's
    output, all-gathered, and under amp its casts) is whole. A row-parallel matmul's output is h
    wide on every rank (a partial sum). Under context parallel (s = the rank's tokens) the ring
    attention (parallel/context.py) keeps K and V with their own heads beside q, its fp32 output
    and the bf16 output wo reads, where SDPA keeps K and V repeated to every head and one
    output: 4 kv more, eager or compiled; compiled GPT-2 under amp also keeps the fp32 residual
    between the graphs around the ring, not wo's bf16 input, and reruns one norm statistic
    (4h - 2q - 4; under tp in place of the attention's reduced output, (2h - 4)/t with SP);
    selective recompute reruns the ring and keeps what it keeps without it. tp and cp
    together compose these terms (measured on 4 ranks).
    tests/test_plan_memory_census.py checks both families on 2 ranks with and without SP, on 2
    cp ranks, eager in amp and bf16 and compiled, and selective recompute on 2 tp ranks."""
    t = lay.tp
    h, q, kv, f, a = shape.hidden, shape.q_dim / t, shape.kv_dim / t, shape.ffn_hidden / t, \
        shape.heads / t
    whole = t if lay.sp else 1
    amp = lay.zero == 0
    block_input = (4 if amp else 2) * h / whole
    if rec == "full":
        return s * b * block_input
    if shape.is_moe:
        if rec == "selective":
            return s * b * (block_input + 2 * moe_matmul_outputs(shape, lay))
        return s * b * moe_block_bytes_per_token(shape, lay, amp, fused)
    if rec == "selective":
        kept = sum(g.n for g in block_gemms(shape, 1, t))
        if fused and t == 1 and lay.cp == 1:  # one graph: w2's output is not kept
            kept -= h
        return s * b * (block_input + 2 * kept)
    ring = ring_bytes(shape, lay)
    # Under SP a norm runs on this rank's slice of the sequence (its internals and the block
    # input are 1/t), and its output is all-gathered before the projections, which keep the
    # whole-sequence tensor they read (amp: autocast's bf16 cast of it, once per projection).
    if shape.arch == "gpt":
        norms, gathered, stats = (8 if amp else 4), (8 if amp else 4), 16
    else:
        norms, gathered, stats = 16, (10 if amp else 4), 8
    # GPT-2's residual dropouts keep a 1-byte mask each (after the reduce-scatter under SP);
    # its attention dropout runs inside the flash kernel, which keeps only its RNG state.
    masks = 2 * h / whole if shape.arch == "gpt" and shape.has_dropout else 0.0
    if fused:
        # The compiled graph keeps the block input, one cast per norm output and, without tp,
        # wo's input. Under tp the collectives are in the graph, and the compiler never reruns
        # a collective: it keeps the attention's reduced output (bf16, a 1/t slice under SP), from
        # which with the block input the backward rebuilds the residual, and wo reads the
        # attention output itself.
        per = (block_input + 10 * q if t == 1 else block_input + 2 * h / whole + 8 * q) + 4 * h
        per += 4 * a + stats / whole + masks + ring
        if ring and amp and shape.arch == "gpt":
            # The graphs either side of the ring keep the fp32 residual in place of wo's bf16
            # input (tp 1) or of the attention's reduced output (tp > 1), and rerun one norm
            # statistic.
            per += 4 * h - 2 * q - 4 if t == 1 else (2 * h - 4) / whole
        return s * b * (per + (6 if shape.arch == "llama" else 4) * f)
    per = norms * h / whole + gathered * h + 8 * q + 4 * a + stats / whole + ring
    per += (8 if shape.arch == "llama" else 4) * f + masks
    if shape.qk_norm:
        per += 8 * (q + kv) + 4 * (a + shape.kv_heads / t)
    return s * b * per


def ring_bytes(shape: ModelShape, lay: Layout) -> float:
    """What context parallel's ring attention keeps per token beyond SDPA: K and V with their
    own heads (4 kv), split over tp as the heads are; 0 without cp (`meshloom_block_bytes`)."""
    return 4 * shape.kv_dim / lay.tp if lay.cp > 1 else 0.0


def moe_block_bytes_per_token(shape: ModelShape, lay: Layout, amp: bool,
                              compiled: bool = False) -> float:
    """meshloom's Llama block with an MoE feed-forward (models/moe.py), per token on one tp
    rank: what the token keeps on its own rank (eager `moe_local_bytes_per_token`, compiled
    `moe_compiled_local_bytes_per_token`) and its load x top_k routed rows on the experts'
    ranks (`moe_routed_row_bytes`), a 1/t slice under SP. Eager, read off its autograd graph
    like the dense block's
    (tests/test_plan_memory_census.py, one process and 2 tensor-parallel ranks):
    - attention and the two norms as in the dense block: 16h (each norm's fp32 pair) + 8q + 4a +
      8, plus what the projections read: amp autocast's bf16 casts of the first norm's output for
      wq, wk, wv (6h) and of the second's for the router, each shared-expert matrix reading it
      and the shared gate (2h each); bf16 the two norm outputs (4h), read by all of them;
    - the router: fp32 scores (4E), top-k indices (int64, 8k) and `router_weight_bytes` (the
      renormalised weights with their sum, 4k + 4; a sigmoid's sum, 4);
    - per assignment on the token's rank: its token and sort indices (int64), its bf16 combine
      weight and the expert output it multiplies, 2h + 18 (the combine itself keeps only the
      index, models/moe.py `_Combine`);
    - per routed row on the expert's rank (load x top_k per token): the bf16 rows the grouped
      GEMMs read (2h) and SwiGLU's gate, up, silu(gate) and product (8H), and under expert
      parallel the two int64 indices regrouping the received rows (16);
    - the shared expert's SwiGLU (8 x shared_hidden) and, gated, the sigmoid's output and the
      shared output it scales (2h + 2).
    Under tp, q and a are split as in the dense block and the feed-forward is whole on every
    rank; under SP the norms and the whole feed-forward run on the rank's slice of the sequence
    (the MoE routes its slice, models/moe.py), only the first norm's output is all-gathered for
    wq, wk, wv. Under cp the ring attention keeps 4 kv more (`ring_bytes`). The router's
    weights as `router_weight_bytes` counts them for its score and normalisation options."""
    local = moe_compiled_local_bytes_per_token if compiled else moe_local_bytes_per_token
    routed = load_factor(shape, lay) * shape.top_k * moe_routed_row_bytes(shape, lay, compiled)
    return local(shape, lay, amp) + routed / (lay.tp if lay.sp else 1)


def moe_compiled_local_bytes_per_token(shape: ModelShape, lay: Layout, amp: bool) -> float:
    """What a token of meshloom's compiled MoE block keeps on its own rank. Routing's host reads
    (the split sizes) break the block into graphs that inductor partitions apart; counted from
    those graphs' saved tensors on CPU at nine shapes (hidden, heads, experts, top_k, expert and
    shared widths, gate; tests/test_plan_memory_census.py):
    - amp 12h, bf16 8h, + 8q + 4a + 8 + 4E: attention, the norms and the router's scores;
    - per assignment 2h + 26: the expert output the combine scales (bf16), the assignment's
      indices and weights (with the router's, `router_weight_bytes`: 4k more, renormalised);
      gate, up and their product on the rows the experts read are the routed rows' (silu is
      rerun);
    - without expert parallel, where one graph spans the dispatch, the combined output too
      (amp 4h, bf16 2h); under expert parallel the all-to-all breaks the graph there;
    - the shared expert 6F_s (amp + 2h, its input's cast); its gate 2h + 2.
    Under tp, attention's 8q + 4a is split over the heads; with SP everything is the rank's
    1/t slice of the sequence but the first norm's bf16 output, all-gathered whole for wq, wk
    and wv (2h(1 - 1/t) more). Under cp the ring adds 4 kv (`ring_bytes`). Checked on 2 tp
    ranks with and without SP, on 2 cp ranks, and on 2 expert-parallel ranks that are data- or
    context-parallel or 2-rank tensor-parallel groups with SP."""
    h, k, t = shape.hidden, shape.top_k, lay.tp
    attention = 8 * shape.q_dim + 4 * shape.heads
    per = (12 if amp else 8) * h + 8 + 4 * shape.n_experts + k * (2 * h + 26)
    per += router_weight_bytes(shape, compiled=True)
    if lay.ep == 1:
        per += (4 if amp else 2) * h
    if shape.shared_hidden:
        per += 6 * shape.shared_hidden + (2 * h if amp else 0)
    if shape.shared_gate:
        per += 2 * h + 2
    if lay.sp:
        per = per / t + 2 * h * (1 - 1 / t)
    return per + attention / t + ring_bytes(shape, lay)


def moe_local_bytes_per_token(shape: ModelShape, lay: Layout, amp: bool) -> float:
    """`moe_block_bytes_per_token` but the routed rows: what a token keeps on its own rank."""
    h, q, a, k, t = shape.hidden, shape.q_dim, shape.heads, shape.top_k, lay.tp
    w = t if lay.sp else 1
    shared, gate = bool(shape.shared_hidden), bool(shape.shared_gate)
    readers = 1 + 2 * shared + gate  # projections reading the second norm's output
    first, second = (6 * h, 2 * readers * h) if amp else (2 * h, 2 * h)
    attention = (16 * h + second + 8) / w + first + (8 * q + 4 * a) / t + ring_bytes(shape, lay)
    router = 4 * shape.n_experts + 8 * k + router_weight_bytes(shape, compiled=False)
    local = k * (2 * h + 18)
    extra = 8 * shape.shared_hidden + (2 * h + 2 if gate else 0)
    return attention + (router + local + extra) / w


def router_weight_bytes(shape: ModelShape, compiled: bool) -> float:
    """What the router keeps per token for its top-k weights and its balance loss, beyond the
    4E scores and the 8k indices (models/moe.py `route`), counted by census for each option:
    - renormalised weights (the default) keep the top-k scores and their sum, 4k + 4; compiled,
      the sum only when inductor's partitioner will not recompute it: it bans recomputing a
      reduction whose output is over 4x smaller than its input (torch/_functorch/partitioners.py),
      here for k > 4;
    - sigmoid scores are made a distribution for the loss: their sum over the experts is kept,
      4 bytes, compiled by the same rule only for E > 4."""
    k, e = shape.top_k, shape.n_experts
    kept = 0
    if shape.router_norm:
        kept += 4 * k + (4 if not compiled or k > 4 else 0)
    if shape.router_score == "sigmoid":
        kept += 4 if not compiled or e > 4 else 0
    return kept


def moe_routed_row_bytes(shape: ModelShape, lay: Layout, compiled: bool = False) -> float:
    """What one routed row keeps on its expert's rank: the bf16 row the grouped GEMMs read and
    SwiGLU's four tensors (compiled three: silu is rerun); under expert parallel also the two
    int64 indices that regroup the received rows by expert and back (parallel/expert.py)."""
    swiglu = (6 if compiled else 8) * shape.moe_hidden
    return 2 * shape.hidden + swiglu + (16 if lay.ep > 1 else 0)


def moe_matmul_outputs(shape: ModelShape, lay: Layout) -> float:
    """Elements of the matmul outputs meshloom's selective policy keeps per token of an MoE
    block on one tp rank: attention's four projections (split as in the dense block), and, on
    the rank's tokens (a 1/t slice under SP), the router, the shared expert and its gate, and
    the grouped GEMMs' three outputs per routed row."""
    gemms = block_gemms(shape, 1, lay.tp)
    attention = sum(g.n for g in gemms if g.name in ATTENTION_GEMMS)
    ffn = sum(g.n for g in gemms if g.name not in ATTENTION_GEMMS)
    ffn += 1 if shape.shared_gate else 0  # the gate's linear map (h -> 1)
    ffn += load_factor(shape, lay) * shape.top_k * (2 * shape.moe_hidden + shape.hidden)
    return attention + ffn / (lay.tp if lay.sp else 1)


def op_sac_bytes(shape: ModelShape, s: int, b: int, lay: Layout, dtype: str) -> float:
    """torchtitan's per-op selective checkpointing (`Implementation.op_sac`): the block's input
    (held by the checkpoint), the outputs of its 1st, 3rd, ... matmuls in the order they run,
    and the attention kernel's output and fp32 log-sum-exp."""
    e, t = act_elem_bytes(dtype), lay.tp
    kept = sum(g.n for g in block_gemms(shape, 1, t)[0::2])
    per = shape.hidden * e / (t if lay.sp else 1) + (kept + shape.q_dim / t) * e \
        + 4 * shape.heads / t
    return s * b * per


def layer_activation_bytes(shape: ModelShape, s: int, b: int, lay: Layout, dtype: str,
                           flash: bool = True, recompute: str | None = None,
                           impl: Implementation | None = None) -> float:
    """Activation bytes one layer keeps for backward per micro-batch (s = local tokens per
    sequence, i.e. seq / cp). Terms, in units of sb x element size:
    - whole on every TP rank (split by SP): the two norm inputs and the two matmul-block inputs
      (4h), plus for GPT two 1-byte dropout masks (Korthikanti's 10 = 8 + 2); under an fp32
      residual stream (`impl.residual_stream`) the norm inputs are fp32 (8h bytes), under
      `fp32_cast` each projection reading a norm keeps its own cast
      (`step_kernels.stream_casts`), and full recompute's block input is fp32;
    - split over tp: Q, O (2 q_dim, hidden unless the head width is its own), K, V (2 kv_dim;
      2 q_dim when the trainer copies them out to every query head before the attention,
      `impl.expand_kv`, which then saves the copies), and the MLP's tensors: GeLU keeps its
      input and output (2F), SwiGLU keeps gate, up, silu(gate) and their product (4F; 3F
      fused, `impl.fused_swiglu`);
    - the attention core: GPT eager keeps softmax, dropout mask and output (5as, Korthikanti);
      Llama eager keeps the softmax (a s); FlashAttention keeps only the log-sum-exp (fp32).
    With 2-byte elements and GPT's shape this is Korthikanti's sbh(34 + 5as/h) at t = 1.
    With `impl.meshloom_block`, a dense bf16 Llama block is meshloom's (`meshloom_block_bytes`)."""
    rec = lay.recompute if recompute is None else recompute
    method = _accounting(shape, lay, dtype, flash, impl, rec)
    if method == "op_sac":
        return op_sac_bytes(shape, s, b, lay, dtype)
    if method == "census":
        return meshloom_block_bytes(shape, s, b, lay, rec, impl.compile)
    t, e = lay.tp, act_elem_bytes(dtype)
    h, a, f = shape.hidden, shape.heads, shape.ffn_hidden
    sb = s * b
    stream = residual_bytes(impl, e)
    if rec == "full":  # only the layer input (SP: its sequence slice)
        return sb * h * stream / (t if lay.sp else 1)
    gpt, drop = shape.arch == "gpt", shape.has_dropout
    # The two norms' inputs (fp32 under an fp32 stream) and what the projections read: the
    # two norm outputs, or under `fp32_cast` autocast's cast for each projection.
    casts = 0 if impl is None else stream_casts(shape, residual_stream(impl, e), impl.fused_qkv,
                                                impl.fused_swiglu)
    whole = 2 * h * stream + (casts or 2) * h * e + (2 * h if drop else 0)  # 1-byte masks
    # SwiGLU keeps gate, up, silu(gate) and their product; a fused SwiGLU (impl.fused_swiglu)
    # recomputes silu from gate; selective recompute reruns silu*up as well.
    if gpt or rec == "selective":
        mlp_tensors = 2
    else:
        mlp_tensors = 3 if impl is not None and impl.fused_swiglu else 4
    kv = shape.q_dim if impl is not None and impl.expand_kv else shape.kv_dim
    if shape.is_moe:  # the feed-forward is not split over tp (plan/moe.py)
        split = (2 * shape.q_dim + 2 * kv) * e
        moe = ffn_tokens(lay, sb) * activation_bytes_per_token(
            shape, lay, e, rec, fused_swiglu=impl is not None and impl.fused_swiglu,
            etp=expert_tp(lay, impl))
    else:
        split = (2 * shape.q_dim + 2 * kv + mlp_tensors * f) * e
        moe = 0.0
    if rec == "selective":
        core = 0.0  # recomputed in backward
    elif flash:
        core = 4.0 * a  # the log-sum-exp, fp32 per head and token
    else:  # softmax, and with dropout its mask (1 byte) and output
        core = a * s * (2 * e + 1 if drop else e)
    whole_bytes = sb * whole / (t if lay.sp else 1)
    return whole_bytes + sb * split / t + sb * core / t + moe


def residual_bytes(impl: Implementation | None, e: int) -> int:
    """Bytes an element of the residual stream takes: 4 in an fp32 `residual_stream`, else
    `e`."""
    return 4 if impl is not None and residual_stream(impl, e) != "16bit" else e


# F.cross_entropy over fp32 logits, at its backward's peak: the saved log-softmax, the NLL's
# gradient and log-softmax's (4 bytes each per logit; logits_bytes).
EAGER_CE_PEAK_BYTES = 12
# The same under PyTorch's `loss_parallel` on a vocabulary slice: the saved log-softmax, the
# zeros with the targets' -1, its exponential, their sum and its product with the gradient.
LOSS_PARALLEL_PEAK_BYTES = 20
# F.cross_entropy on bf16 logits without autocast (`eager_bf16`): the logits themselves, which
# such a loop still holds (KempnerForge's `logits` lives through `backward()`), the saved
# log-softmax, the NLL's gradient and log-softmax's, each at the logits' dtype.
EAGER_BF16_PEAK_ELEMS = 4


def logits_bytes(shape: ModelShape, s: int, b: int, lay: Layout, dtype: str,
                 impl: Implementation | None = None) -> float:
    """The last rank's loss at its peak, per logit of the rank's vocabulary slice (V/tp):
    - Megatron's (`megatron`, `megatron_fused`; and with no implementation given): the
      logits in the compute dtype and one fp32 copy, its softmax, which the backward
      overwrites with the gradient in place (e + 4); meshloom's under tp > 1
      (`vocab_parallel`) the same: its fp32 copy becomes the softmax in place, and the backward
      writes the gradient in the logits' dtype beside it;
    - one kernel each way (`fused`, `xentropy`; meshloom's compiled loss,
      `parallel.compiled_loss`): the 16-bit logits and their 16-bit gradient (2e);
    - PyTorch's `F.cross_entropy` over an fp32 copy (`eager`: torchtitan's
      `cross_entropy_loss`, meshloom's eager loss), with the 16-bit logits freed before
      backward (torchtitan's `del pred`): the backward holds the fp32 log-softmax it saved,
      the fp32 gradient the NLL's backward writes and the one log-softmax's backward writes,
      `EAGER_CE_PEAK_BYTES` (the forward's peak, logits + copy + log-softmax, is 2e + 4 less
      or equal). Under tp > 1 (`loss_parallel`, torchtitan's TP) DTensor's handlers run the
      NLL's backward as `(zeros with the targets' -1 + exp(log-softmax)) * gradient`, holding
      five such tensors, `LOSS_PARALLEL_PEAK_BYTES`. tests/test_plan_loss_memory.py measures
      both on CPU;
    - the same on bf16 logits with no autocast (`eager_bf16`), every tensor at e bytes and
      the logits still held: `EAGER_BF16_PEAK_ELEMS` x e.
    Where every tp rank runs the loss over all the logits (`tp_ends`), per logit of the whole
    vocabulary."""
    e = act_elem_bytes(dtype)
    kind = loss_kind(impl, lay) if impl is not None else "megatron"
    per = {"fused": 2 * e, "xentropy": 2 * e, "eager": EAGER_CE_PEAK_BYTES,
           "loss_parallel": LOSS_PARALLEL_PEAK_BYTES,
           "eager_bf16": EAGER_BF16_PEAK_ELEMS * e}.get(kind, e + 4)
    return s * b * shape.vocab / (lay.tp if impl is None else loss_vocab_share(impl, lay)) * per


def final_norm_bytes(shape: ModelShape, s: int, b: int, lay: Layout, dtype: str,
                     impl: Implementation | None = None) -> float:
    """The final norm's saved input: sbh·e (4 bytes an element in an fp32 `residual_stream`).
    meshloom's: the Llama RMSNorm's fp32 input (or the fp32 copy of its bf16 one) and
    normalised value, and the bf16 tensor the head reads, 10 bytes per h; GPT-2's LayerNorm
    its input and the head's bf16 input, 6 (amp) or 4 (bf16)."""
    if uses_meshloom_block(shape, dtype, impl):
        per = 10 if shape.arch == "llama" else 6 if lay.zero == 0 else 4
    else:
        per = residual_bytes(impl, act_elem_bytes(dtype))
    return s * b * shape.hidden * per / (lay.tp if lay.sp else 1)


def weight_copy_bytes(shape: ModelShape, lay: Layout, rank: int, dtype: str,
                      impl: Implementation | None, layers: int | None = None) -> float:
    """autocast's bf16 copies of the fp32 weight matrices, which the matmuls save for backward
    (meshloom's block without recompute: with recompute the copies die with the forward). Not
    with ZeRO, whose working parameters are bf16 already, except under `fp32_params` (ZeRO-3's
    gathered fp32 units are freed after the forward while their casts stay). An MoE block's
    grouped GEMMs save the bf16 casts of its local experts' stacked weights the same way."""
    autocast = impl is not None and fp32_working_params(impl, lay, dtype)
    if lay.recompute != "none" or not (
            autocast or uses_meshloom_block(shape, dtype, impl) and not lay.zero):
        return 0.0
    layers = layers_on_rank(shape, lay.pp) if layers is None else layers
    n = layers * shape.tp_split_params / lay.tp
    if shape.is_moe:  # the router, shared expert and this rank's experts (whole on every tp rank)
        n += layers * (shape.moe_dense_ffn_params + shape.expert_layer_params / lay.ep)
    if rank == lay.pp - 1:
        n += shape.vocab * shape.hidden / head_tp(impl, lay)
    return 2 * n


@lru_cache(maxsize=4096)
def in_flight(schedule: str, pp: int, m: int, v: int) -> tuple[float, float]:
    """For the first and the last pipeline rank, the most micro-batch x chunk activations
    alive at once, in units of one rank's whole share of layers (a chunk counts 1/v)."""
    if pp == 1:
        return (1.0,)
    peaks = alive_layers(schedule, pp, m, v, (1,) * (pp * v), (0, pp - 1))
    return tuple(peak / v for peak in peaks)


@lru_cache(maxsize=4096)
def alive_layers(schedule: str, pp: int, m: int, v: int, stages: tuple[int, ...],
                 ranks: tuple[int, ...], w_order: str = "filled") -> tuple[int, ...]:
    """For each of `ranks`, the most layer x micro-batch activations alive at once, the stages
    holding `stages` blocks each. Walked on the schedule's action lists: a forward adds its
    stage's blocks, the backward that consumes them (W for zero-bubble, which still needs the
    inputs) removes them. `w_order`: where interleaved_zb's weight passes go (`pp_w_order`)."""
    if pp == 1:
        return (stages[0],) * len(ranks)
    # GPipe runs every forward before any backward: the peak is m times one micro-batch's.
    scale, m = (m, 1) if schedule == "gpipe" else (1, m)
    peaks = []
    for walk in _stage_walks(schedule, pp, m, v, ranks, w_order):
        alive = peak = 0
        for stage, sign in walk:
            alive += sign * stages[stage]
            peak = max(peak, alive)
        peaks.append(scale * peak)
    return tuple(peaks)


@lru_cache(maxsize=1024)
def _stage_walks(schedule: str, pp: int, m: int, v: int, ranks: tuple[int, ...],
                 w_order: str = "filled") -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each rank's compute actions as (stage, +1 for a forward, -1 for the backward that frees
    its inputs): what `alive_layers` walks, kept apart from the blocks per stage so that the
    planner's many splits of one schedule share it."""
    if schedule != "gpipe":  # the peak is reached within the warm-up; more changes nothing
        rounds = -(-(3 * pp + v * pp) // (v * pp))
        m = min(m, rounds * pp)
    sign = {"F": 1, "B": -1, "W": -1}
    return tuple(tuple((act.stage, sign[act.kind]) for act in acts if act.kind in sign)
                 for acts in compute_lists(schedule, pp, m, v, ranks=ranks, w_order=w_order))


def _accounting(shape: ModelShape, lay: Layout, dtype: str, flash: bool,
                impl: Implementation | None, rec: str) -> str:
    """Which count a layer's activations get: "op_sac" (torchtitan's policy), "census"
    (meshloom's own block) or "korthikanti"."""
    if rec == "selective" and impl is not None and impl.op_sac and not shape.is_moe and flash:
        return "op_sac"
    if uses_meshloom_block(shape, dtype, impl) and flash:
        return "census"
    return "korthikanti"


def activation_accounting(shape: ModelShape, lay: Layout, dtype: str, flash: bool,
                          impl: Implementation) -> str:
    """One line saying how a layout's activations are counted (`meshloom plan --explain`)."""
    rec = f"{lay.recompute} recompute" if lay.recompute != "none" else "no recompute"
    method = _accounting(shape, lay, dtype, flash, impl, lay.recompute)
    if method == "op_sac":
        return f"torchtitan's per-op selective checkpointing, {act_elem_bytes(dtype)}-byte tensors"
    if method == "census":
        family = ("Llama MoE" if shape.is_moe else "Llama") if shape.arch == "llama" \
            else "GPT-2"
        how = ("fp32 parameters under autocast" if lay.zero == 0
               else "bf16 working parameters (ZeRO)")
        kernels = "compiled" if impl.compile else "eager"
        return f"meshloom's {family} block census: {how}, {kernels}, {rec}"
    return f"Korthikanti et al.'s per-tensor count, {act_elem_bytes(dtype)}-byte tensors, {rec}"


@dataclass
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    context: float  # CUDA context and library workspaces, outside the allocator's count
    rank: int  # the pipeline rank this breakdown is for (the fullest)
    counted_as: str = ""  # how the activations were counted (`activation_accounting`)
    root_unit: float = 0.0  # of the buffers: ZeRO-3's root unit (`zero3_root_params`)
    held_units: float = 0.0  # of the buffers: ZeRO-3 without resharding, every unit gathered
    whole_grads: float = 0.0  # of the grads: ZeRO-3's whole gradients summed over a step
    loss: float = 0.0  # of the activations: the loss and final norm, where the peak holds them

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.buffers
                + self.context)

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers,
                "context": self.context, "total": self.total, "pipeline_rank": self.rank,
                "activations_counted_as": self.counted_as, "buffers_root_unit": self.root_unit,
                **({"buffers_held_units": self.held_units} if self.held_units else {}),
                **({"grads_whole": self.whole_grads} if self.whole_grads else {}),
                **({"activations_loss": self.loss} if self.loss else {})}


def memory_per_gpu(shape: ModelShape, lay: Layout, seq: int, global_batch: int,
                   dtype: str = "bf16", flash: bool = True,
                   impl: Implementation = MESHLOOM,
                   stages: tuple[int, ...] | None = None) -> Memory:
    """Peak bytes on the fullest GPU of the layout, run as `impl` says. Gradients count unless
    the loop frees them between steps (`implementation.keeps_grads`) and one micro-batch on one
    stage makes the step's peak fall at the start of the backward, before any gradient is
    written.
    `stages`: blocks per pipeline stage, if the run fixes them (`parallel.pp_layers`); else
    the implementation's split (plan/stages.py). ZeRO-3's root unit, gathered through the
    peak (`zero3_root_params`), counts with the buffers."""
    if impl.meshloom_block and not flash:
        # meshloom's blocks always call SDPA: a plan with eager attention is another stack's,
        # counted Korthikanti's way throughout (block, loss, final norm, no autocast copies).
        impl = replace(impl, meshloom_block=False)
    prec = _state_precision(dtype, autocast_weights(impl, lay, dtype), impl.optimizer_state)
    s, b, m = seq // lay.cp, lay.micro_batch, lay.microbatches(global_batch)
    if stages is None:
        stages = stage_layers(shape, lay.pp, lay.v, seq, impl.pp_split)
    held = rank_layers(stages, lay.pp)
    # Middle ranks hold no embedding or head and at most the first rank's micro-batches in
    # flight, so the fullest GPU is the first or last pipeline rank, or one holding more
    # blocks than the first.
    ranks = tuple(sorted({0, lay.pp - 1} | {r for r in range(lay.pp) if held[r] > held[0]}))
    alive = dict(zip(ranks, alive_layers(lay.schedule if lay.pp > 1 else "1f1b", lay.pp, m,
                                         lay.v, stages, ranks,
                                         impl.pp_w_order), strict=True))
    per_layer = layer_activation_bytes(shape, s, b, lay, dtype, flash, impl=impl)
    working = (layer_activation_bytes(shape, s, b, lay, dtype, flash, recompute="none",
                                      impl=impl)
               if lay.recompute == "full" else 0.0)  # one layer recomputed during backward
    grads_at_peak = keeps_grads(impl, lay) or m > 1 or lay.pp > 1
    fp32_params = fp32_working_params(impl, lay, dtype)
    buffers = _buffers(shape, lay, s, b, dtype, expert_tp(lay, impl), fp32_params,
                       zero3_resharded(impl, lay))
    counted_as = activation_accounting(shape, lay, dtype, flash, impl)
    root_bytes = gathered_param_bytes(impl, lay, dtype)
    best = None
    for rank in ranks:
        states = rank_model_states(shape, lay, rank, prec, held[rank], expert_tp(lay, impl),
                                   whole_fp32_states(impl, lay, dtype), zero3_no_sync(impl, lay, m),
                                   fp32_gradient_shards(impl, lay),
                                   whole_grad_bytes(impl, lay, dtype), impl)
        acts = alive[rank] * per_layer
        if rank == 0 and shape.has_dropout:  # the embedding dropout's 1-byte mask; the
            # embedding's output itself is the first block's input, counted there (SP: a slice)
            acts += (alive[rank] / held[0]) * s * b * shape.hidden / (lay.tp if lay.sp else 1)
        # The loss's backward is over before the last block's recompute starts: the rank's peak
        # holds one or the other.
        loss = (logits_bytes(shape, s, b, lay, dtype, impl)
                + final_norm_bytes(shape, s, b, lay, dtype, impl)) if rank == lay.pp - 1 else 0.0
        acts += max(loss, working)
        acts += weight_copy_bytes(shape, lay, rank, dtype, impl, held[rank])
        gathered = zero3_gathered_params(shape, lay, rank, impl, held[rank],
                                         expert_tp(lay, impl)) * root_bytes
        resharded = zero3_resharded(impl, lay)
        mem = Memory(states["params"], states["grads"] if grads_at_peak else 0.0,
                     states["optimizer"], acts, buffers + gathered, CONTEXT_BYTES, rank,
                     counted_as, gathered if resharded else 0.0,
                     0.0 if resharded else gathered,
                     states.get("whole_grads", 0.0) if grads_at_peak else 0.0,
                     loss if loss >= working else 0.0)
        if best is None or mem.total > best.total:
            best = mem
    return best


def _buffers(shape: ModelShape, lay: Layout, s: int, b: int, dtype: str, etp: int = 1,
             fp32_params: bool = False, resharded: bool = True) -> float:
    """Communication buffers: DDP/ZeRO-1/2 buckets, ZeRO-3's gathered unit plus the prefetched
    next one (not `resharded`: both among every unit gathered, `zero3_gathered_params`) and
    the unit's full gradient before its reduce-scatter (fp32 under `fp32_params`), pipeline
    send/receive
    buffers, ring-attention K/V blocks (two in flight, and their gradients in backward), and
    with expert parallel one all-to-all's send and receive buffers."""
    prec = precision(dtype)
    e = act_elem_bytes(dtype)
    out = 0.0
    if lay.dp > 1 and lay.zero < 3:
        out += 2 * TORCH_BUCKET_BYTES  # two buckets in flight
    if lay.zero == 3 and lay.dp_shard > 1:
        unit = shape.layer_params / lay.tp
        if shape.is_moe:  # experts split over ep, the rest of the block as a dense one
            split, experts = shape.tp_split_params, shape.expert_layer_params
            unit = (shape.layer_params - split - experts + split / lay.tp
                    + experts / (lay.ep * etp))
        gathered = (2 * 4 if fp32_params else 2 * prec.param_bytes) if resharded else 0
        out += unit * (gathered + (4 if fp32_params else prec.grad_bytes))
    if lay.pp > 1:
        out += 2 * s * b * shape.hidden * e / (lay.tp if lay.sp else 1)
    if lay.cp > 1:
        out += 2 * 2 * (2 * s * b * shape.kv_dim * e) / lay.tp
    if shape.is_moe and lay.ep > 1:
        out += 2 * load_factor(shape, lay) * dispatch_bytes(shape, ffn_tokens(lay, s * b), e)
    return out


def predict_run_memory(llama_cfg, cfg, dims, micro_batch: int) -> Memory:
    """The planner's memory per GPU for a training run's own config and mesh (written to the
    run's summary; on a GPU, next to the CUDA allocator's peaks)."""
    from meshloom.plan.models import from_dims, from_llama_config
    p = cfg.parallel
    if p.rank_devices != 1:  # the summary says so instead of a per-rank figure per device
        raise PlanError("parallel.rank_devices spreads a rank over several devices; the "
                        "planner predicts memory for one device per rank")
    lay = Layout(tp=dims.tp, pp=dims.pp, dp=dims.dp_replicate * dims.dp_shard, cp=dims.cp,
                 dp_replicate=dims.dp_replicate, micro_batch=micro_batch, zero=p.zero_stage,
                 recompute=cfg.train.activation_checkpointing,
                 schedule=p.pp_schedule, v=p.pp_virtual_stages, sp=p.sequence_parallel,
                 ep=getattr(dims, "ep", 1))
    dtype = "fp32" if cfg.train.dtype == "fp32" else "bf16"
    if getattr(llama_cfg, "family", "llama") == "gpt2":  # learned positions, biases, LayerNorm
        m = llama_cfg
        shape = from_dims("gpt", m.dim, m.n_layers, m.n_heads, m.vocab_size, name="run",
                          ffn_hidden=m.hidden, positions=m.max_seq_len, tied=m.tie_embeddings,
                          dropout=getattr(m, "dropout", 0.0) > 0)
    else:
        shape = from_llama_config(llama_cfg, "run")
    impl = Implementation(compile=bool(getattr(cfg.train, "compile", False)),
                          reshard_after_forward=p.reshard_after_forward,
                          fsdp_no_sync=p.reduce_once)
    return memory_per_gpu(shape, lay, cfg.data.seq_len, cfg.train.global_batch, dtype,
                          impl=impl, stages=tuple(p.pp_layers) or None)
