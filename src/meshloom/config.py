"""Run configuration: dataclasses, TOML loading, `--set` overrides and validation.

Everything a rank needs is decided here, in the parent process, before any rank is launched: a bad
config is one line naming the key (`ConfigError`), never a traceback from inside a rank.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
BACKENDS = ("auto", "nccl", "gloo", "mpi")
DTYPES = ("fp32", "bf16", "fp16")
AC_MODES = ("none", "full", "selective")
NONFINITE_POLICIES = ("stop", "skip")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
PARALLEL_MODES = ("", "auto", "dp")


class ConfigError(ValueError):
    """A bad config value; the message is one line that names the key."""


@dataclass
class ModelConfig:
    # A preset from meshloom.models.llama.PRESETS; any field below that is set overrides it.
    preset: str = "tiny"
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
    ddp_bucket_mb: float = 25.0
    reshard_after_forward: bool = True  # ZeRO-3: free gathered parameters after each forward
    reduce_dtype: str = "fp32"  # dtype gradients are reduced in (DDP and the sharded stages)
    cpu_offload: bool = False  # ZeRO: fp32 master shard and AdamW state (stage 3: params) on CPU
    # "" / "auto": the mesh axes above; "dp": one process drives several devices with replicas
    # in threads (the nn.DataParallel baseline, docs/data-parallel.md) over parallel.dp_devices:
    # a count (cuda:0..N-1, or N CPU replicas; 0 = every GPU) or a list like ["cuda:0", "cuda:1"].
    mode: str = ""
    dp_devices: int | list[str] = 0


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


# ---------------------------------------------------------------- validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def model_config(cfg: Config, vocab_size: int | None = None):
    """The LlamaConfig the run will build: the preset with the config's overrides applied."""
    from meshloom.models.llama import PRESETS, config_from_preset

    if cfg.model.init_from:
        from meshloom.weights import WeightsError, init_from_config

        try:
            return init_from_config(cfg.model, vocab_size)
        except WeightsError as e:
            raise ConfigError(f"model.init_from: {e}") from None
    _require(cfg.model.preset in PRESETS,
             f"model.preset: unknown preset '{cfg.model.preset}'"
             f"{closest(cfg.model.preset, list(PRESETS))}; presets: {', '.join(PRESETS)}")
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items()
                 if k not in ("preset", "init_from") and v is not None}
    if "vocab_size" not in overrides and vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    try:
        return config_from_preset(cfg.model.preset, **overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def validate(cfg: Config, world_size: int, *, check_data: bool = True):
    """Check every rule that can be checked before launch; returns the resolved ParallelDims.

    Raises ConfigError with a one-line message naming the key.
    """
    from meshloom.mesh import ParallelDims

    p, t, d, r = cfg.parallel, cfg.train, cfg.data, cfg.run
    _require(world_size >= 1, f"--nproc={world_size} must be >= 1")
    _require(p.mode in PARALLEL_MODES, f"parallel.mode: unknown mode '{p.mode}'"
             f"{closest(p.mode, ['auto', 'dp'])}; one of auto (the mesh axes) or dp (one "
             "process, several devices)")
    _require(p.mode == "dp" or p.dp_devices == 0,
             f"parallel.dp_devices={p.dp_devices!r} is only used with parallel.mode=dp")
    if p.mode == "dp":  # before the axes are resolved: its own messages are the clearer ones
        from meshloom.parallel.data_parallel import check_dp_config

        problem = check_dp_config(cfg, world_size)
        _require(problem is None, problem or "")
    try:
        dims = ParallelDims.resolve(world_size, pp=p.pp, dp_replicate=p.dp_replicate,
                                    dp_shard=p.dp_shard, cp=p.cp, tp=p.tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    # -- layout
    _require(p.zero_stage in (0, 1, 2, 3),
             f"parallel.zero_stage={p.zero_stage} must be 0, 1, 2 or 3")
    _require(p.zero_stage == 0 or dims.dp_shard > 1,
             f"parallel.zero_stage={p.zero_stage} shards over parallel.dp_shard, which is 1")
    _require(p.pp_schedule in PP_SCHEDULES,
             f"parallel.pp_schedule: unknown schedule '{p.pp_schedule}'"
             f"{closest(p.pp_schedule, list(PP_SCHEDULES))}; one of {', '.join(PP_SCHEDULES)}")
    _require(p.pp_microbatches >= 0, f"parallel.pp_microbatches={p.pp_microbatches} must be >= 0")
    _require(p.pp_virtual_stages >= 1,
             f"parallel.pp_virtual_stages={p.pp_virtual_stages} must be >= 1")
    _require(not p.sequence_parallel or dims.tp > 1,
             "parallel.sequence_parallel needs parallel.tp > 1 (it splits the tensor-parallel "
             "group's activations)")
    _require(p.ddp_bucket_mb > 0, f"parallel.ddp_bucket_mb={p.ddp_bucket_mb} must be > 0")
    _require(t.on_nonfinite in NONFINITE_POLICIES,
             f"train.on_nonfinite: unknown policy '{t.on_nonfinite}'; one of "
             f"{', '.join(NONFINITE_POLICIES)}")
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
    _require(not p.cpu_offload or p.zero_stage >= 1,
             "parallel.cpu_offload needs parallel.zero_stage >= 1 (it offloads the sharded "
             "optimizer state)")

    # -- training
    _require(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _require(t.global_batch >= 1, f"train.global_batch={t.global_batch} must be >= 1")
    _require(t.global_batch % dims.dp == 0,
             f"train.global_batch={t.global_batch} must be divisible by the data-parallel degree "
             f"{dims.dp} (parallel.dp_replicate x parallel.dp_shard)")
    local = t.global_batch // dims.dp
    _require(t.micro_batch >= 0, f"train.micro_batch={t.micro_batch} must be >= 0 (0 = whole "
             "local batch)")
    _require(t.micro_batch == 0 or local % t.micro_batch == 0,
             f"train.micro_batch={t.micro_batch} must divide the per-rank batch {local} "
             f"(train.global_batch {t.global_batch} / data-parallel degree {dims.dp})")
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

    # -- run
    _check_backend(r)
    _require(r.checkpoint_every >= 0, f"run.checkpoint_every={r.checkpoint_every} must be >= 0")
    _require(r.keep_checkpoints >= 1, f"run.keep_checkpoints={r.keep_checkpoints} must be >= 1")
    _require(r.peak_tflops >= 0, f"run.peak_tflops={r.peak_tflops} must be >= 0")
    _require(r.threads >= 0, f"run.threads={r.threads} must be >= 0")
    _require(r.timeout_s > 0, f"run.timeout_s={r.timeout_s} must be > 0")
    if r.tensorboard:
        import importlib.util

        _require(importlib.util.find_spec("tensorboard") is not None,
                 "run.tensorboard=true needs the tensorboard package: pip install tensorboard")

    # -- data and model (the model's vocabulary comes from the tokenizer unless set)
    _require(d.seq_len >= 1, f"data.seq_len={d.seq_len} must be >= 1")
    _require(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _require(d.max_bytes >= 0, f"data.max_bytes={d.max_bytes} must be >= 0 (0 = no cap)")
    vocab = None
    if check_data:
        from meshloom.data import DataError, load_tokenizer, resolve_sources

        try:
            vocab = load_tokenizer(d.tokenizer).vocab_size
            resolve_sources(d.source)
        except DataError as e:
            raise ConfigError(str(e)) from None
    mcfg = model_config(cfg, vocab)
    _require(vocab is None or mcfg.vocab_size >= vocab,
             f"model.vocab_size={mcfg.vocab_size} is smaller than the tokenizer's vocabulary "
             f"({vocab}, data.tokenizer={d.tokenizer!r})")
    _require(d.seq_len <= mcfg.max_seq_len,
             f"data.seq_len={d.seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}")
    if dims.tp > 1:
        from meshloom.parallel.tensor_plan import check_tp_dims

        problem = check_tp_dims(dims.tp, n_heads=mcfg.n_heads, kv_heads=mcfg.kv_heads,
                                ffn_hidden=mcfg.hidden)
        _require(problem is None, problem or "")
        _require(not p.sequence_parallel or d.seq_len % dims.tp == 0,
                 f"data.seq_len={d.seq_len} must be divisible by parallel.tp={dims.tp} with "
                 "parallel.sequence_parallel (the sequence is split over tp)")
    _require(dims.cp == 1 or d.seq_len % (2 * dims.cp) == 0,
             f"data.seq_len={d.seq_len} must be divisible by 2 x parallel.cp = {2 * dims.cp}")
    if dims.pp > 1:
        _validate_pipeline(cfg, dims, mcfg)
    return dims


def pipeline_microbatches(cfg: Config, dims) -> int:
    """Micro-batches per step and pipeline: parallel.pp_microbatches, or what train.micro_batch
    implies, or pp x virtual stages."""
    p, local = cfg.parallel, cfg.train.global_batch // dims.dp
    if p.pp_microbatches:
        return p.pp_microbatches
    if cfg.train.micro_batch:
        return local // cfg.train.micro_batch
    return dims.pp * p.pp_virtual_stages


def _validate_pipeline(cfg: Config, dims, mcfg) -> None:
    p, t = cfg.parallel, cfg.train
    v, stages = p.pp_virtual_stages, dims.pp * p.pp_virtual_stages
    _require(v == 1 or p.pp_schedule == "interleaved_1f1b",
             f"parallel.pp_virtual_stages={v} needs parallel.pp_schedule=interleaved_1f1b "
             f"(not {p.pp_schedule})")
    if p.pp_layers:
        _require(len(p.pp_layers) == stages and sum(p.pp_layers) == mcfg.n_layers
                 and min(p.pp_layers) >= 1,
                 f"parallel.pp_layers={p.pp_layers} must list {stages} stage sizes (pp x "
                 f"pp_virtual_stages) of at least 1 layer each, adding up to model.n_layers="
                 f"{mcfg.n_layers}")
    else:
        _require(stages <= mcfg.n_layers,
                 f"parallel.pp={dims.pp} x parallel.pp_virtual_stages={v} = {stages} stages "
                 f"exceeds model.n_layers={mcfg.n_layers} (a stage needs at least one layer)")
    local = t.global_batch // dims.dp
    m = pipeline_microbatches(cfg, dims)
    _require(local % m == 0,
             f"parallel.pp_microbatches={m} must divide the per-pipeline batch {local} "
             f"(train.global_batch {t.global_batch} / data-parallel degree {dims.dp}); set "
             "parallel.pp_microbatches")
    _require(not (p.pp_microbatches and t.micro_batch and local // p.pp_microbatches
                  != t.micro_batch),
             f"train.micro_batch={t.micro_batch} and parallel.pp_microbatches="
             f"{p.pp_microbatches} disagree (per-pipeline batch {local}); set one of them")
    _require(p.pp_schedule != "interleaved_1f1b" or m % dims.pp == 0,
             f"parallel.pp_schedule=interleaved_1f1b needs the micro-batch count ({m}) to be a "
             f"multiple of parallel.pp={dims.pp}")
    _require(not (mcfg.tie_embeddings and p.zero_stage >= 2),
             f"tied embeddings across pipeline stages need parallel.zero_stage <= 1 (got "
             f"{p.zero_stage}): the two copies' whole gradients are summed between the first "
             "and the last stage")
    _require(p.pp_timeout_s > 0, f"parallel.pp_timeout_s={p.pp_timeout_s} must be > 0")


def _check_backend(r: RunConfig) -> None:
    import torch
    import torch.distributed as dist

    _require(r.backend in BACKENDS,
             f"run.backend: unknown backend '{r.backend}'{closest(r.backend, list(BACKENDS))}; "
             f"one of {', '.join(BACKENDS)}")
    _require(r.device in ("auto", "cpu", "cuda"),
             f"run.device: '{r.device}' is not auto, cpu or cuda")
    _require(r.device != "cuda" or torch.cuda.is_available(),
             "run.device=cuda but no CUDA device is available to this PyTorch build")
    _require(dist.is_available(), "this PyTorch build has no torch.distributed support")
    available = {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(),
                 "mpi": dist.is_mpi_available()}
    if r.backend != "auto":
        _require(available[r.backend],
                 f"run.backend={r.backend} is not available in this PyTorch build "
                 f"(available: {', '.join(k for k, v in available.items() if v) or 'none'})")
    _require(not (r.backend == "nccl" and resolve_device(r) == "cpu"),
             "run.backend=nccl needs GPUs, but run.device resolves to cpu; use gloo or auto")


def resolve_device(r: RunConfig) -> str:
    import torch

    if r.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return r.device


def resolve_backend(r: RunConfig) -> str:
    if r.backend != "auto":
        return r.backend
    return "nccl" if resolve_device(r) == "cuda" else "gloo"
