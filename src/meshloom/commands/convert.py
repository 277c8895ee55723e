"""`meshloom convert`: Hugging Face Llama folders <-> meshloom weights.

    meshloom convert hf-to-meshloom HF_FOLDER WEIGHTS_FOLDER [--dtype fp32]
    meshloom convert meshloom-to-hf SOURCE HF_FOLDER [--max-shard-size 5GB] [--dtype bf16]

SOURCE is a weights folder, a checkpoint folder or a run folder (its latest complete checkpoint).
Formats and the weight mapping: docs/huggingface.md. Only the conversion functions import torch,
so registering the command keeps `meshloom --help` fast.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from meshloom.launch import EXIT_BAD_INPUT

DTYPES = ("fp32", "bf16", "fp16")
DEFAULT_SHARD = "5GB"


class ConvertError(ValueError):
    """Bad input to a conversion; one line."""


def parse_size(text: str) -> int:
    """'5GB', '500MB', '10KiB' or a number of bytes -> bytes (KB/MB/GB are powers of 1000, as
    in transformers' max_shard_size)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size like 5GB, 500MB or 1000000")
    unit = (m.group(2) or "b").lower()
    size = int(float(m.group(1)) * (1024 if "i" in unit else 1000) ** "bkmgt".index(unit[0]))
    if size <= 0:
        raise ValueError(f"{text!r} must be at least one byte")
    return size


class _Output:
    """Write into ``DST.partial`` and rename it to ``DST`` only once complete, so an interrupted
    conversion never leaves a folder that looks usable."""

    def __init__(self, dst: str | Path):
        self.dst = Path(dst)
        if self.dst.exists() and (not self.dst.is_dir() or any(self.dst.iterdir())):
            raise ConvertError(f"{self.dst} already exists and is not an empty folder")
        self.tmp = self.dst.with_name(self.dst.name + ".partial")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            os.replace(self.tmp, self.dst)  # an empty dst is replaced as well
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _torch_dtype(name: str | None):
    if name is None:
        return None
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def hf_to_meshloom(src: str | Path, dst: str | Path, dtype: str | None = None) -> Path:
    """Convert an HF Llama folder into a meshloom weights folder (``dtype``: fp32, bf16, fp16,
    or None to keep the source's); returns ``dst``."""
    from meshloom.models.hf_checkpoint import TOKENIZER_FILE, iter_hf_weights, read_hf_config
    from meshloom.weights import write_weights_folder

    cfg = read_hf_config(src)
    tok = Path(src) / TOKENIZER_FILE
    with _Output(dst) as out:
        write_weights_folder(out, cfg, iter_hf_weights(src, cfg), source=f"hf:{src}",
                             dtype=_torch_dtype(dtype), tokenizer=tok if tok.is_file() else None)
    return Path(dst)


def meshloom_to_hf(src: str | Path, dst: str | Path, *, max_shard_size: int | str = DEFAULT_SHARD,
                   dtype: str | None = None) -> list[Path]:
    """Convert a meshloom weights, checkpoint or run folder into an HF Llama folder; returns
    the safetensors files written."""
    from meshloom.data import load_tokenizer
    from meshloom.models.hf_checkpoint import TOKENIZER_FILE, write_hf_folder
    from meshloom.weights import iter_weights, open_source

    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    source = open_source(src)
    to = _torch_dtype(dtype)
    with _Output(dst) as out:
        weights = {n: t if to is None else t.to(to) for n, t in iter_weights(source)}
        eos = None
        if source.tokenizer is not None:
            eos = load_tokenizer(source.tokenizer).eos_id
            if source.tokenizer != "byte":
                shutil.copyfile(source.tokenizer, out / TOKENIZER_FILE)
        files = write_hf_folder(out, source.cfg, weights, max_shard_bytes=limit,
                                eos_token_id=eos)
    return [Path(dst) / f.name for f in files]


def _run(args: argparse.Namespace) -> int:
    from meshloom.data import DataError
    from meshloom.models.hf_checkpoint import HFCheckpointError
    from meshloom.weights import WeightsError

    try:
        if args.direction == "hf-to-meshloom":
            hf_to_meshloom(args.src, args.dst, args.dtype)
            print(f"wrote meshloom weights folder {args.dst}")
        else:
            files = meshloom_to_hf(args.src, args.dst, max_shard_size=args.max_shard_size,
                                   dtype=args.dtype)
            print(f"wrote Hugging Face folder {args.dst} ({len(files)} safetensors file(s))")
    except (ConvertError, HFCheckpointError, WeightsError, DataError) as e:
        print(f"meshloom: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub) -> None:
    """Register `meshloom convert` on the top-level subparsers."""
    conv = sub.add_parser("convert", help="Hugging Face Llama folder <-> meshloom weights")
    how = conv.add_subparsers(dest="direction", required=True, parser_class=type(conv))
    h2m = how.add_parser("hf-to-meshloom", help="HF folder -> meshloom weights folder")
    h2m.add_argument("src", metavar="HF_FOLDER", help="config.json + safetensors (any sharding)")
    h2m.add_argument("dst", metavar="WEIGHTS_FOLDER", help="new folder to write")
    m2h = how.add_parser("meshloom-to-hf", help="meshloom weights/checkpoint/run -> HF folder")
    m2h.add_argument("src", metavar="SOURCE",
                     help="weights folder, checkpoint folder, or run folder (latest checkpoint)")
    m2h.add_argument("dst", metavar="HF_FOLDER", help="new folder to write")
    m2h.add_argument("--max-shard-size", type=_size, default=parse_size(DEFAULT_SHARD),
                     metavar="SIZE", help=f"split files above this size (default {DEFAULT_SHARD})")
    for p in (h2m, m2h):
        p.add_argument("--dtype", choices=DTYPES, default=None,
                       help="store the weights in this dtype (default: as in the source)")
        p.set_defaults(func=_run)
