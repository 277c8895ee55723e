"""How the training code runs a layout, as far as the step time depends on it: which kernels are
fused and which communication hides behind which compute. The defaults are what `meshloom
train` does with its default config; the other settings describe the Megatron-style options
published runs use, selectable with `meshloom plan --fix KEY=true|false`.

- `compile`: elementwise kernels fused and the cross entropy fused over the logits
  (`train.compile` in meshloom; Megatron's and TransformerEngine's fused kernels). Off: eager
  PyTorch, one kernel per operation (plan/step_kernels.py counts both).
- `tp_overlap`: tensor-parallel all-gathers / reduce-scatters run under the neighbouring GEMMs
  (Megatron's `--tp-comm-overlap`). meshloom issues them on the critical path.
- `tp_overlap_chunks`: with `tp_overlap` and SP, the overlapped GEMMs run in pieces, each at
  its piece's rate, as TransformerEngine's userbuffers overlap runs them (Megatron-Core and
  NeMo with `tp_comm_overlap`): the GEMMs that read an all-gathered input (the projections to
  q/k/v and the feed-forward's first ones) forward, and the input-gradient GEMMs of the two
  row-parallel projections backward, in tp ring-exchange chunks of 1/tp of the tokens; the
  row-parallel projections forward in 4 pipelined splits before their reduce-scatter
  (`split_overlap_ag` / `split_overlap_rs`, TE's default `num_splits` 4). Off: each GEMM
  whole, as meshloom runs them. A no-op without `tp_overlap`, SP, or with tp = 1.
- `tp_overlap_backward`: with `tp_overlap`, the backward's tp collectives (and those its
  recompute reruns) overlap too, as TransformerEngine's under Megatron do. Off: only the
  forward's, as torchtitan's async TP (PyTorch Inductor's micro-pipeline pass) was published to
  speed up: "Up to ~29% forward pass speedup and ~8% E2E speedup" (its announcement,
  discuss.pytorch.org/t/209487); the backward's collectives wait, with their copies
  (`sp_copies`).
- `dp_overlap`: ZeRO-1/2 reduce-scatter the gradients bucket by bucket during the last
  micro-batch's backward and all-gather the updated parameters during the next forward
  (Megatron's distributed optimizer with `--overlap-grad-reduce --overlap-param-gather`).
  meshloom reduce-scatters after the backward and gathers after the step.
- `ddp_overlap`: DDP (no ZeRO) all-reduces its gradient buckets during the last micro-batch's
  backward (meshloom, PyTorch DDP). Off: one all-reduce after the whole backward, exposed
  (Megatron-LM 2021's default `--DDP-impl local`, whose `allreduce_gradients()` runs after the
  forward-backward schedule).
- `fsdp_prefetch`: ZeRO-3 (and FSDP1's ZeRO-2, below) gathers the next unit while the current
  one computes (meshloom does; off, every gather and reduce-scatter waits, and FSDP1's ZeRO-0
  all-reduces too, as llm-foundry's FSDP1 runs behave: trainers.py).
- `fsdp_no_sync`: ZeRO-3 accumulates whole unsharded gradients over a step's micro-batches and
  reduce-scatters them only on the last (PyTorch FSDP's `no_sync()`, which Lightning Fabric's
  `no_backward_sync` and Accelerate's gradient accumulation enter: TinyLlama's pretrain script).
  Every micro-batch still gathers twice (FULL_SHARD frees the gathered parameters in backward
  even then); the whole gradients stay in memory (the gradient dtype's bytes for every parameter
  of the rank) and every micro-batch after the first adds into them; meshloom
  (`parallel.reduce_once`) sums them in fp32, 4 bytes a parameter. Off (meshloom's default,
  torchtitan, Composer): every micro-batch reduce-scatters. A no-op unless zero = 3 (or
  FSDP1's zero = 0 or 2) with more than one micro-batch.
- `fsdp_flat_param`: ZeRO-3 as PyTorch's FSDP1 runs it: each unit's parameters are views of
  one flat parameter, so every backward's gradients reach it through autograd's concatenation
  of the views' gradients (`split_with_sizes` backward: a read and a write of every gradient,
  in the gradient dtype, each micro-batch, `fsdp_no_sync` or not), and FSDP casts the flat
  gradient to the reduce dtype before each reduce-scatter when the two differ
  (`_post_backward_hook`: `flat_param.grad.to(reduce_dtype)`). Off (meshloom's ZeRO-3, FSDP2):
  the gradients are packed into the send buffer in the reduce dtype, once per reduce-scatter.
  Composer (llm-foundry) and Lightning (TinyLlama) run FSDP1. With zero = 2 it is FSDP1's
  SHARD_GRAD_OP: each unit is gathered in every micro-batch's forward and kept to its backward,
  where it is reduce-scattered, unit by unit (meshloom's ZeRO-2 gathers once after the step),
  into fp32 gradient shards (`fp32_gradient_shards`; meshloom's are bf16);
  with zero = 0 its NO_SHARD: every micro-batch's backward all-reduces each unit's flat
  gradient (meshloom's DDP all-reduces its buckets once a step). A no-op with zero = 1.
- `fp32_params`: the trainer keeps fp32 parameters and computes under autocast, whatever it
  shards: every forward casts each weight to bf16 (read 4, write 2) and every backward casts
  its weight gradient back to fp32, as meshloom's unsharded layouts do (compute.casts_weights);
  the bf16 casts are saved for backward (without recompute, 2 bytes a parameter of the rank's
  layers); gradients are fp32 (their shards, and whole ones under `fsdp_no_sync`), and the
  model states are fp32 parameters with no separate master. Parameters travel in fp32: ZeRO-3's
  gathers, ZeRO-1/2's gather after the step. Lightning's `bf16-mixed` under DDP (autocast over
  the module's fp32 parameters: flash-attention's training scripts) and under FSDP
  (`MixedPrecision(param_dtype=float32, reduce_dtype=bfloat16)` since Lightning 2.0.3,
  lightning_fabric/plugins/precision/fsdp.py: TinyLlama) run so. Off (meshloom's ZeRO stages,
  Megatron, NeMo, Composer, torchtitan): bf16 working parameters. A no-op in fp32 training.
- `zero_redundancy_optimizer`: ZeRO-1 as PyTorch's `ZeroRedundancyOptimizer` runs it over DDP
  (flash-attention's `adamw-zero` under its `DDPStrategyZero1`): DDP all-reduces the whole
  gradient in its buckets during the last micro-batch's backward (as `ddp_overlap` prices
  DDP), each rank steps its shard, and the updated parameters are broadcast from the ranks
  that own them, a gather's bytes in the parameter dtype, after the step. Off (meshloom,
  Megatron's distributed optimizer): ZeRO-1 reduce-scatters. A no-op unless zero = 1.
- `fsdp_copy_out`: each ZeRO-3 all-gather lands in a flat buffer that is then copied out into
  every parameter's own storage on the compute stream (PyTorch's FSDP2,
  `foreach_all_gather_copy_out`: `torch.split_with_sizes_copy`), a read and a write of the
  gathered bytes each time. Off (meshloom's ZeRO-3, FSDP1): the parameters are views of the
  gathered buffer.
- `fsdp_root`: which parameters ZeRO-3's root unit holds, gathered once a micro-batch at the
  start of its forward and kept to its backward (plan/memory.py `zero3_root_params`): `head`
  (meshloom's parallel/fsdp.py: the final norm and the head, or a tied token table; the
  embedding is a unit of its own, gathered for forward only and freed after it) or `outer`
  (FSDP1 and FSDP2 wrapping each block and then the model, as Composer, Lightning and
  torchtitan's 2024 `apply_fsdp` do: every parameter outside the blocks, embedding
  included; neither frees the root after forward, FSDP1's `_post_forward_reshard` and
  FSDP2's `_lazy_init`). Either way the parameters outside the blocks are gathered once a
  micro-batch, exposed (nothing runs before them), and the blocks twice (plan/timing.py).
  A no-op unless zero = 3.
- `fsdp_carry`: between two micro-batches of a step, ZeRO-3 holds what the next forward opens
  with (meshloom's parallel/fsdp.py under plain accumulation, pp = 1): the first block, and a
  root holding the token table (tied, or `fsdp_root=outer`), stay gathered from the backward
  before, and the embedding is gathered behind that backward; each later micro-batch makes one
  gather fewer (two with such a root), and none of its first gathers is exposed. Off (FSDP1
  and FSDP2, which reshard every unit after its backward): each micro-batch gathers them
  again as its forward opens. A no-op unless zero = 3 with more than one micro-batch.
- `reshard_after_forward`: ZeRO-3 frees each unit after its forward and gathers it again for
  its backward (meshloom's `parallel.reshard_after_forward` default; FSDP's FULL_SHARD). Off:
  every unit stays gathered from its forward to its backward, so the peak holds all of the
  rank's parameters gathered (`zero3_gathered_params`) and no backward gathers; meshloom then
  also keeps them gathered between the step's micro-batches (with `fsdp_carry`, in a pipeline
  too): one gather a unit a step, behind the first forward. A no-op unless zero = 3.
- `pp_fsdp`: how ZeRO-3 runs under a pipeline (pp > 1). `meshloom`: as without one (each
  unit resharded as `reshard_after_forward` says, every micro-batch's gradients
  reduce-scattered behind its backward, chunk by chunk: parallel/pipeline.py). `pytorch`: as
  PyTorch's pipelining drives FSDP2 (torch.distributed.pipelining, stage.py: every backward
  runs after `set_reshard_after_backward(False)` and `set_requires_gradient_sync(False)`,
  and `perform_reduce_grad` runs the post-backward once the stage's last backward is done;
  torchtitan also builds its blocks with `reshard_after_forward` off under a pipeline): each
  unit is gathered in the stage's first forward and stays gathered to the step's end (one
  gather a step, `zero3_held_step`), each backward's gradients accumulate whole in the reduce
  dtype (FSDP2's `to_accumulated_grad_if_needed` upcasts the first micro-batch's, later ones
  are added in), and the whole gradients are reduce-scattered once, after the stage's last
  backward, with nothing beside them (FSDP2's final callback makes the compute stream wait).
  A no-op unless zero = 3 and pp > 1.
- `pp_w_order`: where interleaved_zb puts its weight-gradient passes
  (parallel/pipeline_schedule.py). `filled`: meshloom's, each W where its rank would otherwise
  wait (`filled_lists`). `lagged`: PyTorch's ScheduleInterleavedZeroBubble's, each W r
  input-gradient passes after its own on rank r (`lagged_lists`; torchtitan; the lists are
  torch's action for action, benchmarks/pp_lists_vs_torch.py). Both have the same F/I order,
  unit-clock bubble and peaks; at uneven costs they differ. A no-op for other schedules.
- `grad_reduce_dtype`: the dtype data-parallel gradient collectives carry in bf16 training:
  `fp32` (meshloom's `parallel.reduce_dtype` default, docs/mixed-precision.md; PyTorch FSDP2 as
  torchtitan configures it, `mixed_precision_reduce = "float32"`; DDP under autocast, whose
  gradients are fp32) or `bf16` (16 bits: Megatron-LM 2021's fp16, NeMo's `grad_sync_dtype:
  bf16`, Composer's 2023 `DEFAULT`, meshloom with `parallel.reduce_dtype = "bf16"`). In fp32
  training both are 4 bytes. Parameters are gathered in bf16 either way (fp32 under
  `fp32_params`).
- `deepspeed_bf16_optimizer`: ZeRO-1 as DeepSpeed's 2022 `BF16_Optimizer` runs it (bf16 with
  ZeRO stage 0 under DeepSpeed's pipeline engine, which BLOOM trained with: "bf16 must use z0!
  it implements its own zero stage 1 equivalent"; DeepSpeed PR #1801, issue #1835). Every rank
  keeps the whole fp32 master copy and the whole fp32 gradients; only the Adam moments are
  sharded. Each micro-batch's bf16 gradients are added into the fp32 ones through an fp32
  copy (`hp_grad.add_(lp.grad.to(fp32))`: 18 bytes a parameter, ACCUMULATE_BF16_TO_FP32). After
  the last backward the engine all-reduces the whole fp32 gradient buffer
  (`_bf16_reduce_grads`: `get_grads_for_reduction` is the whole flat buffer; an all-reduce,
  not a reduce-scatter) and the tied table's fp32 gradient; each rank steps its shard and
  all-gathers the bf16 parameters; none of it overlaps compute. The gradients' wire dtype is
  `grad_reduce_dtype`'s. Off (meshloom, Megatron's distributed optimizer): ZeRO-1
  reduce-scatters and shards the master copy with the moments. A no-op unless zero = 1 in bf16.
- `dp_buckets`: how many calls DDP's and ZeRO-1/2's gradient reduction and parameter gather
  make, each paying a collective's fixed cost (hardware.Cluster.collective; ZeRO-3 makes one
  per unit and pass whatever this says): `torch` (meshloom's `parallel.ddp_bucket_mb` and
  PyTorch DDP's `bucket_cap_mb`, 25 MiB each), `mcore` (Megatron-Core's DDP and distributed
  optimizer: max(40M, 1M x dp) parameters a bucket, `DistributedDataParallelConfig.bucket_size`;
  one bucket without `dp_overlap`), `deepspeed` (DeepSpeed ZeRO's `reduce_bucket_size` and
  `allgather_bucket_size`, 5e8 elements) or `whole` (one call for the whole buffer: Megatron-LM
  2021's local DDP all-reduces its contiguous gradient buffer at once).
- `grad_clip`: the training loop clips the gradients by their global norm and keeps them
  allocated between steps (zeroed, then accumulated into), as Megatron's loop and most
  trainers' do; off for a bare benchmark loop that frees them.
- `free_unbucketed_grads`: with `grad_clip`, gradients that no data-parallel strategy holds in
  buckets are freed between steps (set to None) instead of zeroed, so the first micro-batch's
  backward writes them without an accumulation pass (meshloom's loop on a layout with no
  data-parallel replica and no ZeRO: `LocalGrads`; its DDP and ZeRO keep bucket buffers).
- `clip_in_optimizer`: the clip factor rides in the fused AdamW kernel, which writes the scaled
  gradients back (4 bytes per parameter) instead of a separate scale pass (read and write, 8):
  meshloom's loop with a fused optimizer (`optim.guarded_step`).
- `optimizer_impl`: how the AdamW step runs over fp32 state (plan/compute.py,
  `optimizer_seconds`): `fused` (one kernel reads and writes weight, gradient and both moments
  once, 28 bytes a parameter: meshloom's `optim.guarded_step`, Apex's and TransformerEngine's
  FusedAdam in Megatron and NeMo), `foreach` (PyTorch's multi-tensor AdamW, torchtitan's
  default: the same update as eight separate elementwise passes over all tensors, 80 bytes)
  or `for_loop` (those passes tensor by tensor: PyTorch's AdamW with `foreach=False`, as
  TinyLlama builds it, and Composer's `DecoupledAdamW` under llm-foundry).
- `selective_elementwise`: selective recompute reruns the elementwise kernels (norms,
  activations) along with the attention core, as meshloom's policy does (it saves only matmul
  outputs); off, only the attention core is rerun (Korthikanti et al.'s selective recompute,
  Megatron's).
- `fused_grad_accumulation`: the weight-gradient GEMMs add straight into the kept fp32
  gradients (Megatron's `--gradient-accumulation-fusion`, TransformerEngine), so no micro-batch
  pays a separate accumulation pass. Off (meshloom, PyTorch autograd): a backward that finds a
  gradient already there adds into it in place, a read-modify-write per micro-batch.
- `fused_swiglu`: a SwiGLU's activation is one autograd function that saves only its input
  (the first GEMM's gate and up outputs) and recomputes silu in its backward (Megatron-Core's
  `bias_swiglu_impl` under `bias_activation_fusion`, on in NeMo's recipes), so a block keeps
  3F values per token for its feed-forward (gate, up, and the product the second GEMM reads)
  where eager PyTorch keeps 4F (silu's output too); an MoE block's routed and shared experts
  likewise (Megatron-Core's grouped experts take the same path). Memory only; a no-op for GeLU
  models, under recompute, and for meshloom's own block (counted from its autograd graph).
- `optimizer_state`: what the optimizer keeps per parameter beside bf16 parameters and
  gradients (OPTIMIZER_STATES, bytes per parameter, sharded as ZeRO shards them): `fp32`
  (meshloom, Megatron's distributed optimizer, ZeRO: an fp32 master copy and fp32 Adam
  moments, 12), `fp32_remainders` (apex's `DistributedFusedAdam` with `store_param_remainders`,
  which NeMo's `distributed_fused_adam` sets for a bf16 model with fp32 state: the 16 low bits
  an fp32 master has beyond the bf16 parameter, and fp32 moments, 10) or `bf16` (bf16 moments
  and no master copy, the parameters updated in place: NeMo's `distributed_fused_adam` with
  `optim.dtype: bf16`, 4; KempnerForge's bf16 model). `bf16` also halves the optimizer
  step's traffic (bf16 weights, gradients and moments: 14 bytes a parameter fused,
  plan/compute.py `STATE_BYTES_SCALE`); the others change memory only. A no-op in fp32 and
  for meshloom's unsharded block, whose parameters are the fp32 masters.
- `op_sac`: selective recompute is torchtitan's per-op policy (`selective_ac_option = "op"`):
  of a block's matmuls, in the order they run, it keeps the outputs of the 1st, 3rd, 5th, ...
  and reruns the others (a Llama block keeps wq, wv, w1, w2 and reruns wk, wo, w3), keeps the
  attention kernel's outputs, and reruns every elementwise op. Off: meshloom's policy (every
  matmul output kept) or, with `selective_elementwise` off, Korthikanti's.
- `attention_kernel`: which fused attention kernel runs (kernel_table.ATTENTION_KERNELS):
  `sdpa` (meshloom: whichever PyTorch's SDPA picks on the GPU, `kernel_table.sdpa_kernel`:
  cuDNN's on an H100 or H200 with PyTorch >= 2.9 and cuDNN >= 9.9, FlashAttention-2 elsewhere),
  `fa2` (FlashAttention-2 class, PyTorch SDPA's flash backend, and what SDPA runs on Hopper
  before PyTorch 2.9), `cudnn` (cuDNN's fused flash attention: what meshloom ran on an H100
  under PyTorch 2.11, and Transformer Engine's on Hopper), `fa1` (FlashAttention 1, 2022
  trainers) or
  `triton` (the Triton FlashAttention of 2023 trainers, flash-attn's `flash_attn_triton`,
  llm-foundry's default `attn_impl: triton`). All but `fa2` are priced from the kernel table's
  rows of that kernel: FlashAttention-2's rate times the ratio between the two kernels in the
  benchmark that ran both (plan/kernel_table.py); `triton`, which no benchmark gives a rate
  for, as FlashAttention 1 (`kernel_table.PRICED_AS`).
- `pp_split`: how the blocks are cut into pipeline stages (plan/stages.py): `balanced`
  (meshloom: stages of equal training FLOPs, the head counted on the last) or `even` (the same
  number of blocks per stage, the remainder to the first: Megatron-LM, DeepSpeed).
- `p2p_blocking`: each pipeline send holds its rank until the transfer is over (Megatron-LM
  2021's `_communicate` waits on its batched sends and receives and synchronizes the device;
  DeepSpeed's pipeline engine sends with a synchronous `dist.send`). Off (meshloom): sends are
  issued and the rank computes on; only the receiver waits for the data.
- `pp_scatter_gather`: without sequence parallelism, each tensor-parallel rank sends 1/tp of a
  stage's output and the receiving ranks all-gather it over tp (Megatron-LM's
  `--scatter-gather-tensors-in-pipeline`, on by default there). Off (meshloom): every tp rank
  sends the whole activation (with SP each sends its sequence slice either way).
- `meshloom_block`: a Llama or GPT-2 block's activation memory is what meshloom's own block
  keeps in bf16, counted tensor by tensor from its autograd graph: unsharded, under autocast
  with fp32 parameters (fp32 residual stream and norm internals, one bf16 copy of a norm's
  output per projection that reads it, the bf16 weight copies the matmuls save); under ZeRO,
  with bf16 working parameters; meshloom's eager or compiled cross entropy (plan/memory.py).
  Also meshloom's ZeRO-1 in bf16 accumulating micro-batches into whole bf16 gradients (6 bytes
  per parameter and micro-batch, plan/compute.py), where other trainers keep fp32 ones (12),
  and meshloom's ZeRO-1/2 copying its gradients into the reduce-scatter's send buffers (ZeRO-2
  every micro-batch, ZeRO-1 once a step when the dtypes differ: plan/timing.py `_dp_time`),
  where other trainers' ZeRO-1/2 reduce their gradient buffers in place.
  Off: every saved tensor once in 16-bit (Korthikanti et al.'s accounting), what trainers that
  keep bf16 parameters and fused kernels (Megatron, FSDP with a bf16 param dtype) hold.
- `expand_kv`: under grouped-query attention the keys and values are copied out to every query
  head before the attention kernel (meshloom's block: `repeat_interleave`; torchtitan's
  `repeat_kv`), a read of K and V and a write of q-head-wide copies, forward, and their
  gradients summed back in backward. Off: the attention kernel reads the shared K/V heads
  itself (TransformerEngine's and flash-attn's native GQA: NeMo, Megatron-Core, TinyLlama).
  A no-op without GQA.
- `rope_complex`: RoPE multiplies q and k as complex numbers in fp32 (torchtitan's Llama,
  Meta's reference: `view_as_complex(xq.float()...) * freqs_cis`), 20 bytes per element of q
  and k each way, compiled or not, as Inductor leaves complex operators to their eager kernels
  (pytorch/torchtitan#15). Off (meshloom): a real rotation, fused under compile
  (plan/step_kernels.py).
- `expert_tp`: the routed experts are split over the tensor-parallel ranks as a dense MLP is
  (Megatron-Core's expert tensor parallel, `expert_tensor_parallel_size` equal to the tp size,
  its default): each tp rank holds 1/tp of each of its ep share of experts, gathers the tokens
  its tp group received by all-to-all (an all-gather over tp, with sequence parallel each rank
  routed only its slice) and reduce-scatters the experts' output, and the reverse in
  backward. Off (meshloom): each tp rank holds whole experts and runs its own tokens through
  them (plan/moe.py). A no-op for a dense model or tp = 1.
- `cross_entropy`: how the loss runs over the logits (plan/compute.py's CE_BYTES_PER_LOGIT):
  `auto` (meshloom: its compiled loss with `compile`, else eager; under tp > 1 its own
  vocabulary-parallel loss, `loss_kind`), `fused` (one pass each way:
  a compiled loss, flash-attn 2's Triton cross entropy), `xentropy` (apex's and flash-attn 1's
  CUDA kernel, which reads the logits twice forward), `eager` (`F.cross_entropy` on 16-bit
  logits), `megatron` (Megatron's unfused `vocab_parallel_cross_entropy`: an fp32 copy of the
  logits, then max, subtract, exp, sum and divide as separate passes, the softmax kept for
  backward; Megatron-LM's and Megatron-Core's default, which NeMo keeps unless its config sets
  `cross_entropy_loss_fusion`) or `megatron_fused` (Megatron-Core with
  `cross_entropy_loss_fusion`: the same steps in three jit-fused passes forward and one
  backward, still on an fp32 copy) or `eager_bf16` (`F.cross_entropy` on bf16 logits with no
  autocast around it, as a trainer with a bf16 model runs it: the log-softmax and both
  gradients stay bf16, no up-cast or down-cast; KempnerForge).
- `tp_ends`: how the token table and the output head run under tp > 1. `split` (meshloom,
  Megatron, torchtitan): the table is vocabulary-parallel, the head column-parallel and the
  loss runs on each rank's vocabulary slice (`loss_kind`). `gathered` (KempnerForge): where the
  layout runs sequence parallel, every tp rank holds the whole token table and looks up every
  token, keeping its sequence slice (no collective forward; backward all-gathers the slices'
  gradients), and the column-parallel head's logits are all-gathered whole onto every rank
  (DTensor's `ColwiseParallel(output_layouts=Replicate())`), which lays the pieces side by
  side along the vocabulary (a copy of the whole logits) and runs the loss over all of them;
  backward takes the rank's slice of the gradient (a copy). Without sequence parallel
  (KempnerForge's pipeline stages) neither end is split: every tp rank holds both whole, runs
  the whole head's GEMMs and the loss over all the logits, and neither end has a collective.
  A no-op with tp = 1.
- `tp_input_gathers`: under tp, how the column-parallel projections that read one norm's output
  get their input (plan/reruns.py `tp_pass_worths`). `shared` (meshloom, Megatron, torchtitan's
  `PrepareModuleInput` on the attention and the feed-forward): one all-gather (with SP) feeds
  them all, and their input gradients are summed before one reduce-scatter. `per_linear`
  (KempnerForge: DTensor's `ColwiseParallel(input_layouts=Shard(1))` on q, k, v, gate and up
  each): every projection gathers its own copy forward and reduce-scatters its own input
  gradient backward (without SP, all-reduces it), five of each in a Llama block where
  `shared` makes two; torch.compile keeps them all (tests/test_plan_tp_gathers.py counts
  them in PyTorch's own graph). A no-op with tp = 1.
- `train_metrics`: what the loop computes over the logits after each micro-batch's backward,
  beside the loss: `none` (meshloom, Megatron, NeMo, torchtitan: the loss only) or `composer`
  (Composer's trainer evaluates the model's training metrics on every micro-batch,
  `_eval_train_metrics` under the precision's autocast and no_grad; llm-foundry's MPT declares
  `LanguageCrossEntropy` and `LanguagePerplexity`, each of whose `update` runs
  `torch.nn.CrossEntropyLoss(reduction='sum')` over the logits: two eager cross-entropy
  forwards, CE_BYTES_PER_LOGIT's `eager` forward each).
- `cp_ring`: which ring runs context parallel's attention (plan/cp_ring.py); both make one
  kernel call per step, over the local sequence or half of it: `meshloom`
  (parallel/context.py: PyTorch's FlashAttention op, each step merged into an fp32 running
  output, the K/V gradients' fp32 accumulator one step behind its block) or `te`
  (TransformerEngine's `AttnFuncWithCPAndKVP2P`, Megatron-Core and NeMo: the attention
  kernel the plan names, 16-bit outputs and gradients, TE's fused corrections). A no-op with
  cp = 1.
- `qkv_transpose`: q, k and v are copied from sequence-first to batch-first before the
  attention kernel and its output back after it, and the gradients likewise (TransformerEngine's
  FlashAttention backend under Megatron's sequence-first tensors: `transpose(0, 1).contiguous()`
  each, or one `_PrepareQKVForFA` kernel for interleaved q, k, v of width 128). Off (meshloom,
  and TE's cuDNN backend, which reads sequence-first tensors as they are): no copies.
- `fused_qkv`: a Llama-style block projects q, k and v with one GEMM of (heads + 2 kv_heads)
  x head_dim / tp output columns (Megatron-Core's and NeMo's `linear_qkv`, lit-gpt's `attn`,
  TinyLlama), not three (meshloom's and torchtitan's wq, wk and wv): the same FLOPs, fewer
  launches, and the narrow K and V projections of GQA priced inside the wide one. A no-op for
  GPT-style blocks, whose projection is one GEMM already.
- `residual_stream`: the dtype of the residual stream between blocks and what the norms write
  (`16bit|fp32|fp32_cast`). `16bit` (meshloom, and trainers that keep bf16 parameters): the
  stream in the compute dtype. `fp32`: the stream kept in fp32 and each norm writing the
  compute dtype, flash-attn's GPT with `residual_in_fp32: True` and `fused_dropout_add_ln`
  (its kernel reads the 16-bit branch and the fp32 residual, writes the fp32 sum and the
  normalised output in the branch's dtype: `otype = itype` in csrc/layer_norm/ln_api.cpp).
  `fp32_cast`: a trainer that keeps fp32 parameters under autocast with norms that keep their
  input's dtype: the token table's output is fp32 (autocast leaves embeddings alone), each
  `x = x + branch` promotes to fp32, the norms read and write fp32, and autocast casts a
  norm's output to bf16 once for every projection that reads it (TinyLlama: lit_gpt/model.py's
  `Block`, FusedRMSNorm, one `attn` linear and xformers' SwiGLU). Priced in the fused
  elementwise count (plan/step_kernels.py: (8 + e)h bytes a token per add, (4 + e)h or 8h per
  norm, (4 + e)h and a kernel per cast) and in memory (the norms' fp32 inputs, one cast per
  projection under `fp32_cast`, the block input full recompute keeps, the final norm's
  input). meshloom's own unsharded layouts carry an fp32 stream under autocast too, but their
  compiled block's count as `16bit` is within 6% of a profiled step's Triton kernels (34.8 ms
  against 32.9, docs/kernel-tables.md), so the key stays `16bit` for them. A no-op in fp32
  training.
- `nccl_protocols`: which algorithms and protocols NCCL may run a collective with
  (plan/nccl.py): `auto` (NCCL's default: for each call the cheapest of the ring and, for an
  all-reduce, the tree, each with the LL, LL128 or Simple protocol, as NCCL's tuner prices
  them) or `simple` (the ring with the Simple protocol only: `NCCL_ALGO=Ring
  NCCL_PROTO=Simple`, the pair NCCL picks for large messages).
- `sp_copies`: whether each sequence-parallel all-gather and reduce-scatter of a block also
  copies the whole gathered tensor on the compute stream, a read and a write
  (`compute.sp_copies`). NCCL gathers and scatters along a buffer's leading dimension; a
  sequence split along dimension 1 of batch-first [b, s, h] tensors is rearranged around each
  call unless the micro-batch is one sequence. `batch` (meshloom: `comm._gather_dim` cats the
  gathered pieces along the sequence and `_reduce_scatter_dim` stacks the chunks, but gathers
  straight into, and scatters straight from, a micro-batch of one sequence, whose pieces
  already lie rank after rank; PyTorch's functional collectives under DTensor's Shard(1)
  sequence parallel, torchtitan: chunk-and-cat around each call, a view at one sequence in
  recent PyTorch; none under async TP in chunks, whose fused all-gather-matmul and
  matmul-reduce-scatter take the layout as it is), `always` (an implementation that
  rearranges even at one sequence, as meshloom did before 2026-11-29) or `none` (Megatron's
  sequence-first [s, b, h] tensors, gathered along the leading dimension). The embedding's
  and the head's own pairs copy likewise (`compute.end_sp_copies`).
- `float8`: the blocks' linear layers compute in fp8 (`none|tensorwise`). `tensorwise` is
  torchao's `Float8Linear` with dynamic tensor-wise scaling, torchtitan's float8 converter and
  its default recipe: each of a linear's three GEMMs runs with e4m3 operands at the kernel
  table's fp8 speed for its shape (`kernel_table.fp8_speedup`, the `gemm_fp8` rows); the
  attention core, the norms, the output head (torchtitan's `filter_fqns = ["output"]`) and the
  optimizer stay as they were. Each forward casts the linear's input and weight, each backward
  its output gradient, at the traffic torchao's own float8 roofline model counts
  (torchao/float8/roofline_utils.py, `get_tensor_memory_traffic_bytes`): an abs-max pass that
  reads the bf16 tensor (2 bytes an element; fused into the kernel that produced the input or
  the gradient under `compile`, never for the weight) and a cast that reads it again (2) and
  writes it in fp8 twice, row- and column-major (2), so 4 or 6 bytes an element; full
  recompute casts again. Under tp > 1, torchao's float8 tensor-parallel styles
  (`compute.float8_cast_bytes`): each module's input cast once on the rank's sequence slice
  and the sequence-parallel gathers in fp8, the reductions in 16 bits. Refused for a mixture
  of experts, outside bf16 training, and on a GPU whose kernel table has no fp8 rows (the
  A100s). Memory is counted as in bf16.
- `float8_all_gather`: with `float8` under ZeRO-3, the blocks' linear weights are cast to fp8 on
  their shards and gathered in fp8, one byte a parameter (torchao's
  `enable_fsdp_float8_all_gather`, torchtitan's flag of that name): the gathers and FSDP2's
  copy-out move half the linears' bytes, the weight's cast runs on the 1/dp shard, and each
  backward transposes the gathered fp8 weight for its input-gradient GEMM (a read and a write
  of a byte an element). A no-op otherwise.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields

from meshloom.config import ParallelConfig
from meshloom.plan import PlanError


@dataclass(frozen=True)
class Implementation:
    compile: bool = False
    tp_overlap: bool = False
    tp_overlap_chunks: bool = False
    tp_overlap_backward: bool = True
    dp_overlap: bool = False
    ddp_overlap: bool = True
    fsdp_prefetch: bool = True
    fsdp_no_sync: bool = False
    fsdp_flat_param: bool = False
    fp32_params: bool = False
    zero_redundancy_optimizer: bool = False
    fsdp_copy_out: bool = False
    fsdp_root: str = "head"
    fsdp_carry: bool = True
    reshard_after_forward: bool = True
    pp_fsdp: str = "meshloom"
    pp_w_order: str = "filled"
    grad_reduce_dtype: str = "fp32"
    deepspeed_bf16_optimizer: bool = False
    dp_buckets: str = "torch"
    grad_clip: bool = True
    free_unbucketed_grads: bool = True
    clip_in_optimizer: bool = True
    selective_elementwise: bool = True
    meshloom_block: bool = True
    op_sac: bool = False
    fused_grad_accumulation: bool = False
    fused_swiglu: bool = False
    optimizer_state: str = "fp32"
    optimizer_impl: str = "fused"
    attention_kernel: str = "sdpa"
    pp_split: str = "balanced"
    p2p_blocking: bool = False
    pp_scatter_gather: bool = False
    expand_kv: bool = True
    rope_complex: bool = False
    expert_tp: bool = False
    cross_entropy: str = "auto"
    train_metrics: str = "none"
    cp_ring: str = "meshloom"
    qkv_transpose: bool = False
    fused_qkv: bool = False
    residual_stream: str = "16bit"
    nccl_protocols: str = "auto"
    sp_copies: str = "batch"
    float8: str = "none"
    float8_all_gather: bool = False
    tp_ends: str = "split"
    tp_input_gathers: str = "shared"

    @property
    def elementwise(self) -> str:
        return "fused" if self.compile else "eager"

    @property
    def loss(self) -> str:
        """The cross entropy's kind (a key of compute.CE_BYTES_PER_LOGIT)."""
        return self.elementwise if self.cross_entropy == "auto" else self.cross_entropy

    def to_dict(self) -> dict:
        return dict(_as_dict(self))  # a copy: the caller may change it

    def short(self) -> str:
        on = [f.name for f in fields(self) if getattr(self, f.name) != getattr(MESHLOOM, f.name)]
        return ",".join(f"{k}={str(getattr(self, k)).lower()}" for k in on) or "meshloom default"


