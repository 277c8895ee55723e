"""`meshloom train` (launching ranks through torchrun) and `meshloom layout` (who holds what,
without training)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from meshloom.config import Config, ConfigError, dump_toml, load_config
from meshloom.launch import EXIT_BAD_INPUT, builtin_config, free_port
from meshloom.validation import validate


def default_nproc(cfg: Config) -> int:
    """Processes implied by the config's axes when --nproc is not given (dp_shard=-1 counts 1)."""
    p = cfg.parallel
    n = 1
    for degree in (p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp):
        n *= max(degree, 1)  # a bad degree is reported by validate(), by name
    return n


def resolve_run_dir(cfg: Config, resume: bool) -> Path:
    """run.dir, or a new timestamped folder under runs/; --resume picks the newest one with a
    checkpoint."""
    from meshloom import checkpoint

    if cfg.run.dir:
        run_dir = Path(cfg.run.dir)
        if not resume and checkpoint.latest_checkpoint(run_dir) is not None:
            raise ConfigError(f"run.dir={run_dir} already holds checkpoints: pass --resume to "
                              "continue that run, or --set run.dir=NEW_FOLDER")
        return run_dir
    if resume:
        earlier = sorted(Path("runs").glob(f"{cfg.name}-*"))
        with_ckpt = [d for d in earlier if checkpoint.latest_checkpoint(d) is not None]
        if with_ckpt:
            return with_ckpt[-1]
    return Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run(args: argparse.Namespace) -> int:
    from meshloom.ps import is_ps_config

    if is_ps_config(args.config):  # a [ps] section: the parameter-server hybrid (meshloom.ps)
        from meshloom.ps.launch import run_cli

        return run_cli(args)
    from meshloom.data import DataError
    from meshloom.train import prepare_data, print_layout

    try:
        cfg = load_config(args.config or builtin_config("demo"), args.overrides)
        if args.config is None:
            cfg.name = "demo"
        nproc = args.nproc or default_nproc(cfg)
        dims = validate(cfg, nproc * args.nnodes)
        run_dir = resolve_run_dir(cfg, args.resume)
        cfg.run.dir = str(run_dir)
        print_layout(cfg, dims, ranks_per_node=nproc)
        t0 = time.perf_counter()
        token_file = prepare_data(cfg)
        print(f"data: {token_file} ({time.perf_counter() - t0:.1f}s)", flush=True)
    except (ConfigError, DataError) as e:
        print(f"meshloom: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "config.toml"
    resolved.write_text(dump_toml(cfg))
    rank_args = [str(resolved)] + (["--resume"] if args.resume else [])
    if nproc * args.nnodes == 1 and args.max_restarts == 0:
        from meshloom.train import main as rank_main

        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return rank_main(rank_args)
    return _torchrun(args, nproc, rank_args, run_dir)


def _torchrun(args: argparse.Namespace, nproc: int, rank_args: list[str], run_dir: Path) -> int:
    from meshloom import checkpoint
    from meshloom.launch import Launch, torchrun

    def resume_point() -> str | None:  # what a restarted rank resumes from (train.main)
        found = checkpoint.latest_checkpoint(run_dir)
        return found.name if found else None

    # A restarted rank resumes by itself from the last intact checkpoint (train.main).
    return torchrun(Launch(
        "meshloom.train", rank_args, nproc, what="training", max_restarts=args.max_restarts,
        nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id, resume_point=resume_point,
        on_signal="the ranks saved a checkpoint where they stopped: continue with --resume"))


def layout(args: argparse.Namespace) -> int:
    from meshloom.train import print_layout

    try:
        cfg = load_config(args.config or builtin_config("demo"), args.overrides)
        nproc = args.nproc or default_nproc(cfg)
        dims = validate(cfg, nproc, check_data=False)
    except ConfigError as e:
        print(f"meshloom: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print_layout(cfg, dims, ranks_per_node=args.ranks_per_node or nproc)
    return 0


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML config (default: the built-in demo)")
    p.add_argument("--nproc", type=int, default=0, help="processes per node")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override a config key, e.g. train.steps=200")


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="train a model (no config: the built-in demo)")
    _add_config_args(t)
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint of the run")
    t.add_argument("--nnodes", type=int, default=1, help="nodes (multi-node: with --rdzv-endpoint)")
    t.add_argument("--node-rank", type=int, default=0)
    t.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous")
    t.add_argument("--rdzv-id", default="meshloom")
    t.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart all ranks up to K times after a failure; they resume from "
                        "the last intact checkpoint")
    t.set_defaults(func=run)
    lay = sub.add_parser("layout", help="print which rank holds what, without training")
    _add_config_args(lay)
    lay.add_argument("--ranks-per-node", type=int, default=0)
    lay.set_defaults(func=layout)
