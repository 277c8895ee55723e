"""Mixture-of-experts costs: where a GPU's expert parameters are sharded, what an MoE block keeps
for backward, and what its all-to-alls move and cost.

Expert parallel as meshloom runs it (parallel/expert.py, mesh.py's expert axes): each MoE block's
n_experts are split over `ep` ranks taken from the dp_shard x cp ranks (flattened, ep innermost,
so an ep group is ep ranks at stride tp). ZeRO shards the experts over the "edp_shard" ranks
(dp_shard x cp / ep) and they are replicated over dp_replicate; everything else (attention,
norms, router, shared expert, embeddings) is sharded over dp_shard as in a dense model. With
ep = 1 no expert groups exist, so the experts are ordinary parameters and shard over dp_shard.
meshloom does not split the experts over tp: each tp rank holds its ep share of whole experts
and runs the whole MoE feed-forward (router, shared expert, experts) on its tokens, so that
part of a block's FLOPs and activations is not divided by tp. Its tokens are the whole
sequence, or under sequence parallel the rank's 1/tp slice, which it routes itself
(models/moe.py splits the routing statistics over the tp ranks): `ffn_tokens`. Megatron-Core
splits them (`Implementation.expert_tp`, `expert_tp`): each tp rank holds 1/tp of each expert
and, after the all-to-all, all-gathers the tokens of its tp group to run them through its
slice, then reduce-scatters the output before the all-to-all back; the FLOPs per GPU are the
same, the expert weights 1/tp, the saved expert inputs tp times as many.

Tokens: every MoE block, in forward, dispatches each GPU's tokens to their top_k experts by one
all-to-all and combines the outputs by another, each of tokens x top_k x hidden x bytes; backward
runs the same two again (full recompute a third pair). Routing is not balanced: the busiest
expert rank receives `ModelShape.moe_imbalance` times the mean (default 1.25, or a capacity
factor, which bounds it exactly), which scales its expert compute, its dispatched activations
and the all-to-all it waits for. With ep = 1 every assignment stays on the GPU, so the
imbalance between experts changes nothing there.
"""

from __future__ import annotations

from meshloom.plan.hardware import Cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout
from meshloom.plan.models import ModelShape
from meshloom.plan.reruns import dispatch_reruns

A2A_FORWARD = 2  # dispatch and combine, per MoE block and micro-batch
A2A_BACKWARD = 2  # their gradients; recompute may rerun the forward's two as well
ROUTER_BYTES = 4  # router scores are kept in fp32 for the softmax and the load-balancing loss


def load_factor(shape: ModelShape, lay: Layout) -> float:
    """The busiest GPU's expert work over the mean: the imbalance allowance once experts are
    spread over ep > 1 ranks, 1 when every expert sits on every GPU."""
    return shape.moe_imbalance if shape.is_moe and lay.ep > 1 else 1.0


def expert_tp(lay: Layout, impl: Implementation | None) -> int:
    """Ranks each expert is split over: tp under `Implementation.expert_tp`, else 1."""
    return lay.tp if impl is not None and impl.expert_tp else 1


def expert_shard(lay: Layout) -> int:
    """Ranks ZeRO shards a GPU's experts over: edp_shard = dp_shard x cp / ep with expert
    parallel; with ep = 1 the experts are ordinary parameters, sharded over dp_shard."""
    return lay.dp_shard * lay.cp // lay.ep if lay.ep > 1 else lay.dp_shard


def expert_replicas(lay: Layout) -> int:
    """Ranks holding the same experts (edp = dp x cp / ep): DDP all-reduces their gradients."""
    return lay.dp * lay.cp // lay.ep


def ffn_tokens(lay: Layout, tokens: int) -> int:
    """Tokens an MoE feed-forward runs on per tp rank for `tokens` local tokens of a micro-batch:
    all of them, or under sequence parallel the rank's slice."""
    return tokens // lay.tp if lay.sp else tokens


def dispatch_bytes(shape: ModelShape, tokens: float, elem_bytes: int) -> float:
    """Payload of one all-to-all (a dispatch or a combine) on one GPU: its tokens x top_k x hidden
    x element bytes. Each GPU keeps 1/ep of it and sends the rest."""
    return tokens * shape.top_k * shape.hidden * elem_bytes


def all_to_alls(rerun: bool) -> int:
    """All-to-alls per MoE block per micro-batch: 4, or 6 when recompute reruns the forward's
    (`reruns.dispatch_reruns`)."""
    return A2A_FORWARD * (2 if rerun else 1) + A2A_BACKWARD


def all_to_all_bandwidth(cluster: Cluster, lay: Layout) -> float:
    """Per-GPU bytes/s of the ep group (ep ranks at stride tp): NVLink inside a node, else the
    network (Cluster.link_bandwidth: each GPU sends its own share through its own port)."""
    return cluster.link_bandwidth(lay.ep, lay.tp)


def all_to_all_time(payload: float, ep: int, bandwidth: float, load: float = 1.0,
                    latency: float = 0.0) -> float:
    """Seconds for one all-to-all: a GPU sends (ep - 1)/ep of `payload` and receives as much,
    both ways at once; the busiest receiver gets `load` times the mean; plus the call's fixed
    `latency` (Cluster.send_latency)."""
    if ep <= 1 or payload <= 0:
        return 0.0
    return load * (ep - 1) / ep * payload / bandwidth + latency


