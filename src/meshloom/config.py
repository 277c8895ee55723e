"""Run configuration: dataclasses, TOML loading, `--set` overrides and the range of each key.

A leaf: it imports nothing from meshloom, so every strategy can read these dataclasses. The rules
that tie keys to the layout, the model and the data live beside the code they protect and are run,
in order, by `meshloom.validation.validate()`. A bad config is one line naming the key
(`ConfigError`), never a traceback from inside a rank.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

BACKENDS = ("auto", "nccl", "gloo", "mpi")
DTYPES = ("fp32", "bf16", "fp16")
AC_MODES = ("none", "full", "selective")
NONFINITE_POLICIES = ("stop", "skip")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
PARALLEL_MODES = ("", "auto", "dp")


class ConfigError(ValueError):
    """A bad config value; the message is one line that names the key."""


class ModelDims(Protocol):
    """What the layout rules read of the model (models.llama.LlamaConfig is one; the planner
    builds one from its ModelShape)."""

    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def hidden(self) -> int: ...  # the MLP width
    @property
    def tie_embeddings(self) -> bool: ...


@dataclass
class ModelConfig:
    # A preset of any family (models/families.py; docs/model.md lists them); any field below
    # that is set overrides it.
    preset: str = "tiny"
    # The preset's family ("llama", ...): optional, checked against the preset when set.
    family: str | None = None
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab_size: int | None = None  # None: the tokenizer's vocabulary size
    ffn_hidden: int | None = None
    max_seq_len: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    init_std: float | None = None
    # Family-specific settings (a family that has no such setting refuses it by name):
    head_dim: int | None = None  # Qwen3: wider than dim / n_heads
    attention_bias: bool | None = None  # Qwen2: bias on q, k, v
    qk_norm: bool | None = None  # Qwen3: RMSNorm of q and k per head
    sliding_window: int | None = None  # Mistral: attend to the last N tokens only
    dropout: float | None = None  # GPT-2: embedding, attention and residual dropout
    # Mixture of experts (Llama-derived families; docs/moe.md): n_experts > 0 routes each token
    # to top_k of n_experts SwiGLU experts of width moe_hidden in every block.
    n_experts: int | None = None
    top_k: int | None = None
    moe_hidden: int | None = None
    shared_hidden: int | None = None  # a shared expert's width (0: none)
    shared_gate: bool | None = None  # shared expert gated by sigmoid(linear(x)) (Qwen2-MoE)
    router_score: str | None = None  # "softmax" or "sigmoid"
    router_norm: bool | None = None  # renormalise the top-k weights to sum to 1
    aux_loss_coef: float | None = None  # load-balancing loss coefficient
    capacity_factor: float | None = None  # unset: dropless; else a per-sequence capacity
    # "hf:PATH" (a Hugging Face Llama folder) or "meshloom:PATH" (weights, checkpoint or run
    # folder): start from those weights; the shape then comes from there. "" = random init.
    init_from: str = ""


@dataclass
class DataConfig:
    source: str | list[str] = "stdlib"  # "stdlib", files, folders, globs or .jsonl files
    tokenizer: str = "byte"  # "byte" or a local tokenizer.json
    seq_len: int = 64
    val_fraction: float = 0.05
    max_bytes: int = 0  # cap on corpus bytes read; 0 = no cap
    jsonl_field: str = "text"
    cache_dir: str = ""  # "" = ~/.cache/meshloom/tokens


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 0
    global_batch: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = 0  # sequences per forward pass per rank; 0 = the whole local batch
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global grad-norm clip; 0 = off
    eval_every: int = 50  # 0 = only at the end
    eval_sequences: int = 64
    log_every: int = 1
    sample_tokens: int = 0  # tokens generated at the end; 0 = no sample
    sample_prompt: str = "def "
    sample_temperature: float = 0.8
    sample_top_k: int = 40
    dtype: str = "fp32"  # compute: fp32 | bf16 | fp16 (loss-scaled); masters and Adam stay fp32
    activation_checkpointing: str = "none"  # none | full (per block) | selective (see docs)
    on_nonfinite: str = "stop"  # NaN/inf loss or grad norm: stop, or skip the step
    nonfinite_max_skips: int = 10  # with "skip": stop after this many such steps in a row
    compile: bool = False  # torch.compile each transformer block's forward
    # AdamW's kernels: auto = fused when every parameter is on a GPU, else foreach. Fused, the
    # clip factor and the non-finite guard ride in the optimizer kernel (docs/gpu.md).
    optimizer_impl: str = "auto"  # auto | fused | foreach
    compile_backend: str = "inductor"  # torch.compile backend ("eager"/"aot_eager" to debug)


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the other axes leave of the world size
    zero_stage: int = 0  # 0 = no sharding (dp_shard acts as plain data parallel)
    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0
    pp_virtual_stages: int = 1
    pp_layers: list[int] = field(default_factory=list)  # layers per stage; [] = balanced
    pp_timeout_s: float = 300.0  # a pipeline receive that waits longer fails, naming the stage
    cp: int = 1
    # Expert parallel (docs/moe.md): each MoE block's experts split over ep ranks, taken from
    # dp_shard x cp; tokens travel to their experts' ranks and back by all-to-all.
    ep: int = 1
    ddp_bucket_mb: float = 25.0
    # ZeRO-3: free gathered parameters after each forward (false: each unit held for the step)
    reshard_after_forward: bool = True
    # ZeRO-3: sum whole fp32 gradients over a step's micro-batches and reduce-scatter them once
    # (FSDP's no_sync), for 4 bytes a parameter of memory between the first backward and the last
    reduce_once: bool = False
    reduce_dtype: str = "fp32"  # dtype gradients are reduced in (DDP and the sharded stages)
    cpu_offload: bool = False  # ZeRO: fp32 master shard and AdamW state (stage 3: params) on CPU
    # "" / "auto": the mesh axes above; "dp": one process drives several devices with replicas
    # in threads (the nn.DataParallel baseline, docs/data-parallel.md) over parallel.dp_devices:
    # a count (cuda:0..N-1, or N CPU replicas; 0 = every GPU) or a list like ["cuda:0", "cuda:1"].
    mode: str = ""
    dp_devices: int | list[str] = 0
    # Several devices within each rank (naive model parallel, docs/rank-devices.md): the rank's
    # blocks are spread over them, the input part on the first, the output part and the loss on
    # the last. A count N: local rank r uses cuda:N*r .. cuda:N*r+N-1 (the CPU N times); a list
    # like ["cuda:0", "cuda:1"]: every local rank's devices (one rank per host); a list of lists:
    # local rank r uses the r-th. 1 = the usual single device per rank.
    rank_devices: int | list[str] | list[list[str]] = 1
    rank_device_blocks: list[int] = field(default_factory=list)  # blocks per device; [] = balanced


@dataclass
class RunConfig:
    dir: str = ""  # "" = runs/<config name>-<timestamp>
    backend: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    checkpoint_every: int = 0  # 0 = only at the last step
    keep_checkpoints: int = 2
    tensorboard: bool = False
    peak_tflops: float = 0.0  # device peak for MFU; 0 = from the built-in table
    threads: int = 0  # torch threads per rank; 0 = cores / local ranks
    timeout_s: float = 600.0  # a rank with no progress this long: stop, naming the stalled rank
    profile_start: int = 0  # profile from this step (1-based; 0 = off): RUN_DIR/profile/
    profile_steps: int = 2  # how many steps to profile


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    name: str = "run"  # the config file's stem; names the default run folder

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading and overrides


def _sections(cfg: Any = None) -> dict[str, type]:
    """The [section] tables of a config dataclass (meshloom's Config by default)."""
    kind = Config if cfg is None else type(cfg)
    return {f.name: f.default_factory for f in dataclasses.fields(kind) if f.name != "name"}


def closest(word: str, options: list[str]) -> str:
    """' (did you mean X?)' for the option nearest to a misspelt word, or ''."""
    match = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotated type `tp`; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected None, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, item) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _apply(cfg: Any, key: str, value: Any) -> None:
    parts = key.split(".")
    sections = _sections(cfg)
    if len(parts) != 2:
        raise ConfigError(f"{key}: keys have the form section.name; sections: "
                          f"{', '.join(sections)}")
    sec, name = parts
    if sec not in sections:
        raise ConfigError(f"{key}: unknown section '{sec}'{closest(sec, list(sections))}")
    obj = getattr(cfg, sec)
    hints = typing.get_type_hints(type(obj))
    if name not in hints:
        raise ConfigError(f"{key}: unknown key{closest(name, list(hints))}")
    setattr(obj, name, _coerce(key, value, hints[name]))