@functools.lru_cache(maxsize=256)
def _as_dict(impl: Implementation) -> dict:
    """Every plan a search evaluates records its implementation, one of a few (frozen)."""
    return asdict(impl)


MESHLOOM = Implementation()


def keeps_grads(impl: Implementation, lay) -> bool:
    """Whether the loop keeps the gradients allocated between steps (zeroed, then every
    micro-batch's backward adds into them) under layout `lay`."""
    bucketed = lay.zero > 0 or lay.dp * lay.cp > 1
    return impl.grad_clip and (bucketed or not impl.free_unbucketed_grads)


def pytorch_pipelined(impl: Implementation, lay) -> bool:
    """Whether ZeRO-3 runs under a pipeline as PyTorch's pipelining drives FSDP2 (`pp_fsdp`):
    held gathered for the step, whole gradients reduce-scattered once after the stage's last
    backward."""
    return impl.pp_fsdp == "pytorch" and lay.zero == 3 and lay.pp > 1


def zero3_resharded(impl: Implementation, lay) -> bool:
    """Whether ZeRO-3 frees each unit after its forward (`reshard_after_forward`); True for
    every other stage."""
    return lay.zero != 3 or impl.reshard_after_forward and not pytorch_pipelined(impl, lay)


def zero3_held_step(impl: Implementation, lay) -> bool:
    """Whether ZeRO-3 without resharding keeps every unit gathered across the step's
    micro-batches, gathering each once a step (meshloom, `fsdp_carry`; PyTorch's pipelining),
    where others gather each micro-batch's forward again."""
    return not zero3_resharded(impl, lay) and (impl.fsdp_carry
                                               or pytorch_pipelined(impl, lay))


