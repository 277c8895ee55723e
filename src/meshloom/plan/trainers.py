"""How public trainers run a training step, as the planner's implementation keys
(plan/implementation.py): `meshloom plan --trainer NAME` plans a layout the way that trainer
runs it, and the validation (benchmarks/planner_validation.py) plans each published run with
its trainer's keys. Each key is cited below from the trainer's own code or configs; a run that
differs from its trainer's defaults says so in its own `implementation` (runs.json).

A trainer's keys say how its code runs a layout, not which layouts it supports (llm-foundry
shards with FSDP only, for instance): pin the layout with `--fix`, which also overrides any
of these keys.
"""

from __future__ import annotations

from collections.abc import Iterator

from meshloom.plan import PlanError

# How each public trainer runs (plan/implementation.py keys), matched on the start of the
# row's `trainer`; a row may override with its own "implementation". Fused kernels count as
# `compile` (Megatron's fused softmax/bias-GeLU/LayerNorm, flash-attention's training stack,
# TinyLlama's fused rotary/SwiGLU/loss); Megatron-style selective recompute reruns the
# attention core only.
# llm-foundry's benchmark script runs MPT with `attn_impl: triton` unless told otherwise (the
# Triton FlashAttention of 2023); flash-attention's training table is FlashAttention 1's (its
# 189 TFLOP/s headline is the FlashAttention column of the FlashAttention-2 paper's Table 1).
# The Triton kernel is priced as FlashAttention 1 (kernel_table.PRICED_AS: no benchmark gives its
# own rate), whose rates are published for the A100 only; the H100 table prices it at its A100
# ratio to FlashAttention-2 (`attention_ratio_from`, derived), and a GPU whose table has neither
# keeps FlashAttention-2's rate and says so (`unpriced`).
# Megatron-LM 2021 (Table 1) waited on every pipeline send and receive and synchronized the
# device (p2p_communication._communicate), each tp rank sending 1/tp of the activation
# (--scatter-gather-tensors-in-pipeline, on by default), and all-reduced the gradients after
# the whole forward-backward schedule (default --DDP-impl local: allreduce_gradients());
# DeepSpeed's pipeline engine (BLOOM's Megatron-DeepSpeed) sends synchronously
# (runtime/pipe/p2p.py) and partitions a stage's output over the tensor-parallel group
# (is_pipe_partitioned = is_model_parallel).
# Megatron-Core and NeMo overlap tensor-parallel communication with TransformerEngine's
# userbuffers (`ub_tp_comm_overlap` / `tp_comm_overlap` in NeMo's recipes), which runs the
# overlapped GEMMs in pieces (tp_overlap_chunks).
# Data-parallel collectives are bucketed as each trainer buckets them (`dp_buckets`): Megatron-LM
# 2021's local DDP all-reduces its contiguous buffer in one call, Megatron-Core (and NeMo on it)
# in buckets of max(40M, 1M x dp) parameters, DeepSpeed's ZeRO in 5e8-element buckets, PyTorch
# DDP (Lightning) in 25 MiB ones; FSDP's gathers go unit by unit whatever the trainer.
# NeMo's recipes set gradient_accumulation_fusion (the weight-gradient GEMM adds into the fp32
# main gradient); Megatron-LM 2021's paper lists no such fusion, so its rows pay the pass.
# llm-foundry's MPT takes its loss with flash-attn 1's xentropy kernel (ComposerMPTCausalLM's
# `loss_fn` defaults to `fused_crossentropy` since mosaicml/examples#251, March 2023, which
# imports flash-attn v1.0.3's; the benchmark yamls leave it unset: MPT_FUSED_CE in runs.json),
# flash-attention's training scripts with apex's, the same kernel (`xentropy`), and TinyLlama
# with flash-attn 2's `CrossEntropyLoss` on the csrc/xentropy extension its README builds.
# torchtitan's loss stays eager with torch.compile on: `apply_compile` compiles each
# TransformerBlock, and `loss_fn` is `F.cross_entropy(pred.flatten(0, 1).float(), ...)` outside
# them (torchtitan's parallelize_llama.py and train.py of its 2024 performance runs). From
# April 2025 (pytorch/torchtitan#1033) `build_cross_entropy_loss` compiles the loss too when
# the run compiles: runs.json's compiled 2025 rows say `cross_entropy=fused`.
# Megatron-LM 2021 and Megatron-DeepSpeed take the loss with Megatron's unfused
# vocab_parallel_cross_entropy on an fp32 copy of the logits (post_language_model_processing's
# `vocab_parallel_cross_entropy(output.float(), labels)`, GPTModelPipe's CrossEntropy);
# Megatron-Core and NeMo do too unless `cross_entropy_loss_fusion` is set, as NeMo's Nemotron
# yaml and the launcher's llama3_1 yamls set it (`megatron_fused`); a run whose yaml leaves it
# out says so in its own `implementation` (MCORE_CE in runs.json).
# Both run a SwiGLU through Megatron-Core's fused bias_swiglu_impl (bias_activation_fusion, on
# in NeMo's recipes and Megatron-LM's defaults), which keeps only the first GEMM's output.
# Under grouped-query attention, Megatron-Core and NeMo hand the shared K/V heads to
# TransformerEngine's attention (`num_gqa_groups`) and TinyLlama to flash-attn 2 (lit_gpt/
# model.py: "we do not need to do this as flash attention 2 already support GQA"), so neither
# copies them out per head (`expand_kv` off); torchtitan's Llama does (`repeat_kv`).
# The optimizer: Megatron, NeMo and Megatron-DeepSpeed step with Apex's or TransformerEngine's
# FusedAdam, flash-attention's training configs with Apex's (pile/base.yaml `adamw-apex`);
# torchtitan builds PyTorch's AdamW with `foreach = not fused` and `--optimizer.fused` off by
# default (`foreach`); TinyLlama's pretrain script passes `foreach=False` (`for_loop`), and
# Composer's DecoupledAdamW, llm-foundry's optimizer, loops over the parameters (`for_loop`).
# torchtitan shards with FSDP2 (`fully_shard`), whose all-gathers are copied out of their flat
# buffer into each parameter (`foreach_all_gather_copy_out`, `fsdp_copy_out`); FSDP1 (Composer,
# Lightning) and meshloom's ZeRO-3 use the gathered buffer's views. torchtitan's Llama rotates q
# and k as complex numbers (`apply_rotary_emb`: `view_as_complex`), which Inductor leaves to
# eager kernels (pytorch/torchtitan#15: `rope_complex`). TinyLlama's pretrain script accumulates
# its 8 micro-batches under `fabric.no_backward_sync` (FSDP's `no_sync`): one reduce-scatter a
# step, whole gradients kept in between (`fsdp_no_sync`). Composer and Lightning shard with
# FSDP1, whose flat parameter receives every backward's gradients through autograd's
# concatenation of its views' (`fsdp_flat_param`). Lightning's `bf16-mixed` FSDP precision
# (since 2.0.3; TinyLlama's requirements.txt tracks Lightning's master of 2023) keeps the
# working parameters fp32 (`MixedPrecision(param_dtype=float32, reduce_dtype=bfloat16)`) and
# computes under autocast (`fp32_params`): fp32 gathers and gradients, a weight cast each
# way every micro-batch, as Lightning's `bf16` AMP over DDP does for
# flash-attention's training scripts, whose larger configs (gpt3l/xl, 2.7B) step PyTorch's
# ZeroRedundancyOptimizer over DDP (`adamw-zero` with `DDPStrategyZero1`: the gradient
# all-reduced by DDP, the updated parameters broadcast, `zero_redundancy_optimizer`).
# Composer (MPT's `fsdp_wrap_fn` wraps each MPTBlock), Lightning (lit-gpt's auto-wrap policy
# {Block}) and torchtitan's 2024 `apply_fsdp` (`fully_shard` on each TransformerBlock, then on
# the model) leave the embedding, final norm and head to the root unit, which FSDP1
# (`_post_forward_reshard`: "Do not free the root's parameters in the post-forward") and FSDP2
# (`_lazy_init`: "For the root, do not reshard after forward") keep gathered from the start of
# forward to its backward (`fsdp_root=outer`). Both reshard every unit after its backward, so
# each micro-batch's forward gathers its first units again (`fsdp_carry` off, in OTHER_LOOP).
# Composer evaluates the model's training metrics on every micro-batch
# after its backward (`_eval_train_metrics`), and llm-foundry's MPT declares two,
# LanguageCrossEntropy and LanguagePerplexity, each an eager cross entropy over the logits
# (`train_metrics=composer`).
# Gradients cross the data-parallel group in 16 bits for Megatron-LM 2021 (fp16), NeMo
# (`grad_sync_dtype: bf16`), llm-foundry (Composer's 2023 `DEFAULT`: FSDP reduce_dtype unset, so
# bf16) and TinyLlama (Lightning's `bf16-mixed` FSDP); in fp32 for torchtitan (FSDP2,
# `mixed_precision_reduce = "float32"` by default), flash-attention's Lightning DDP (autocast
# over fp32 parameters: fp32 gradients) and BLOOM, as in meshloom by default
# (`parallel.reduce_dtype`). BLOOM's Megatron-DeepSpeed ran bf16 with ZeRO stage 0, which
# DeepSpeed's pipeline engine hands to its BF16_Optimizer (`deepspeed_bf16_optimizer`, DeepSpeed
# PR #1801, "fp32 reduction" in its commit list): the whole fp32 gradient buffer all-reduced,
# whole fp32 master copy and gradients on every rank, only the moments sharded.
# torchtitan's sequence parallel is DTensor's Shard(1) on batch-first tensors, rearranged around
# each collective (`sp_copies=batch`), and its async TP is published as a forward-pass gain
# (`tp_overlap_backward` off; both in implementation.py and docs/plan-step-time.md).
# llm-foundry's FSDP1 steps are planned with their collectives waited on (`fsdp_prefetch` off),
# because its own controlled sweep says so: the same MPT model, GPUs and software, only the
# micro-batch changed (scripts/train/benchmarking/larger_mb_1.md at mosaicml/llm-foundry
# beb8dee; benchmarks/llmfoundry_mb_sweep.py). A fixed cost per micro-batch shows as throughput
# rising with the micro-batch: 7B on 8 A100s runs 3366, 4044, 4513, 4715 tokens/s per GPU at 1,
# 2, 4, 6 sequences; waited-on gathers and reduce-scatters reproduce every ratio to the first
# within 2%, overlapped ones predict 1.16 where 1.40 ran; on its H100 table's multi-node rows
# that the validation does not hold, 3.5% against 10.3% off. Why they serialize is not identified:
# read for these runs (`limit_all_gathers`, Composer's `BACKWARD_POST`), FSDP1 issues each
# gather one unit ahead. TinyLlama, also FSDP1, keeps the overlap: no sweep of its own.
# Megatron-Core's attention (Megatron-LM, NeMo) projects q, k and v with one column-parallel
# `linear_qkv` of (heads + 2 kv_heads) x head_dim columns, and lit-gpt's (TinyLlama's) with one
# `attn` linear of the same width; meshloom's and torchtitan's Llama run wq, wk and wv apart
# (`fused_qkv`). GPT-style blocks (MPT, GPT-3, BLOOM) are priced with one projection anyway.
# flash-attention's GPT configs (configs/experiment/pile/gpt3*-flash.yaml) set
# `residual_in_fp32: True` with `fused_dropout_add_ln: True`: each block's dropout, residual
# add and LayerNorm are one kernel that reads the 16-bit branch (its FusedDense layers cast
# to autocast's dtype) and the fp32 residual, and writes the fp32 sum and the normalised
# output in the branch's dtype (`residual_stream=fp32`; the first block's norm, fed the fp32
# token and position embeddings, writes fp32, not priced).
# TinyLlama's residual stream is fp32 too (`residual_stream=fp32_cast`): under Lightning's
# fp32-parameter autocast its `wte` returns fp32, each `x = x + h` adds the bf16 branch into
# it, and its FusedRMSNorm (flash-attn's dropout_add_ln kernel, whose output takes the
# input's dtype, `otype = itype` in ln_api.cpp) reads and writes fp32, cast to bf16 by
# autocast once for the one `attn` linear and once for the MLP: xformers' SwiGLU with
# `_pack_weights=False` still takes its packed path (`swiglu_packedw`, whose autocast wrapper
# casts x once) because FSDP1's flat parameter lays w1 and w2 side by side, where
# `stack_or_none` finds them stacked; that op saves x, x1 and x2 and reruns silu(x1)·x2 in its
# backward (`fused_swiglu`: 3F kept is the nearest count; it keeps 2F). Its README lists
# "fused SwiGLU" among its speed-ups; had the op fallen back (xformers' fused autograd op
# declines bf16 autocast), its silu and product would run as two eager kernels and x be cast
# twice.
# KempnerForge (KempnerInstitute/KempnerForge at 01b461a, the commit of its April 2026 H200
# MFU report) builds the model in bf16 and shards it with FSDP2 (`fully_shard` per block, then
# the root over the embedding, final norm and head: `fsdp_root=outer`), whose default policy
# reduces in fp32 (`param_dtype=param_dtype, reduce_dtype=torch.float32`, parallel.py): no fp32
# master copy, so AdamW's moments are bf16 too (`optimizer_state=bf16`; `--optimizer.fused`
# in its benchmark script: `optimizer_impl=fused`, 14 bytes a parameter on bf16 state).
# Earlier micro-batches of a step run under `set_requires_gradient_sync(False)`
# (training/grad.py: `fsdp_no_sync`). It compiles the whole model (`torch.compile(model)` after
# activation checkpointing and FSDP) and takes the loss outside it, `F.cross_entropy` on the
# bf16 logits of its bf16 model with no autocast, so the log-softmax and its gradients stay
# bf16 (scripts/train.py, model/embedding.py's plain `nn.Linear` head:
# `cross_entropy=eager_bf16`); attention is SDPA with the kv heads
# repeated (`repeat_interleave`: `expand_kv`), cuDNN's kernel on its H200s (its 13B profile
# lists `aten::_cudnn_attention_backward`); RoPE is real-valued and q, k, v are three linears.
# Its tensor parallel (distributed/tensor_parallel.py) is DTensor's with sequence parallel on
# the norms (`sp_copies=batch`) and no async TP; the token table stays whole on every tp rank,
# its output sliced to the sequence shard by the first norm, and the head is column-parallel
# with `output_layouts=Replicate()`, its logits gathered whole onto every tp rank, each rank
# computing the whole loss (`tp_ends=gathered`). Its plan puts `ColwiseParallel(input_layouts=
# Shard(1))` on q, k, v, gate and up each, with no `PrepareModuleInput` on the attention or the
# feed-forward, so each of the five gathers the norm's output itself and reduce-scatters its
# own input gradient (`tp_input_gathers=per_linear`). Pipeline stages run plain TP, no
# sequence parallel, and leave both ends unsplit. Its pipeline
# (distributed/pipeline_parallel.py) gives each stage an even share of the blocks, the first ones
# a block more (`pp_split=even`), and runs torch.distributed.pipelining's schedules over FSDP2
# built with `reshard_after_forward=False` (`pp_fsdp=pytorch`, as torchtitan's).
# What every other trainer's loop does unlike meshloom's (implementation.py). Their attention
# is FlashAttention-2's unless the trainer's entry says otherwise: torchtitan's SDPA on an H100
# ran it before PyTorch 2.9 put cuDNN first, and which kernel TransformerEngine picked for NeMo
# is not cited.
OTHER_LOOP = {"meshloom_block": False, "free_unbucketed_grads": False, "clip_in_optimizer": False,
              "attention_kernel": "fa2", "sp_copies": "none", "fsdp_carry": False}
