"""`meshloom checkpoint info DIR`: what a checkpoint holds, from which layout, and whether its
files are intact. DIR is a run folder (every checkpoint listed, the newest described) or one
checkpoint folder. Nothing is loaded but the index and the JSON files."""

from __future__ import annotations

import argparse
import json
import sys
import time
from math import prod
from pathlib import Path
from typing import Any

from meshloom.launch import EXIT_BAD_INPUT

EXIT_DAMAGED = 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    ck = sub.add_parser("checkpoint", help="inspect checkpoints")
    what = ck.add_subparsers(dest="checkpoint_command", required=True,
                             parser_class=type(ck))
    info = what.add_parser("info", help="what a checkpoint holds, its layout, its integrity")
    info.add_argument("dir", metavar="DIR", help="a run folder or a checkpoint folder")
    info.add_argument("--json", action="store_true", help="print a JSON object instead")
    info.add_argument("--tensors", action="store_true", help="list every tensor")
    info.add_argument("--no-verify", action="store_true",
                      help="check file sizes only, not SHA-256 checksums")
    info.set_defaults(func=_info)


def describe(folder: Path, verify: bool = True) -> dict[str, Any]:
    """The facts `info` prints, as a dict (also its --json output)."""
    from meshloom.checkpoint import files

    out: dict[str, Any] = {"path": str(folder)}
    damage = files.problems(folder, hash_only=None if verify else [])
    out["intact"] = not damage
    out["problems"] = damage
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return out
    cfg = meta.get("config", {})
    out.update({"step": meta.get("step"), "format": meta.get("format"),
                "saved": meta.get("time"), "world_size": meta.get("world_size"),
                "layout": meta.get("layout"), "loss_scaler": meta.get("loss_scaler"),
                "model": cfg.get("model"), "train": {k: cfg.get("train", {}).get(k) for k in
                                                    ("steps", "global_batch", "lr", "dtype")},
                "seq_len": cfg.get("data", {}).get("seq_len")})
    try:
        entries = files.tensor_entries(folder)
    except files.CheckpointError as e:
        out["problems"] = damage + [str(e)]
        out["intact"] = False
        return out
    tensors = {k: {"shape": list(v.size), "dtype": str(v.properties.dtype).removeprefix("torch."),
                   "bytes": prod(v.size) * v.properties.dtype.itemsize}
               for k, v in sorted(entries.items())}
    out["tensors"] = tensors
    model = {k: v for k, v in tensors.items() if k.startswith("model/")}
    optim = {k: v for k, v in tensors.items() if k.startswith("optim/") and k != "optim/step"}
    out["model_tensors"] = len(model)
    out["parameters"] = sum(prod(v["shape"]) for v in model.values())
    out["optimizer_tensors"] = len(optim)
    out["rng_files"] = len(list(folder.glob("rng_rank*.pt")))
    out["files"] = {"count": len(files.data_files(folder)),
                    "bytes": sum(p.stat().st_size for p in folder.iterdir() if p.is_file())}
    return out


def _layout_line(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "unknown"
    axes = " x ".join(f"{a} {layout[a]}" for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
                      if layout.get(a, 1) > 1) or "1 process"
    zero = layout.get("zero_stage") or 0
    return axes + (f", ZeRO-{zero}" if zero else "")


def format_info(d: dict[str, Any], tensors: bool = False) -> str:
    lines = [f"checkpoint {d['path']}"]
    if "step" in d:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["saved"])) \
            if d.get("saved") else "?"
        t = d.get("train", {})
        lines.append(f"  step:      {d['step']} of {t.get('steps')} (saved {saved}, format "
                     f"{d.get('format')})")
        n = d.get("world_size")
        lines.append(f"  layout:    {_layout_line(d.get('layout'))} (written by {n} "
                     f"rank{'s' if n != 1 else ''}; it resumes under any valid layout)")
        m = d.get("model") or {}
        lines.append(f"  model:     llama {m.get('preset')}, {d.get('parameters', 0) / 1e6:.2f}M "
                     f"parameters in {d.get('model_tensors', 0)} tensors")
        scaler = d.get("loss_scaler") or {}
        scale = f"; fp16 loss scale {scaler['scale']:g}" \
            if t.get("dtype") == "fp16" and "scale" in scaler else ""
        lines.append(f"  optimizer: AdamW moments for {d.get('optimizer_tensors', 0) // 2} "
                     f"parameters, step count{scale}")
        if d.get("seq_len") and t.get("global_batch"):
            lines.append(f"  data:      next batch is step {d['step'] + 1} (global batch "
                         f"{t['global_batch']} x {d['seq_len']} tokens); RNG states of "
                         f"{d.get('rng_files', 0)} rank(s)")
        if "files" in d:
            lines.append(f"  files:     {d['files']['count']} data files, "
                         f"{d['files']['bytes'] / 1e6:.2f} MB")
    if d["intact"]:
        lines.append("  integrity: every file matches manifest.json (sizes and checksums)")
    else:
        lines.append("  integrity: DAMAGED - " + "; ".join(d["problems"]))
    if tensors and d.get("tensors"):
        width = max(len(k) for k in d["tensors"])
        for k, v in d["tensors"].items():
            lines.append(f"    {k:<{width}}  {str(tuple(v['shape'])):<16} {v['dtype']}")
    return "\n".join(lines)


def _info(args: argparse.Namespace) -> int:
    from meshloom.checkpoint import CheckpointError, checkpoints_in

    path = Path(args.dir)
    try:  # every checkpoint, damaged ones too: describing them is the point
        folders = checkpoints_in(path)
    except CheckpointError as e:
        print(f"meshloom: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    newest = describe(folders[-1], verify=not args.no_verify)
    others = [describe(f, verify=not args.no_verify) for f in folders[:-1]]
    if args.json:
        print(json.dumps({"checkpoints": others + [newest]}, indent=2))
    else:
        if others:
            print(f"{len(folders)} checkpoints in {path}:")
            for d in others + [newest]:
                state = "intact" if d["intact"] else "DAMAGED"
                print(f"  {Path(d['path']).name}  {state}")
        print(format_info(newest, tensors=args.tensors))
    return 0 if newest["intact"] and all(d["intact"] for d in others) else EXIT_DAMAGED