def zero3_no_sync(impl: Implementation, lay, m: int) -> bool:
    """Whether ZeRO-3 (or FSDP1's ZeRO-2, `fsdp_flat_param`) keeps whole gradients over the
    step's `m` micro-batches and reduce-scatters once (`fsdp_no_sync`; PyTorch's pipelining
    always, even for one micro-batch)."""
    fsdp = lay.zero == 3 or lay.zero == 2 and impl.fsdp_flat_param
    return fsdp and (impl.fsdp_no_sync and m > 1 or pytorch_pipelined(impl, lay))


def ends_split(impl: Implementation, lay) -> str:
    """How the token table and the head run over the tp ranks (`tp_ends`): `split`
    (vocabulary-parallel, the loss on the rank's slice), `gathered` (the table whole, the
    head column-parallel with its logits gathered whole to every rank) or `whole` (neither
    split). `split` at tp = 1."""
    if lay.tp == 1 or impl.tp_ends == "split":
        return "split"
    return "gathered" if lay.sp else "whole"


def head_tp(impl: Implementation | None, lay) -> int:
    """Over how many ranks the head's weight and GEMMs are split: tp, or 1 for a whole head."""
    return 1 if impl is not None and ends_split(impl, lay) == "whole" else lay.tp


def table_tp(impl: Implementation | None, lay) -> int:
    """Over how many ranks the token table is split: tp where the ends are `split`, else 1."""
    return lay.tp if impl is None or ends_split(impl, lay) == "split" else 1