TRAINERS: dict[str, dict] = {
    "megatron-lm": {"compile": True, "tp_overlap": True, "tp_overlap_chunks": True,
                    "grad_reduce_dtype": "bf16", "fused_qkv": True,
                    "dp_overlap": True, "selective_elementwise": False, "pp_split": "even",
                    "fused_swiglu": True, "expand_kv": False, "dp_buckets": "mcore",
                    "cross_entropy": "megatron", "cp_ring": "te"},
    "nemo": {"compile": True, "tp_overlap": True, "tp_overlap_chunks": True, "dp_overlap": True,
             "grad_reduce_dtype": "bf16", "fused_qkv": True,
             "selective_elementwise": False, "fused_grad_accumulation": True,
             "cross_entropy": "megatron_fused",
             "pp_split": "even", "fused_swiglu": True, "expand_kv": False,
             "dp_buckets": "mcore", "cp_ring": "te", "qkv_transpose": True},
    "megatron-deepspeed": {"compile": True, "selective_elementwise": False,
                           "grad_reduce_dtype": "fp32", "deepspeed_bf16_optimizer": True,
                           "p2p_blocking": True, "pp_scatter_gather": True,
                           "cross_entropy": "megatron",
                           "dp_buckets": "deepspeed"},
    "flash-attention": {"compile": True, "attention_kernel": "fa1", "cross_entropy": "xentropy",
                        "grad_reduce_dtype": "fp32", "fp32_params": True,
                        "residual_stream": "fp32",
                        "zero_redundancy_optimizer": True},
    "tinyllama": {"compile": True, "expand_kv": False, "cross_entropy": "xentropy",
                  "fused_qkv": True, "residual_stream": "fp32_cast", "fused_swiglu": True,
                  "optimizer_impl": "for_loop", "grad_reduce_dtype": "bf16",
                  "fsdp_no_sync": True, "fsdp_flat_param": True, "fp32_params": True,
                  "fsdp_root": "outer"},
    "llm-foundry": {"compile": False, "attention_kernel": "triton",
                    "cross_entropy": "xentropy", "optimizer_impl": "for_loop",
                    "grad_reduce_dtype": "bf16", "fsdp_flat_param": True,
                    "train_metrics": "composer", "fsdp_prefetch": False,
                    "fsdp_root": "outer"},
    "kempnerforge": {"compile": True, "cross_entropy": "eager_bf16", "tp_ends": "gathered",
                     "tp_input_gathers": "per_linear",
                     "optimizer_impl": "fused",
                     "optimizer_state": "bf16", "fsdp_copy_out": True, "grad_reduce_dtype": "fp32",
                     "fsdp_no_sync": True, "fsdp_root": "outer", "sp_copies": "batch",
                     "attention_kernel": "sdpa", "pp_split": "even", "pp_fsdp": "pytorch"},
    "torchtitan": {"compile": False, "op_sac": True, "cross_entropy": "eager",
                   "optimizer_impl": "foreach", "fsdp_copy_out": True, "rope_complex": True,
                   "grad_reduce_dtype": "fp32", "sp_copies": "batch",
                   "tp_overlap_backward": False, "fsdp_root": "outer", "pp_fsdp": "pytorch",
                   "pp_w_order": "lagged"},
}


