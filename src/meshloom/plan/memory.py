"""Memory per GPU of a layout: model states, activations, buffers and an allocator allowance.

Model states come from `formulas.model_state_bytes` (the formulas the ZeRO code is tested
against). Activations follow Korthikanti et al. (arXiv 2205.05198, Table 2): per layer
sbh(10 + 24/t + 5as/(ht)) bytes for the GPT block in 16-bit, all of it divided by t with
sequence parallelism, the attention-core term dropped by selective recompute, and only the
layer input (2sbh) kept by full recompute. We derive the same terms for the Llama block (below).
How many micro-batches a pipeline rank holds comes from walking the schedule's own action
lists (`pipeline_schedule.compute_lists`), the lists the pipeline executor runs.
A mixture-of-experts block's routed experts are counted apart from the rest (plan/moe.py): split
over ep, ZeRO-sharded over the expert shard degree, not split over tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshloom.parallel.pipeline_schedule import compute_lists
from meshloom.plan.formulas import FP32, MIXED, model_state_bytes
from meshloom.plan.layout import Layout
from meshloom.plan.models import ModelShape
from meshloom.plan.moe import (
    activation_bytes_per_token,
    dispatch_bytes,
    expert_shard,
    load_factor,
)

# Stated allowances, not measurements: the caching allocator's fragmentation (a fraction of
# everything above) and the CUDA context plus library workspaces (cuBLAS, NCCL) per GPU.
ALLOCATOR_FRACTION = 0.10
CONTEXT_BYTES = 1.0e9
DDP_BUCKET_BYTES = 25 * 2**20  # meshloom's default parallel.ddp_bucket_mb; two in flight


def precision(dtype: str):
    return MIXED if dtype == "bf16" else FP32


def act_elem_bytes(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def layers_on_rank(shape: ModelShape, pp: int) -> int:
    """Layers on the most loaded pipeline rank (balanced split, remainder to the first)."""
    return -(-shape.layers // pp)


def rank_params(shape: ModelShape, lay: Layout, rank: int) -> float:
    """Parameters one GPU of pipeline rank `rank` holds before ZeRO sharding: its layers' matrices
    split over tp (norms and biases kept whole), the vocabulary-parallel embedding on the first
    rank, the head (or, tied across pp > 1, a copy of the embedding) and final norm on the last;
    with experts, its ep share of each block's routed experts."""
    dense, experts = rank_param_split(shape, lay, rank)
    return dense + experts


def rank_param_split(shape: ModelShape, lay: Layout, rank: int) -> tuple[float, float]:
    """`rank_params` as (dense, routed experts): the first part ZeRO shards over dp_shard, the
    second over the expert shard degree (moe.expert_shard); 0 experts for a dense model."""
    t = lay.tp
    split = shape.tp_split_params
    small = shape.layer_params - split - shape.expert_layer_params
    layers = layers_on_rank(shape, lay.pp)
    n = layers * (split / t + small)
    table = shape.vocab * shape.hidden
    if rank == 0:
        n += shape.embedding_params / t
    if rank == lay.pp - 1:
        n += shape.final_norm_params
        if not shape.tied or lay.pp > 1:
            n += table / t
    return n, layers * shape.expert_layer_params / lay.ep


def rank_model_states(shape: ModelShape, lay: Layout, rank: int, prec) -> dict[str, float]:
    """Per-GPU bytes of params, grads and optimizer state: the dense part sharded by ZeRO over
    dp_shard, the routed experts (already split over ep) over the expert shard degree."""
    dense, experts = rank_param_split(shape, lay, rank)
    states = model_state_bytes(dense, lay.dp_shard, lay.zero, prec)
    if experts:
        more = model_state_bytes(experts, expert_shard(lay), lay.zero, prec)
        states = {k: v + more[k] for k, v in states.items()}
    return states