def loss_vocab_share(impl: Implementation, lay) -> int:
    """The divisor of the vocabulary the loss runs over on each rank: tp for a loss on the
    rank's slice, 1 where every rank runs it over all the logits (`tp_ends`)."""
    return lay.tp if ends_split(impl, lay) == "split" else 1


def loss_kind(impl: Implementation, lay) -> str:
    """The cross entropy the step runs (a key of compute.CE_BYTES_PER_LOGIT): meshloom under
    tp > 1 runs its own vocabulary-parallel loss whatever `compile` says (`vocab_parallel`,
    parallel/tensor.py's `vocab_parallel_cross_entropy`); an eager `F.cross_entropy` over
    vocabulary-split logits is PyTorch's `loss_parallel` (torchtitan's TP), whose DTensor
    handlers run the log-softmax and the NLL's backward as separate passes
    (`loss_parallel`); otherwise, and wherever every rank holds all the logits (`tp_ends`),
    `impl.loss`."""
    if loss_vocab_share(impl, lay) == 1:
        return impl.loss
    if impl.cross_entropy == "auto" and impl.meshloom_block and lay.tp > 1:
        return "vocab_parallel"
    if impl.loss in ("eager", "eager_bf16") and lay.tp > 1:
        return "loss_parallel"
    return impl.loss