def trainer_key(trainer: str) -> str | None:
    """The `TRAINERS` entry a trainer's name starts with (a run's `trainer` in runs.json, e.g.
    "Megatron-DeepSpeed (bigscience fork)"), or None."""
    name = trainer.lower()
    return next((k for k in TRAINERS if name.startswith(k)), None)


def trainer_impl(trainer: str) -> dict:
    """A public trainer's implementation keys; none of them runs meshloom's block, so its
    activations are counted as Korthikanti et al. count them (`meshloom_block` off), and each
    keeps its gradients and clips them in a pass of its own. "meshloom" is meshloom's own
    loop: no keys (every default is meshloom's)."""
    if trainer == "meshloom":
        return {}
    key = trainer_key(trainer)
    if key is None:
        raise PlanError(f"--trainer: unknown trainer '{trainer}'; one of meshloom, "
                        + ", ".join(TRAINERS))
    return {**OTHER_LOOP, **TRAINERS[key]}


# The layouts each trainer's code can run, as of the version its TRAINERS entry models (the
# versions of the validation's published runs); `--trainer` searches only these. Each rule
# names the layout key it limits, so a key the user pins with --fix is left to the user.
# - Megatron-Core (megatron-lm, and NeMo 24.09-24.11 on it) shards only the optimizer state
#   (its distributed optimizer, ZeRO-1; DDP without it) and schedules a pipeline as 1F1B or
#   interleaved 1F1B (pipeline_parallel/schedules.py `get_forward_backward_func`).
# - Megatron-DeepSpeed runs no context parallel, and DeepSpeed's pipeline engine refuses ZeRO-2
#   and -3 ("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism", runtime/pipe/
#   engine.py) and runs its own 1F1B TrainSchedule (runtime/pipe/schedule.py).
# - flash-attention's Lightning training scripts, TinyLlama's lit-gpt and the 2023 llm-foundry
#   are data-parallel only: DDP with ZeroRedundancyOptimizer or its ZeRO-2 variant
#   (training/src/utils/ddp_zero1.py, ddp_zero2.py); FSDP through Fabric's FSDPStrategy and
#   Composer's `fsdp_config` (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD: Composer's SHARDING_MAP), each
#   checkpointing whole blocks (lit-gpt's `activation_checkpointing_policy={Block}`,
#   Composer's `activation_checkpointing` of the FSDP-wrapped MPT blocks); flash-attention's
#   checkpointing recomputes parts of the feed-forward (`mlp_checkpoint_lvl` in its
#   experiment configs), which the planner has no mode for.
# - torchtitan (its 2024 parallelize_llama.py) shards with FSDP2 (ZeRO-3), resharding each
#   block after forward except under pipeline parallel, where PyTorch's pipelining holds every
#   unit gathered for the step and reduces whole gradients once (`pp_fsdp=pytorch`: ZeRO-3, not
#   meshloom's ZeRO-2, which keeps no whole gradients), and runs DDP only as 1-D parallelism
#   ("DDP has not supported > 1D parallelism").
# - KempnerForge (01b461a) shards its dp_shard ranks with FSDP2's `fully_shard` and nothing else
#   (distributed/parallel.py; `dp_replicate` makes HSDP of it): no DDP, no ZeRO-1/2. Its
#   "selective" checkpointing wraps each whole Attention module (`apply_ac`), projections
#   included, which is none of the planner's selective policies, so it is planned with none or
#   full recompute; its pipeline builds one stage a rank (`build_stage_module`), which runs
#   1F1B or GPipe (its interleaved 1F1B asks for a list of stages no builder makes). Its tensor
#   parallel runs sequence parallel outside a pipeline and never inside one (`seq_parallel =
#   not is_pp_stage and not tie and not is_moe`: the rules are for its untied dense models).
_ONLY_DP = "is data-parallel only"
_WHOLE_BLOCKS = "recomputes whole blocks only"


