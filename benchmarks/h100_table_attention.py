"""Fill the committed H100 kernel table's attention rows from meshloom's own H100 measurement.

The published sources the H100 table cites give FlashAttention-2 one causal point (8192 tokens,
head width 128) and no cuDNN attention at all, so the planner priced every causal length at the
8192-token rate (backward 287 TF/s, where the kernel runs 110 at 512 tokens and 215 at 2048)
and could not price the cuDNN kernel PyTorch's SDPA runs on an H100. The measured table
(`meshloom bench kernels` on an H100, 2026-11-26) has both kernels at 512-32768 tokens and head
widths 64, 128 and 192. This script copies every measured attention row into the H100 table,
citing the measured file; where a published row sits at the same point, the table's loader
takes their mean, as it does for GEMM shapes two sources measured. The GEMM rows stay the
published ones (docs/kernel-tables.md says why).

    python benchmarks/h100_table_attention.py           # rewrites plan/kernels/h100.json
    python benchmarks/h100_table_attention.py --check   # exit 1 if the committed table differs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "src/meshloom/plan/kernels/h100.json"
MEASURED = ROOT / "benchmarks/measured/h100-2026-11-26/h100-kernels.json"
SOURCE = "meshloom_h100_2026_11_26"
ROW_KEYS = ("seq", "head_dim", "causal", "direction", "kernel", "tflops", "batch", "heads")


def source_entry(measured: dict) -> dict:
    prov = measured.get("provenance", {})
    return {
        "title": "meshloom's own H100 measurement: `meshloom bench kernels`, attention rows "
                 "(PyTorch SDPA's FlashAttention-2 and cuDNN backends)",
        "path": f"benchmarks/measured/{MEASURED.parent.name}/{MEASURED.name}",
        "where": f"'attention' rows; device {prov.get('device_name')!r}, "
                 f"torch {prov.get('torch', '?')}, CUDA {prov.get('cuda', '?')}",
        "kind": "measured",
    }


def filled(table: dict, measured: dict) -> dict:
    """`table` with its measured attention rows replaced by `measured`'s, cited."""
    rows = [r for r in table["attention"] if r.get("source") != SOURCE]
    for r in measured["attention"]:
        row = {k: r[k] for k in ROW_KEYS if k in r}
        if row.get("kernel") == "fa2":
            del row["kernel"]  # the table's default kernel
        rows.append({**row, "source": SOURCE})
    provenance = {**table["provenance"], "measured_rows": (
        f"The attention rows citing {SOURCE} are meshloom's own measurement on an H100 "
        "(benchmarks/h100_table_attention.py copies them): the published sources give "
        "FlashAttention-2 one causal point and no cuDNN rows. Where both give a point, the "
        "loader takes their mean.")}
    return {**table, "provenance": provenance, "attention": rows,
            "sources": {**table["sources"], SOURCE: source_entry(measured)}}


def dumps(table: dict) -> str:
    """The committed layout: two-space indents, one GEMM (fp8 too) or attention row per
    line."""
    rows = {key: table[key] for key in ("gemm", "gemm_fp8", "attention") if key in table}
    text = json.dumps({**table, **{k: f"@@{k}@@" for k in rows}}, indent=2)
    for key, items in rows.items():
        lines = ",\n".join(f"    {json.dumps(r)}" for r in items)
        text = text.replace(f'"@@{key}@@"', f"[\n{lines}\n  ]")
    return text + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare with the committed table")
    p.add_argument("--table", type=Path, default=TABLE)
    p.add_argument("--measured", type=Path, default=MEASURED)
    args = p.parse_args(argv)
    current = args.table.read_text()
    text = dumps(filled(json.loads(current), json.loads(args.measured.read_text())))
    if args.check:
        if text != current:
            print(f"{args.table} differs from what {args.measured.name} gives; rerun "
                  "benchmarks/h100_table_attention.py", file=sys.stderr)
            return 1
        return 0
    args.table.write_text(text)
    print(f"wrote {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