def reduce_bytes(impl: Implementation, dtype: str) -> int:
    """Bytes of one gradient element on the data-parallel wire (`grad_reduce_dtype`; both
    dtypes are 4 bytes in fp32 training)."""
    return 4 if impl.grad_reduce_dtype == "fp32" or dtype == "fp32" else 2


def whole_grad_bytes(impl: Implementation, lay, dtype: str) -> int | None:
    """Bytes of each whole gradient ZeRO-3 accumulates over a step (`zero3_no_sync`): under
    PyTorch's pipelining FSDP2 keeps them in the reduce dtype (`pp_fsdp`); None for the
    backward's own gradient dtype (FSDP1's flat gradient under `no_sync()`); 4 for meshloom's
    fp32 sums (`parallel.reduce_once`, parallel/fsdp.py)."""
    if pytorch_pipelined(impl, lay):
        return reduce_bytes(impl, dtype)
    return None if impl.fsdp_flat_param else 4


def fp32_gradient_shards(impl: Implementation, lay) -> bool:
    """Whether the sharded gradients are fp32 in bf16 training where meshloom's are bf16:
    FSDP1's ZeRO-2 (SHARD_GRAD_OP, `fsdp_flat_param`) keeps each reduce-scattered gradient
    shard in its flat parameter's dtype, the fp32 of the sharded masters (FSDP1 upcasts the
    shard unless `keep_low_precision_grads`). Under FULL_SHARD the same holds, but there the
    flat parameter is the fp32 master itself and no bf16 shard is kept, so the planner's
    2 + 2 + 4 + 8 bytes a parameter over dp already total FSDP1's 4 + 4 + 8."""
    return impl.fsdp_flat_param and lay.zero == 2


