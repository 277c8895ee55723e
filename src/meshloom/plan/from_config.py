"""`meshloom plan --config FILE`: the layout a training config asks for, priced as it stands.

The inverse of `--write-config` (layout.config_toml): the model the run would build (its
preset with the config's overrides, the tokenizer's vocabulary where the config leaves it
unset), the sequence length, the global batch, the compute dtype, every layout key the config
sets and the run options the planner prices (`train.compile`, ZeRO-3's
`parallel.reshard_after_forward` and `parallel.reduce_once`, `parallel.reduce_dtype`). A
config setting what the planner does not price (its own stage sizes, CPU offload, the
parameter-server mode, devices per rank) is refused by name rather than planned as something
else.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshloom.config import Config, ConfigError, ParallelConfig
from meshloom.data import check_batch_config
from meshloom.parallel.pipeline_schedule import check_pp_config, pipeline_microbatches
from meshloom.plan import PlanError
from meshloom.plan.models import ModelShape, from_dims, from_llama_config

# Config keys the step could not be priced with, and why each one matters.
_UNPRICED = (
    ("pp_layers", lambda p: bool(p.pp_layers), "its own stage sizes (the planner balances "
     "stages itself, --fix pp_split)"),
    ("cpu_offload", lambda p: p.cpu_offload, "optimizer state on the CPU"),
    ("mode", lambda p: bool(p.mode), "the parameter-server mode"),
    ("rank_devices", lambda p: p.rank_devices not in (1, [], None), "several devices a rank"),
    ("dp_devices", lambda p: p.dp_devices not in (0, [], None), "data-parallel devices a rank"),
)
# The layout keys `--fix` would pin, which the config sets instead.
LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "ep", "dp_replicate", "zero", "recompute", "sp",
               "micro_batch", "schedule", "v")


@dataclass(frozen=True)
class ConfigPlan:
    shape: ModelShape
    seq: int
    global_batch: int
    dtype: str  # the planner's: "bf16" (bf16 or fp16 compute) or "fp32"
    gpus: int
    fixed: dict  # --fix keys: the whole layout and the priced run options


def plan_from_config(cfg: Config, gpus: int | None) -> ConfigPlan:
    """What `meshloom plan` needs to price `cfg` on `gpus` GPUs (None: as many as the config's
    parallel degrees make, which then must all be given)."""
    p = cfg.parallel
    for key, used, what in _UNPRICED:
        if used(p):
            raise PlanError(f"parallel.{key}: the planner does not price {what}; plan the "
                            "config without it")
    dims = _dims(p, gpus)
    mcfg = _model_config(cfg)
    problem = check_batch_config(cfg, dims)  # the run's own batch and pipeline rules
    if problem is None and dims.pp > 1:
        problem = check_pp_config(cfg, dims, mcfg)
    if problem:
        raise PlanError(problem)
    t, dp = cfg.train, dims.dp
    local = t.global_batch // dp
    fixed = {"tp": dims.tp, "pp": dims.pp, "dp": dp, "cp": dims.cp, "ep": dims.ep,
             "dp_replicate": dims.dp_replicate, "zero": p.zero_stage,
             "recompute": t.activation_checkpointing, "sp": p.sequence_parallel,
             "micro_batch": t.micro_batch or local, "compile": t.compile,
             "grad_reduce_dtype": p.reduce_dtype}
    if dims.pp > 1:  # the run's micro-batch count
        fixed |= {"micro_batch": local // pipeline_microbatches(cfg, dims),
                  "schedule": p.pp_schedule, "v": p.pp_virtual_stages}
    if p.zero_stage == 3:
        fixed |= {"reshard_after_forward": p.reshard_after_forward,
                  "fsdp_no_sync": p.reduce_once}
    dtype = "fp32" if t.dtype == "fp32" else "bf16"
    return ConfigPlan(_shape(mcfg, cfg.model.preset), cfg.data.seq_len, t.global_batch,
                      dtype, dims.world_size, fixed)


def _dims(p: ParallelConfig, gpus: int | None):
    from meshloom.mesh import ParallelDims
    axes = dict(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp,
                ep=p.ep)
    if p.dp_shard != -1:
        made = p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp
        if gpus is not None and gpus != made:
            raise PlanError(f"the config's parallel degrees make {made} GPUs (pp {p.pp} x "
                            f"dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard} x cp {p.cp} "
                            f"x tp {p.tp}), not --gpus {gpus}; or set parallel.dp_shard=-1")
        gpus = made
    elif gpus is None:
        raise PlanError("parallel.dp_shard=-1 takes whatever the GPUs leave: give --gpus")
    try:
        return ParallelDims.resolve(gpus, **axes)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _model_config(cfg: Config):
    """The model config (of its family) the run would build."""
    from meshloom.data import DataError, load_tokenizer
    from meshloom.validation import model_config

    vocab = None
    if cfg.model.vocab_size is None and not cfg.model.init_from:
        try:
            vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
        except DataError as e:
            raise PlanError(str(e)) from None
    try:
        return model_config(cfg, vocab)
    except ConfigError as e:
        raise PlanError(str(e)) from None


def _shape(mcfg, name: str) -> ModelShape:
    """That model as the planner sees it."""
    if getattr(mcfg, "family", None) == "gpt2":
        return from_dims("gpt", mcfg.dim, mcfg.n_layers, mcfg.n_heads, mcfg.vocab_size,
                         ffn_hidden=mcfg.hidden, name=name, tied=mcfg.tie_embeddings,
                         positions=mcfg.max_seq_len, dropout=mcfg.dropout > 0)
    return from_llama_config(mcfg, name)