def layer_activation_bytes(shape: ModelShape, s: int, b: int, lay: Layout, dtype: str,
                           flash: bool = True, recompute: str | None = None) -> float:
    """Activation bytes one layer keeps for backward per micro-batch (s = local tokens per
    sequence, i.e. seq / cp). Terms, in units of sb x element size:
    - whole on every TP rank (split by SP): the two norm inputs and the two matmul-block inputs
      (4h), plus for GPT two 1-byte dropout masks (Korthikanti's 10 = 8 + 2);
    - split over tp: Q, O (2h), K, V (2 kv_dim), and the MLP's tensors: GeLU keeps its input and
      output (2F), SwiGLU keeps gate, up, silu(gate) and their product (4F);
    - the attention core: GPT eager keeps softmax, dropout mask and output (5as, Korthikanti);
      Llama eager keeps the softmax (a s); FlashAttention keeps only the log-sum-exp (fp32).
    With 2-byte elements and GPT's shape this is Korthikanti's sbh(34 + 5as/h) at t = 1."""
    rec = lay.recompute if recompute is None else recompute
    t, e = lay.tp, act_elem_bytes(dtype)
    h, a, f = shape.hidden, shape.heads, shape.ffn_hidden
    sb = s * b
    if rec == "full":  # only the layer input (SP: its sequence slice)
        return sb * h * e / (t if lay.sp else 1)
    gpt, drop = shape.arch == "gpt", shape.has_dropout
    whole = 4 * h * e + (2 * h if drop else 0)  # two 1-byte dropout masks
    mlp_tensors = 2 if gpt else (2 if rec == "selective" else 4)  # selective recomputes silu*up
    if shape.is_moe:  # the feed-forward is not split over tp (plan/moe.py)
        split = (2 * h + 2 * shape.kv_dim) * e
        moe = sb * activation_bytes_per_token(shape, lay, e, rec)
    else:
        split = (2 * h + 2 * shape.kv_dim + mlp_tensors * f) * e
        moe = 0.0
    if rec == "selective":
        core = 0.0  # recomputed in backward
    elif flash:
        core = 4.0 * a  # the log-sum-exp, fp32 per head and token
    else:  # softmax, and with dropout its mask (1 byte) and output
        core = a * s * (2 * e + 1 if drop else e)
    whole_bytes = sb * whole / (t if lay.sp else 1)
    return whole_bytes + sb * split / t + sb * core / t + moe


def logits_bytes(shape: ModelShape, s: int, b: int, t: int, dtype: str) -> float:
    """The last rank's loss: logits in the compute dtype plus one fp32 copy for the cross
    entropy (its softmax, later overwritten by the gradient), vocabulary-parallel over tp."""
    return s * b * shape.vocab / t * (act_elem_bytes(dtype) + 4)


@lru_cache(maxsize=4096)
def in_flight(schedule: str, pp: int, m: int, v: int) -> tuple[float, float]:
    """For the first and the last pipeline rank, the most micro-batch x chunk activations
    alive at once, in units of one rank's whole share of layers (a chunk counts 1/v). Walked on
    the schedule's action lists: a forward adds its chunk, the backward that consumes it (W for
    zero-bubble, which still needs the inputs) removes it."""
    if pp == 1:
        return (1.0,)
    if schedule != "gpipe":  # the peak is reached within the warm-up; more changes nothing
        rounds = -(-(3 * pp + v * pp) // (v * pp))
        m = min(m, rounds * pp)
    peaks = []
    for acts in compute_lists(schedule, pp, m, v, ranks=(0, pp - 1)):
        alive = peak = 0
        for act in acts:
            if act.kind == "F":
                alive += 1
            elif act.kind in ("B", "W"):
                alive -= 1
            peak = max(peak, alive)
        peaks.append(peak / v)
    return tuple(peaks)


@dataclass
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    allocator: float
    rank: int  # the pipeline rank this breakdown is for (the fullest)

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.buffers
                + self.allocator)

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers,
                "allocator": self.allocator, "total": self.total, "pipeline_rank": self.rank}