def fp32_working_params(impl: Implementation, lay, dtype: str) -> bool:
    """Whether the parameters are fp32 and autocast computes (`fp32_params`) in bf16 training:
    fp32 parameter traffic, gradients and model states, a weight cast each way every
    micro-batch. (meshloom's own unsharded layouts are so too, `compute.casts_weights`.)"""
    return impl.fp32_params and dtype == "bf16"


def autocast_weights(impl: Implementation, lay, dtype: str) -> bool:
    """Whether the parameters are fp32 and autocast casts each weight for its matmul in bf16
    training: meshloom's unsharded layouts (its masters are the parameters) and any layout
    under `fp32_params`."""
    return (dtype == "bf16" and impl.meshloom_block and lay.zero == 0
            or fp32_working_params(impl, lay, dtype))


def optimizer_state(impl: Implementation, lay, dtype: str) -> str:
    """The optimizer state the step updates (`optimizer_state`), as memory counts it: fp32
    where the parameters are themselves the fp32 masters (`autocast_weights`) or in fp32
    training."""
    return "fp32" if dtype != "bf16" or autocast_weights(impl, lay, dtype) \
        else impl.optimizer_state


def residual_stream(impl: Implementation, e: int) -> str:
    """The residual stream (`residual_stream`) in training at activation element bytes `e`:
    always the compute dtype's in fp32 training."""
    return impl.residual_stream if e < 4 else "16bit"