def _megatron_core(lay) -> Iterator[tuple[str, str]]:
    if lay.dp_shard > 1 and lay.zero >= 2:
        yield "zero", "shards only the optimizer state (ZeRO-1, its distributed optimizer)"
    if lay.pp > 1 and lay.schedule not in ("1f1b", "interleaved_1f1b"):
        yield "schedule", "schedules a pipeline as 1F1B or interleaved 1F1B"


def _megatron_deepspeed(lay) -> Iterator[tuple[str, str]]:
    if lay.cp > 1:
        yield "cp", "has no context parallel"
    if lay.pp > 1 and lay.zero >= 2:
        yield "zero", "refuses ZeRO-2 and ZeRO-3 with a pipeline (DeepSpeed's pipeline engine)"
    if lay.pp > 1 and lay.schedule != "1f1b":
        yield "schedule", "runs DeepSpeed's 1F1B pipeline schedule"


def _data_parallel_only(zeros: tuple[int, ...], recomputes: tuple[str, ...], why: str):
    def rule(lay) -> Iterator[tuple[str, str]]:
        for key in ("tp", "pp", "cp"):
            if getattr(lay, key) > 1:
                yield key, _ONLY_DP
        if lay.dp_shard > 1 and lay.zero not in zeros:
            yield "zero", "shards as ZeRO-" + "/".join(map(str, zeros)) + " only"
        if lay.recompute not in recomputes:
            yield "recompute", why
    return rule