def memory_per_gpu(shape: ModelShape, lay: Layout, seq: int, global_batch: int,
                   dtype: str = "bf16", flash: bool = True) -> Memory:
    """Peak bytes on the fullest GPU of the layout."""
    prec = precision(dtype)
    s, b, m = seq // lay.cp, lay.micro_batch, lay.microbatches(global_batch)
    flight = in_flight(lay.schedule if lay.pp > 1 else "1f1b", lay.pp, m, lay.v)
    first, last = flight[0], flight[-1]
    per_layer = layer_activation_bytes(shape, s, b, lay, dtype, flash)
    working = (layer_activation_bytes(shape, s, b, lay, dtype, flash, recompute="none")
               if lay.recompute == "full" else 0.0)  # one layer recomputed during backward
    e = act_elem_bytes(dtype)
    best = None
    # Middle ranks hold no embedding or head and at most the first rank's micro-batches in
    # flight, so the fullest GPU is on the first or the last pipeline rank.
    for rank in sorted({0, lay.pp - 1}):
        states = rank_model_states(shape, lay, rank, prec)
        alive = first if rank == 0 else last
        acts = alive * layers_on_rank(shape, lay.pp) * per_layer + working
        if rank == 0 and shape.has_dropout:  # the embedding dropout's 1-byte mask; the
            # embedding's output itself is the first block's input, counted there (SP: a slice)
            acts += alive * s * b * shape.hidden / (lay.tp if lay.sp else 1)
        if rank == lay.pp - 1:
            acts += logits_bytes(shape, s, b, lay.tp, dtype) + s * b * shape.hidden * e
        buffers = _buffers(shape, lay, s, b, dtype)
        mem = Memory(states["params"], states["grads"], states["optimizer"], acts, buffers, 0.0,
                     rank)
        mem.allocator = ALLOCATOR_FRACTION * mem.total + CONTEXT_BYTES
        if best is None or mem.total > best.total:
            best = mem
    return best


def _buffers(shape: ModelShape, lay: Layout, s: int, b: int, dtype: str) -> float:
    """Communication buffers: DDP/ZeRO-1/2 buckets, ZeRO-3's gathered unit plus the prefetched
    next one and the unit's full gradient before its reduce-scatter, pipeline send/receive
    buffers, ring-attention K/V blocks (two in flight, and their gradients in backward), and
    with expert parallel one all-to-all's send and receive buffers."""
    prec = precision(dtype)
    e = act_elem_bytes(dtype)
    out = 0.0
    if lay.dp > 1 and lay.zero < 3:
        out += 2 * DDP_BUCKET_BYTES
    if lay.zero == 3 and lay.dp_shard > 1:
        unit = shape.layer_params / lay.tp
        if shape.is_moe:  # experts split over ep, the rest of the block as a dense one
            split, experts = shape.tp_split_params, shape.expert_layer_params
            unit = shape.layer_params - split - experts + split / lay.tp + experts / lay.ep
        out += unit * (2 * prec.param_bytes + prec.grad_bytes)
    if lay.pp > 1:
        out += 2 * s * b * shape.hidden * e / (lay.tp if lay.sp else 1)
    if lay.cp > 1:
        out += 2 * 2 * (2 * s * b * shape.kv_dim * e) / lay.tp
    if shape.is_moe and lay.ep > 1:
        out += 2 * load_factor(shape, lay) * dispatch_bytes(shape, s * b, e)
    return out


def predict_run_memory(llama_cfg, cfg, dims, micro_batch: int) -> Memory:
    """The planner's memory per GPU for a training run's own config and mesh (written to the
    run's summary; on a GPU, next to the CUDA allocator's peaks)."""
    from meshloom.plan.models import from_dims, from_llama_config
    p = cfg.parallel
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
    return memory_per_gpu(shape, lay, cfg.data.seq_len, cfg.train.global_batch, dtype)