def whole_fp32_states(impl: Implementation, lay, dtype: str) -> bool:
    """Whether ZeRO-1 runs as DeepSpeed's BF16_Optimizer (`deepspeed_bf16_optimizer`): whole
    fp32 gradients and master copy on every rank, the gradients all-reduced."""
    return impl.deepspeed_bf16_optimizer and lay.zero == 1 and dtype == "bf16"


def float8_gathers(impl: Implementation, lay) -> bool:
    """Whether ZeRO-3 gathers the blocks' linear weights in fp8 (`float8_all_gather`)."""
    return (impl.float8 != "none" and impl.float8_all_gather and lay.zero == 3
            and lay.dp_shard > 1)


IMPL_KEYS = tuple(f.name for f in fields(Implementation))
TRUE, FALSE = ("true", "1", "on", "yes"), ("false", "0", "off", "no")


def parse_bool(key: str, value: str) -> bool:
    v = value.strip().lower()
    if v not in TRUE + FALSE:
        raise PlanError(f"--fix: {key}={value} must be true or false")
    return v in TRUE


STR_IMPL_KEYS = ("attention_kernel", "pp_split", "optimizer_state", "optimizer_impl",
                 "grad_reduce_dtype", "dp_buckets", "cross_entropy", "train_metrics", "cp_ring",
                 "nccl_protocols", "sp_copies", "residual_stream", "fsdp_root", "pp_fsdp",
                 "pp_w_order", "float8", "tp_ends",
                 "tp_input_gathers")
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
OPTIMIZER_IMPLS = ("fused", "foreach", "for_loop")
# Bytes per parameter beside the bf16 parameter and gradient: (master copy, Adam moments).
OPTIMIZER_STATES = {"fp32": (4, 8), "fp32_remainders": (2, 8), "bf16": (0, 4)}
DP_BUCKETS = ("torch", "mcore", "deepspeed", "whole")
NCCL_PROTOCOLS = ("auto", "simple")
SP_COPIES = ("always", "batch", "none")
RESIDUAL_STREAMS = ("16bit", "fp32", "fp32_cast")
FSDP_ROOTS = ("head", "outer")
PP_FSDP = ("meshloom", "pytorch")
FLOAT8_RECIPES = ("none", "tensorwise")
CROSS_ENTROPY = ("auto", "fused", "eager", "eager_bf16", "xentropy", "megatron",
                 "megatron_fused")