def _torchtitan(lay) -> Iterator[tuple[str, str]]:
    if lay.dp_shard <= 1:
        return
    if lay.zero == 1:
        yield "zero", "shards with FSDP2 (ZeRO-2/3) or runs DDP, never ZeRO-1"
    if lay.zero == 0 and (lay.tp > 1 or lay.pp > 1 or lay.cp > 1):
        yield "zero", "runs DDP only as 1-D parallelism"
    if lay.zero == 2:
        yield "zero", ("shards with FSDP2: ZeRO-3, resharding blocks after forward, or under a "
                       "pipeline held gathered for the step (pp_fsdp=pytorch)")


def _kempnerforge(lay) -> Iterator[tuple[str, str]]:
    if lay.dp_shard > 1 and lay.zero != 3:
        yield "zero", "shards its data-parallel ranks with FSDP2 only (ZeRO-3)"
    if lay.recompute not in ("none", "full"):
        yield "recompute", ("recomputes whole blocks or whole attention modules, and the second "
                            "is none of the planner's selective modes; plan none or full")
    if lay.pp > 1 and (lay.schedule not in ("1f1b", "gpipe") or lay.v > 1):
        yield "schedule", "builds one pipeline stage a rank and runs it as 1F1B or GPipe"
    if lay.tp > 1 and lay.sp != (lay.pp == 1):
        yield "sp", ("runs tensor parallel with sequence parallel outside a pipeline and "
                     "without it inside one")


LAYOUT_RULES = {
    "megatron-lm": _megatron_core,
    "nemo": _megatron_core,
    "megatron-deepspeed": _megatron_deepspeed,
    "flash-attention": _data_parallel_only(
        (0, 1, 2), ("none",), "recomputes parts of the feed-forward (mlp_checkpoint_lvl), "
        "which the planner does not model; plan it without recompute"),
    "tinyllama": _data_parallel_only((0, 2, 3), ("none", "full"), _WHOLE_BLOCKS),
    "llm-foundry": _data_parallel_only((0, 2, 3), ("none", "full"), _WHOLE_BLOCKS),
    "torchtitan": _torchtitan,
    "kempnerforge": _kempnerforge,
}


def layout_problem(trainer: str, lay, pinned: frozenset = frozenset()) -> str | None:
    """Why `trainer` cannot run layout `lay` (None if it can, or for meshloom), leaving alone
    the keys the user pinned (`pinned`): --fix overrides the trainer's limits as its keys."""
    rule = LAYOUT_RULES.get(trainer)
    for key, why in rule(lay) if rule else ():
        if key not in pinned:
            return f"{trainer} {why}"
    return None
