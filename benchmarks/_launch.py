"""What the benchmarks share: the rank launcher, the per-rank data, the step statistics.

`launch(rank_main, args)` starts `args.nproc` ranks (forked on CPU, spawned for CUDA) on a free
loopback port, runs `rank_main(args, rank, world)` in each and returns rank 0's result. A rank's
exception comes back with its traceback; a dead or hung rank fails the run instead of hanging it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshloom.launch import run_ranks

RankMain = Callable[[argparse.Namespace, int, int], Any]


def threads_per_rank(nproc: int) -> int:
    """Ranks share the machine's cores: oversubscribing them would time thread contention."""
    return max(1, len(os.sched_getaffinity(0)) // nproc)


def batch(args: argparse.Namespace, vocab: int, rank: int, step: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of `args.batch` x `args.seq` tokens for one rank and step."""
    # Seeded by (rank, step): each rank gets its own data, and every compared copy the same.
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device)
    return x[:, :-1], x[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def summary(times: list[float]) -> dict:
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return {"median_s": statistics.median(times), "mean_s": statistics.mean(times),
            "p10_s": deciles[0], "p90_s": deciles[-1], "times_s": times}


def _rank_main(rank_main: RankMain, args: argparse.Namespace) -> Any:
    return rank_main(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def launch(rank_main: RankMain, args: argparse.Namespace, timeout: float = 3600.0) -> Any:
    """Run rank_main on args.nproc ranks; rank 0's return value."""
    # A fork server's ranks start fast (it imported torch once) and carry nothing of this
    # process; CUDA wants fresh interpreters.
    method = "spawn" if args.device == "cuda" else "forkserver"
    return run_ranks(_rank_main, args.nproc, rank_main, args, timeout=timeout,
                     start_method=method)[0]


def parser(doc: str, **common: Any) -> argparse.ArgumentParser:
    """A benchmark's parser, described by its docstring's first paragraph; with `common`
    (steps, warmup, out) it also has the options every benchmark shares."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if common:
        add_common_args(p, **common)
    return p


def add_common_args(p: argparse.ArgumentParser, *, steps: int, warmup: int, out: Path) -> None:
    """The options every benchmark here shares."""
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="demo", choices=["demo", "tiny", "small"])
    p.add_argument("--steps", type=int, default=steps, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps per variant")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=out)


def check_common(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steps < 2 or args.warmup < 0 or args.nproc < 1:
        p.error("need --steps >= 2, --warmup >= 0, --nproc >= 1")


def parse_with_variants(p: argparse.ArgumentParser, argv: list[str] | None,
                        variants: tuple[str, ...]) -> argparse.Namespace:
    """Parse the common options plus `--variants` (distinct names from `variants`)."""
    p.add_argument("--variants", default=",".join(variants),
                   help=f"comma-separated, from {','.join(variants)}")
    args = p.parse_args(argv)
    check_common(p, args)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(variants))
    if unknown or not args.variants or len(set(args.variants)) != len(args.variants):
        p.error(f"--variants: give distinct names from {','.join(variants)}")
    return args


def round_order(variants: list, step: int) -> list:
    """Rotate by one each round; every other full cycle runs backwards, so each variant also
    follows every other one about equally often."""
    k = step % len(variants)
    order = variants[k:] + variants[:k]
    return order[::-1] if (step // len(variants)) % 2 else order


def paired(a: list[float], b: list[float]) -> float:
    """Median of step-by-step ratios (same round), immune to slow drift of the machine."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def comm_since(counter, before: dict[tuple[str, str], int]) -> Counter:
    """Bytes per collective recorded by our CommCounter since `before`."""
    out: Counter = Counter()
    for (axis, op), n in counter.bytes.items():
        out[op] += n - before.get((axis, op), 0)
    return +out  # drops ops that moved nothing in this window


def git_state() -> dict:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=root, check=True,
                               capture_output=True, text=True).stdout.strip()
        return {"commit": head, "src_modified": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "src_modified": None}


def provenance() -> dict:
    """What a result was measured with: the torch version and the commit."""
    return {"torch": torch.__version__, "git": git_state()}


def cpu_unless_gpus(args: argparse.Namespace, needed: int) -> None:
    """Run on the CPU with Gloo, saying so, when `--device cuda` asks for more GPUs than there
    are."""
    if args.device == "cuda" and torch.cuda.device_count() < needed:
        print(f"note: {needed} CUDA devices not available, running on cpu with gloo")
        args.device = "cpu"


def init_rank(args: argparse.Namespace, rank: int, world: int) -> torch.device:
    """This rank's device with its process group up: NCCL and one GPU per rank on CUDA, Gloo on
    the CPU."""
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        return device
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return torch.device("cpu")


def write_result(result: dict, out: Path, print_table: Callable[[dict], None]) -> dict:
    """Print the table, write the JSON (creating its folder) and say where."""
    import json

    print_table(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result