TP_ENDS = ("split", "gathered")
TP_INPUT_GATHERS = ("shared", "per_linear")
# Eager cross-entropy forwards over the logits a loop's training metrics run per micro-batch.
TRAIN_METRIC_PASSES = {"none": 0, "composer": 2}
# meshloom's parallel.ddp_bucket_mb default, which is PyTorch DDP's bucket_cap_mb (25 MiB)
TORCH_BUCKET_BYTES = int(ParallelConfig.ddp_bucket_mb * 2**20)
DEEPSPEED_BUCKET_ELEMENTS = 5e8  # DeepSpeed ZeRO's reduce/allgather_bucket_size defaults


def dp_calls(buckets: str, overlapped: bool, nbytes: float, params: float, dp: int) -> int:
    """Calls a data-parallel gradient reduction (or parameter gather) of `nbytes` holding
    `params` parameters over `dp` ranks makes, bucketed as `buckets` (`dp_buckets`) says;
    `overlapped`: whether the trainer overlaps it with compute (Megatron-Core buckets only
    then)."""
    if nbytes <= 0:
        return 0
    if buckets == "whole" or buckets == "mcore" and not overlapped:
        return 1
    if buckets == "mcore":
        return math.ceil(params / max(40e6, 1e6 * dp))
    if buckets == "deepspeed":
        return math.ceil(params / DEEPSPEED_BUCKET_ELEMENTS)
    return math.ceil(nbytes / TORCH_BUCKET_BYTES)


def split_fix(fixed: dict) -> tuple[dict, Implementation]:
    """(layout keys, implementation) from a parsed --fix."""
    impl = Implementation(**{k: fixed[k] for k in IMPL_KEYS if k in fixed})
    if impl.residual_stream != "16bit" and not impl.compile:
        # the eager count is meshloom's block as written, fp32 norm internals included
        raise PlanError(f"--fix: residual_stream={impl.residual_stream} is priced for fused "
                        "blocks only: add compile=true")
    return {k: v for k, v in fixed.items() if k not in IMPL_KEYS}, impl