def _parse_value(text: str) -> Any:
    """A --set value is read as a TOML value when it is one, else as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a Config from a TOML file (None = the defaults) and `section.key=value` overrides."""
    return fill_config(Config(), path, overrides)


def fill_config(cfg: Any, path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()):
    """Fill a config dataclass of [section] dataclasses (and a `name`) from a TOML file and
    `section.key=value` overrides, checking every key and type; returns `cfg`."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        cfg.name = p.stem
        if isinstance(raw.get("name"), str):
            cfg.name = raw.pop("name")
        for sec, table in raw.items():
            if not isinstance(table, dict):
                hint = closest(sec, list(_sections(cfg)))
                raise ConfigError(f"{sec}: expected a [section] table{hint}")
            for name, value in table.items():
                _apply(cfg, f"{sec}.{name}", value)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected key=value, e.g. --set train.steps=100")
        key, text = item.split("=", 1)
        _apply(cfg, key.strip(), _parse_value(text.strip()))
    return cfg


def dump_toml(cfg: Any) -> str:
    """The resolved config (a Config, or another config dataclass of sections) as TOML. None
    values are left out: they mean 'from the preset'."""
    lines = [f"name = {_toml_value(cfg.name)}"]
    for sec in _sections(cfg):
        lines.append(f"\n[{sec}]")
        for k, v in dataclasses.asdict(getattr(cfg, sec)).items():
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    escaped = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


# ---------------------------------------------------------------- range checks


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_ranges(cfg: Config) -> None:
    """Each key on its own: a known name, a value in range (and the few checks between keys of
    one section). Raises ConfigError naming the key."""
    p, t, d, r = cfg.parallel, cfg.train, cfg.data, cfg.run
    _require(p.mode in PARALLEL_MODES, f"parallel.mode: unknown mode '{p.mode}'"
             f"{closest(p.mode, ['auto', 'dp'])}; one of auto (the mesh axes) or dp (one "
             "process, several devices)")
    _require(p.mode == "dp" or p.dp_devices == 0,
             f"parallel.dp_devices={p.dp_devices!r} is only used with parallel.mode=dp")
    _require(p.zero_stage in (0, 1, 2, 3),
             f"parallel.zero_stage={p.zero_stage} must be 0, 1, 2 or 3")
    _require(p.pp_microbatches >= 0, f"parallel.pp_microbatches={p.pp_microbatches} must be >= 0")
    _require(p.pp_virtual_stages >= 1,
             f"parallel.pp_virtual_stages={p.pp_virtual_stages} must be >= 1")
    _require(p.ddp_bucket_mb > 0, f"parallel.ddp_bucket_mb={p.ddp_bucket_mb} must be > 0")

    _require(t.on_nonfinite in NONFINITE_POLICIES,
             f"train.on_nonfinite: unknown policy '{t.on_nonfinite}'; one of "
             f"{', '.join(NONFINITE_POLICIES)}")
    _require(t.optimizer_impl in OPTIMIZER_IMPLS,
             f"train.optimizer_impl: unknown implementation '{t.optimizer_impl}'"
             f"{closest(t.optimizer_impl, list(OPTIMIZER_IMPLS))}; one of "
             f"{', '.join(OPTIMIZER_IMPLS)}")
    _require(t.nonfinite_max_skips >= 0,
             f"train.nonfinite_max_skips={t.nonfinite_max_skips} must be >= 0")
    _require(t.activation_checkpointing in AC_MODES,
             f"train.activation_checkpointing: unknown mode '{t.activation_checkpointing}'"
             f"{closest(t.activation_checkpointing, list(AC_MODES))}; one of "
             f"{', '.join(AC_MODES)}")
    _require(t.compile_backend in COMPILE_BACKENDS,
             f"train.compile_backend: unknown backend '{t.compile_backend}'"
             f"{closest(t.compile_backend, list(COMPILE_BACKENDS))}; one of "
             f"{', '.join(COMPILE_BACKENDS)}")
    _require(t.dtype in DTYPES, f"train.dtype: unknown dtype '{t.dtype}'"
             f"{closest(t.dtype, list(DTYPES))}; one of {', '.join(DTYPES)}")
    _require(p.reduce_dtype in DTYPES, f"parallel.reduce_dtype: unknown dtype '{p.reduce_dtype}'"
             f"; one of {', '.join(DTYPES)}")
    _require(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _require(t.global_batch >= 1, f"train.global_batch={t.global_batch} must be >= 1")
    _require(t.micro_batch >= 0, f"train.micro_batch={t.micro_batch} must be >= 0 (0 = whole "
             "local batch)")
    _require(t.lr > 0, f"train.lr={t.lr} must be > 0")
    _require(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    _require(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    _require(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay} must be >= 0")
    _require(0 <= t.beta1 < 1, f"train.beta1={t.beta1} must be in [0, 1)")
    _require(0 <= t.beta2 < 1, f"train.beta2={t.beta2} must be in [0, 1)")
    _require(t.eps > 0, f"train.eps={t.eps} must be > 0")
    _require(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 = off)")
    _require(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0")
    _require(t.eval_sequences >= 0 and t.eval_sequences % t.global_batch == 0,
             f"train.eval_sequences={t.eval_sequences} must be a multiple of train.global_batch="
             f"{t.global_batch} (so that every layout evaluates the same sequences)")
    _require(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    _require(t.sample_tokens >= 0, f"train.sample_tokens={t.sample_tokens} must be >= 0")
    _require(t.sample_temperature >= 0,
             f"train.sample_temperature={t.sample_temperature} must be >= 0")
    _require(t.sample_top_k >= 0, f"train.sample_top_k={t.sample_top_k} must be >= 0")

    _require(r.backend in BACKENDS,
             f"run.backend: unknown backend '{r.backend}'{closest(r.backend, list(BACKENDS))}; "
             f"one of {', '.join(BACKENDS)}")
    _require(r.device in ("auto", "cpu", "cuda"),
             f"run.device: '{r.device}' is not auto, cpu or cuda")
    _require(r.checkpoint_every >= 0, f"run.checkpoint_every={r.checkpoint_every} must be >= 0")
    _require(r.keep_checkpoints >= 1, f"run.keep_checkpoints={r.keep_checkpoints} must be >= 1")
    _require(r.peak_tflops >= 0, f"run.peak_tflops={r.peak_tflops} must be >= 0")
    _require(r.threads >= 0, f"run.threads={r.threads} must be >= 0")
    _require(r.timeout_s > 0, f"run.timeout_s={r.timeout_s} must be > 0")
    _require(r.profile_start >= 0, f"run.profile_start={r.profile_start} must be >= 0 (0 = off)")
    _require(r.profile_steps >= 1, f"run.profile_steps={r.profile_steps} must be >= 1")
    _require(r.profile_start <= t.steps,
             f"run.profile_start={r.profile_start} is past the last step (train.steps={t.steps})")

    _require(d.seq_len >= 1, f"data.seq_len={d.seq_len} must be >= 1")
    _require(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _require(d.max_bytes >= 0, f"data.max_bytes={d.max_bytes} must be >= 0 (0 = no cap)")


# ---------------------------------------------------------------- what "auto" means here


def resolve_device(r: RunConfig) -> str:
    import torch  # here, not at the top: loading a config must not need torch

    if r.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return r.device


def resolve_backend(r: RunConfig) -> str:
    if r.backend != "auto":
        return r.backend
    return "nccl" if resolve_device(r) == "cuda" else "gloo"
