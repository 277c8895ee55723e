"""Pre-launch validation: every rule a run config must meet, run in one fixed order.

The rules themselves live beside the code they protect, each as `check_*_config(cfg, dims,
model) -> one-line message or None` (see layout_rules()); this module only resolves what they
need (the mesh degrees, the model's shape, the tokenizer) and runs them. `meshloom train` calls
`validate()` in the parent process, before any rank starts; the planner's search calls
`layout_problem()` on every candidate, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

from meshloom.config import (
    Config,
    ConfigError,
    ModelDims,
    RunConfig,
    check_ranges,
    closest,
    resolve_device,
)
from meshloom.mesh import ParallelDims

Rule = Callable[[Config, ParallelDims, ModelDims], str | None]


def _raise_if(problem: str | None) -> None:
    if problem:
        raise ConfigError(problem)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@functools.cache
def layout_rules() -> tuple[Rule, ...]:
    """The strategies' rules in the order they are asked. Imported on first use, not at the
    top: they load torch, and `meshloom --help` or a config dump should not wait for it."""
    from meshloom.data import check_batch_config
    from meshloom.parallel.context import check_cp_config
    from meshloom.parallel.expert import check_ep_config
    from meshloom.parallel.pipeline_schedule import check_pp_config
    from meshloom.parallel.rank_devices import check_rank_devices_config
    from meshloom.parallel.tensor_plan import check_tp_config
    from meshloom.parallel.zero import check_zero_config

    return (check_batch_config, check_zero_config, check_tp_config, check_cp_config,
            check_pp_config, check_rank_devices_config, check_ep_config)


def layout_problem(cfg: Config, dims: ParallelDims, model: ModelDims) -> str | None:
    """The first reason this layout cannot train this model (one line naming the key), or
    None. `cfg`'s keys must each be in range already (config.check_ranges)."""
    for rule in layout_rules():
        problem = rule(cfg, dims, model)
        if problem:
            return problem
    # A model may know layouts it cannot run exactly (a sliding window under context parallel):
    # its config says why, `layout_problem(dims, seq_len)`; the planner's shapes have none.
    own = getattr(model, "layout_problem", None)
    return own(dims, cfg.data.seq_len) if own is not None else None


def validate(cfg: Config, world_size: int, *, check_data: bool = True) -> ParallelDims:
    """Check every rule that can be checked before launch; returns the resolved ParallelDims.

    Raises ConfigError with a one-line message naming the key. Order: each key on its own, the
    one-process dp mode, the mesh degrees, this machine's backend, the data, the model, how the
    data fits the model, then the strategies' layout rules."""
    _require(world_size >= 1, f"--nproc={world_size} must be >= 1")
    check_ranges(cfg)
    p = cfg.parallel
    if p.mode == "dp":  # before the axes are resolved: its own messages are the clearer ones
        from meshloom.parallel.single_process_dp import check_dp_config

        _raise_if(check_dp_config(cfg, world_size))
    try:
        dims = ParallelDims.resolve(world_size, pp=p.pp, dp_replicate=p.dp_replicate,
                                    dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, ep=p.ep)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_environment(cfg.run)
    vocab = _tokenizer_vocab(cfg) if check_data else None
    mcfg = model_config(cfg, vocab)
    _raise_if(_data_fits_model(cfg, mcfg, vocab))
    _raise_if(layout_problem(cfg, dims, mcfg))
    return dims


def model_config(cfg: Config, vocab_size: int | None = None) -> Any:
    """The model config (of its family, models/families.py) the run will build: the preset with
    the config's overrides applied, or the shape of the weights `model.init_from` names."""
    from meshloom.models import families

    if cfg.model.init_from:
        from meshloom.weights import WeightsError, init_from_config

        try:
            return init_from_config(cfg.model, vocab_size)
        except WeightsError as e:
            raise ConfigError(f"model.init_from: {e}") from None
    presets = families.presets()
    _require(cfg.model.preset in presets,
             f"model.preset: unknown preset '{cfg.model.preset}'"
             f"{closest(cfg.model.preset, list(presets))}; presets: {', '.join(presets)}")
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items()
                 if k not in ("preset", "family", "init_from") and v is not None}
    if "vocab_size" not in overrides and vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    try:
        return families.config_from_preset(cfg.model.preset, cfg.model.family, **overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _tokenizer_vocab(cfg: Config) -> int:
    """The tokenizer's vocabulary size, once the tokenizer and the corpus are found."""
    from meshloom.data import DataError, load_tokenizer, resolve_sources

    try:
        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
        resolve_sources(cfg.data.source)
    except DataError as e:
        raise ConfigError(str(e)) from None
    return vocab


def _data_fits_model(cfg: Config, mcfg: Any, vocab: int | None) -> str | None:
    d = cfg.data
    if vocab is not None and mcfg.vocab_size < vocab:
        return (f"model.vocab_size={mcfg.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({vocab}, data.tokenizer={d.tokenizer!r})")
    if d.seq_len > mcfg.max_seq_len:
        return f"data.seq_len={d.seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}"
    return None


def _check_environment(r: RunConfig) -> None:
    """What this machine's PyTorch build and packages must offer for run.*."""
    import torch
    import torch.distributed as dist

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
    if r.tensorboard:
        _require(importlib.util.find_spec("tensorboard") is not None,
                 "run.tensorboard=true needs the tensorboard package: pip install tensorboard")
