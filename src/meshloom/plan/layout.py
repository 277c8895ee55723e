"""A layout: how the GPUs are split and how each step runs. Parsing of `--fix` and the TOML
config that `--write-config` writes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from meshloom.parallel.pipeline_schedule import SCHEDULES, W_ORDERS
from meshloom.plan import PlanError
from meshloom.plan.cp_ring import CP_RINGS
from meshloom.plan.implementation import (
    CROSS_ENTROPY,
    DP_BUCKETS,
    FLOAT8_RECIPES,
    FSDP_ROOTS,
    GRAD_REDUCE_DTYPES,
    IMPL_KEYS,
    NCCL_PROTOCOLS,
    OPTIMIZER_IMPLS,
    OPTIMIZER_STATES,
    PP_FSDP,
    RESIDUAL_STREAMS,
    SP_COPIES,
    STR_IMPL_KEYS,
    TP_ENDS,
    TP_INPUT_GATHERS,
    TRAIN_METRIC_PASSES,
    parse_bool,
)
from meshloom.plan.kernel_table import ATTENTION_KERNELS
from meshloom.plan.stages import PP_SPLITS

RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1  # data-parallel ranks in all (dp_replicate x dp_shard)
    cp: int = 1
    dp_replicate: int = 1  # HSDP: replicas of the sharded group; zero shards over dp / this
    micro_batch: int = 1  # sequences per forward pass per data-parallel rank
    zero: int = 0  # 0 = DDP; 1, 2, 3 = ZeRO stage over the dp_shard axis
    recompute: str = "none"
    schedule: str = "1f1b"  # pipeline schedule; ignored when pp = 1
    v: int = 1  # virtual stages per rank (interleaved_1f1b)
    sp: bool = False  # sequence parallel (with tp > 1)
    ep: int = 1  # expert parallel: each MoE block's experts over ep of the dp_shard x cp ranks

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def short(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}", f"cp{self.cp}",
                 f"mb{self.micro_batch}", f"zero{self.zero}", self.recompute]
        if self.ep > 1:  # taken from dp_shard x cp, so shown after them
            parts.insert(4, f"ep{self.ep}")
        if self.dp_replicate > 1:
            parts.insert(3, f"rep{self.dp_replicate}")
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.v}" if self.v > 1 else ""))
        if self.sp:
            parts.append("sp")
        return " ".join(parts)

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.ep == 1:  # as before expert parallel existed (an MoE candidate's "moe" has it)
            del out["ep"]
        return out


INT_KEYS = ("tp", "pp", "dp", "cp", "dp_replicate", "micro_batch", "zero", "v", "ep")
BOOL_KEYS = ("sp",) + tuple(k for k in IMPL_KEYS if k not in STR_IMPL_KEYS)
FIX_KEYS = INT_KEYS + ("recompute", "schedule") + STR_IMPL_KEYS + BOOL_KEYS


def parse_fix(text: str) -> dict:
    """`tp=8,pp=16,schedule=interleaved_1f1b` -> {"tp": 8, "pp": 16, ...}, checked."""
    out: dict = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            raise PlanError(f"--fix: '{item}' is not key=value")
        if key not in FIX_KEYS:
            import difflib
            near = difflib.get_close_matches(key, FIX_KEYS, n=1, cutoff=0.5)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise PlanError(f"--fix: unknown key '{key}'{hint}; one of {', '.join(FIX_KEYS)}")
        if key in out:  # the last one would win silently, and the plan not be the one asked
            raise PlanError(f"--fix: {key} is pinned twice")
        if key in INT_KEYS:
            if not value.isdigit() or int(value) < (0 if key == "zero" else 1):
                raise PlanError(f"--fix: {key}={value} must be a positive integer")
            out[key] = int(value)
        elif key in BOOL_KEYS:
            out[key] = parse_bool(key, value)
        else:
            options = {"recompute": RECOMPUTE, "attention_kernel": ATTENTION_KERNELS,
                       "pp_split": PP_SPLITS,
                       "optimizer_state": tuple(OPTIMIZER_STATES),
                       "optimizer_impl": OPTIMIZER_IMPLS,
                       "grad_reduce_dtype": GRAD_REDUCE_DTYPES,
                       "dp_buckets": DP_BUCKETS,
                       "cross_entropy": CROSS_ENTROPY,
                       "train_metrics": tuple(TRAIN_METRIC_PASSES),
                       "cp_ring": CP_RINGS,
                       "nccl_protocols": NCCL_PROTOCOLS,
                       "sp_copies": SP_COPIES,
                       "residual_stream": RESIDUAL_STREAMS,
                       "fsdp_root": FSDP_ROOTS,
                       "pp_fsdp": PP_FSDP,
                       "pp_w_order": W_ORDERS,
                       "float8": FLOAT8_RECIPES,
                       "tp_ends": TP_ENDS,
                       "tp_input_gathers": TP_INPUT_GATHERS}.get(key, SCHEDULES)
            if value not in options:
                raise PlanError(f"--fix: {key}={value} must be one of {', '.join(options)}")
            out[key] = value
    if out.get("zero", 0) > 3:
        raise PlanError(f"--fix: zero={out['zero']} must be 0, 1, 2 or 3")
    return out


def layout_fields() -> list[str]:
    return [f.name for f in fields(Layout)]


def config_toml(layout: Layout, shape, seq: int, global_batch: int, dtype: str,
                compile_blocks: bool = False, reshard_after_forward: bool = True,
                reduce_dtype: str = "fp32", reduce_once: bool = False) -> str:
    """A meshloom training config for this layout, with the run options the plan was priced
    with (`compile`, ZeRO-3's `reshard_after_forward` and `reduce_once` (`fsdp_no_sync`), the
    gradients' `reduce_dtype`) where they are not the defaults. A
    preset of meshloom's own is named, with its vocabulary, which the tokenizer would otherwise
    set; any other shape is written out: a Llama shape as such, a GPT shape on the gpt2
    preset. `meshloom plan --config` reads it back to the same plan."""
    if shape.arch == "gpt":
        model = _gpt_model(shape, seq)
    else:
        from meshloom.models.families import presets as family_presets
        from meshloom.models.llama import PRESETS as LLAMA_PRESETS
        if shape.name in LLAMA_PRESETS or shape.is_moe and shape.name in family_presets():
            # The vocabulary too: unset, the run takes the tokenizer's (257 bytes for the
            # default tokenizer), a smaller model than the one planned.
            model = [f'preset = "{shape.name}"', f"vocab_size = {shape.vocab}",
                     f"max_seq_len = {seq}"]
        else:
            model = [f"dim = {shape.hidden}", f"n_layers = {shape.layers}",
                     f"n_heads = {shape.heads}", f"n_kv_heads = {shape.kv_heads}",
                     f"ffn_hidden = {shape.ffn_hidden}", f"vocab_size = {shape.vocab}",
                     f"max_seq_len = {seq}", f"tie_embeddings = {str(shape.tied).lower()}"]
            if shape.is_moe:
                model += [f"n_experts = {shape.n_experts}", f"top_k = {shape.top_k}",
                          f"moe_hidden = {shape.moe_hidden}",
                          f"shared_hidden = {shape.shared_hidden}",
                          f"shared_gate = {str(shape.shared_gate).lower()}"]
    lines = [
        f"# Written by `meshloom plan`: the fastest predicted layout ({layout.short()}).",
        f'name = "plan-{shape.name}"', "", "[model]", *model, "",
        "[data]", f"seq_len = {seq}", "",
        "[train]", f"global_batch = {global_batch}", f"micro_batch = {layout.micro_batch}",
        f"eval_sequences = {global_batch}", f'dtype = "{dtype}"',
        f'activation_checkpointing = "{layout.recompute}"',
        *(["compile = true"] if compile_blocks else []), "",
        "[parallel]", f"dp_replicate = {layout.dp_replicate}", f"dp_shard = {layout.dp_shard}",
        f"zero_stage = {layout.zero}",
        *(["reshard_after_forward = false"] if layout.zero == 3 and not reshard_after_forward
          else []),
        *(["reduce_once = true"] if layout.zero == 3 and reduce_once else []),
        f"tp = {layout.tp}",
        f"sequence_parallel = {'true' if layout.sp else 'false'}",
        f"pp = {layout.pp}", f"cp = {layout.cp}",
    ] + ([f"ep = {layout.ep}"] if layout.ep > 1 else []) + (
        [f'reduce_dtype = "{reduce_dtype}"'] if reduce_dtype != "fp32" else [])
    if layout.pp > 1:
        lines += [f'pp_schedule = "{layout.schedule}"', f"pp_virtual_stages = {layout.v}"]
    return "\n".join(lines) + "\n"


def _gpt_model(shape, seq: int) -> list[str]:
    """The [model] lines of a GPT shape: meshloom's GPT-2 family (models/gpt2.py)."""
    from meshloom.models.gpt2 import PRESETS as GPT2_PRESETS
    if not shape.is_gpt2_block:
        raise PlanError(f"model {shape.name!r}: meshloom builds gpt blocks only as GPT-2 "
                        "(every head its own k and v, biased linears, learned positions), so "
                        "there is no meshloom config to write; plan it without --write-config")
    positions = max(shape.positions, seq)  # the learned table must cover the sequence
    preset = GPT2_PRESETS.get(shape.name)
    if preset is not None and preset["vocab_size"] == shape.vocab and shape.tied \
            and shape.ffn_hidden == 4 * shape.hidden:
        model = [f'preset = "{shape.name}"', f"vocab_size = {shape.vocab}"]
        return model + ([f"max_seq_len = {positions}"] if positions != preset["max_seq_len"]
                        else [])
    return ['preset = "gpt2"', f"dim = {shape.hidden}", f"n_layers = {shape.layers}",
            f"n_heads = {shape.heads}", f"ffn_hidden = {shape.ffn_hidden}",
            f"vocab_size = {shape.vocab}", f"max_seq_len = {positions}",
            f"tie_embeddings = {str(shape.tied).lower()}"]
