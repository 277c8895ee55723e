"""Every GEMM shape the planner asks a GPU's kernel table for while it predicts the validation
rows on that GPU (benchmarks/planner_validation.py), as the JSON list that
`meshloom bench kernels --shapes` measures. A table measured with it answers those rows'
GEMMs exactly instead of interpolating between the default shapes:

    python benchmarks/validation_shapes.py --gpu h100 > shapes.json
    meshloom bench kernels --shapes shapes.json --head-dims 64,128,192 ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshloom.plan import kernel_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_validation  # noqa: E402


def validation_shapes(gpu: str) -> list[list[int]]:
    """(m, n, k) of every GEMM priced from `gpu`'s table while the rows run on it are
    searched (the chosen layouts' and every candidate's)."""
    table = kernel_table.for_gpu(gpu)
    if table is None:
        raise SystemExit(f"validation_shapes: no committed kernel table for {gpu!r}")
    table._memo.clear()  # the table memoises every shape it answers: that is the list
    planner_validation.meshloom_h100_rows()
    planner_validation.published_rows()
    return sorted(list(key) for key in table._memo)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="h100", help="the kernel table's GPU (default h100)")
    args = p.parse_args(argv)
    print(json.dumps(validation_shapes(args.gpu)))


if __name__ == "__main__":
    main()