def activation_bytes_per_token(shape: ModelShape, lay: Layout, elem_bytes: int,
                               recompute: str, fused_swiglu: bool = False,
                               etp: int = 1) -> float:
    """What an MoE feed-forward keeps for backward per local token (beyond the block input,
    which the dense accounting already counts): the router's fp32 scores over the experts and
    its top_k weights; per routed copy (top_k of them, times the load factor) the dispatched
    input and the expert output (the combine's weight gradient reads it) and the SwiGLU tensors
    (gate, up, silu(gate), product: 4 x moe_hidden; 3 with a fused SwiGLU, which recomputes
    silu from gate, as Megatron-Core's grouped experts do under `bias_activation_fusion`;
    selective recompute keeps gate and up); the shared expert's SwiGLU tensors and its gate's
    output. Split over `etp` ranks (Megatron-Core's expert tensor parallel) an expert's input
    is the tp group's gathered tokens, etp times as many rows; its SwiGLU tensors are 1/etp as
    wide over those rows, the same bytes."""
    e, h = elem_bytes, shape.hidden
    swiglu = 2 if recompute == "selective" else 3 if fused_swiglu else 4
    router = (shape.n_experts + shape.top_k) * ROUTER_BYTES
    routed = load_factor(shape, lay) * shape.top_k * ((etp + 1) * h
                                                      + swiglu * shape.moe_hidden) * e
    shared = swiglu * shape.shared_hidden * e + (e if shape.shared_gate else 0)
    return router + routed + shared


def ffn_forward_flops_per_token(shape: ModelShape, lay: Layout) -> float:
    """Forward FLOPs of an MoE feed-forward per local token on the busiest GPU: router, shared
    expert and gate, and top_k routed experts scaled by the load factor (not divided by tp)."""
    routed = 3 * shape.hidden * shape.moe_hidden * shape.top_k
    return 2.0 * (shape.moe_dense_ffn_params + load_factor(shape, lay) * routed)


def ffn_elementwise_elems_per_token(shape: ModelShape, lay: Layout) -> float:
    """Elements the MoE feed-forward's memory-bound kernels move per token in forward: SwiGLU
    over each routed copy and the shared expert (read 2, write 1), and the permutation into and
    out of expert order (read and write hidden, per routed copy, for dispatch and combine)."""
    copies = load_factor(shape, lay) * shape.top_k
    return 3 * (copies * shape.moe_hidden + shape.shared_hidden) + 2 * 2 * copies * shape.hidden


def summary(shape: ModelShape, lay: Layout, cluster: Cluster, seq: int, micro_batches: int,
            dtype_bytes: int, dense_params: float, expert_params: float,
            a2a_seconds: float, impl: Implementation) -> dict:
    """The MoE figures of one candidate, for `--json` and the table's all-to-all line
    (`all_to_all_bytes` is one call's payload per GPU; with ep = 1 there are no calls)."""
    tokens = ffn_tokens(lay, lay.micro_batch * (seq // lay.cp))
    calls = all_to_alls(dispatch_reruns(lay, impl))
    layers = -(-shape.layers // lay.pp)
    payload = dispatch_bytes(shape, tokens, dtype_bytes)
    return {
        "ep": lay.ep, "expert_shard": expert_shard(lay), "load_factor": load_factor(shape, lay),
        "dense_params_per_gpu": dense_params, "expert_params_per_gpu": expert_params,
        "all_to_all_bytes": payload,
        "all_to_alls_per_step": calls * layers * micro_batches if lay.ep > 1 else 0,
        "all_to_all_crosses_nodes": lay.ep > 1 and cluster.crosses_nodes(lay.ep, lay.tp),
        "all_to_all_s": a2a_seconds,
    }


def describe_model(shape: ModelShape) -> str:
    """The table header's note on experts ('' for a dense model)."""
    if not shape.is_moe:
        return ""
    return (f", {shape.active_params / 1e9:.3g}B active per token ({shape.n_experts} experts, "
            f"top {shape.top_k}, imbalance allowance {shape.moe_imbalance:g})")


def describe_best(moe: dict | None, step_time_s: float) -> list[str]:
    """The table's all-to-all line for the best candidate (none for a dense model)."""
    if moe is None:
        return []
    where = "across nodes" if moe["all_to_all_crosses_nodes"] else "inside a node"
    gb = 1e9
    line = (f"best: ep {moe['ep']}: experts {moe['expert_params_per_gpu'] / gb:.2f}B + dense "
            f"{moe['dense_params_per_gpu'] / gb:.2f}B parameters per GPU, expert states over "
            f"{moe['expert_shard']} ZeRO shards; ")
    if moe["ep"] == 1:
        return [line + "no all-to-all (every expert on every GPU)"]
    return [line + f"all-to-all {moe['all_to_alls_per_step']} x {moe['all_to_all_bytes'] / 1e6:.1f}"
            f" MB per GPU per step {where}, load x{moe['load_factor']:g}: "
            f"{moe['all_to_all_s']:.3g} s ({100 * moe['all_to_all_s'] / step_time_s:.0f}% of "
            "the step)"]
