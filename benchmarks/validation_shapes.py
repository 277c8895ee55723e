"""Every GEMM shape the planner asks a GPU's kernel table for while it predicts the validation
rows on that GPU (benchmarks/planner_validation.py), as the JSON list that
`meshloom bench kernels --shapes` measures. A table measured with it answers those rows'
GEMMs exactly instead of interpolating between the default shapes:

    python benchmarks/validation_shapes.py --gpu h100 > shapes.json
    meshloom bench kernels --shapes shapes.json --head-dims 64,128,192 ...

With `--fp8`, the shapes priced in fp8 instead (the Float8 rows' linears, whose fp8/bf16 speed
ratio the table reads), planning only the published runs that trained in Float8, in seconds;
`bash benchmarks/gpu_check.sh fp8` measures them in both precisions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from meshloom.plan import kernel_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_validation  # noqa: E402


def asked_shapes(memo: dict, fp8: bool = False) -> list[list[int]]:
    """The (m, n, k) a table's memo holds answers for: its bf16 GEMM rates (keys of three
    integers) or, with `fp8`, its fp8/bf16 ratios (keys `("fp8", m, n, k)`). The memo keeps
    attention rates too, under keys of their own."""
    if fp8:
        return sorted([m, n, k] for key in memo if key[0] == "fp8" for m, n, k in [key[1:]])
    return sorted(list(key) for key in memo
                  if len(key) == 3 and all(isinstance(x, int) for x in key))


def float8_runs(path: Path = planner_validation.RUNS) -> Path:
    """The published runs that trained in Float8, written to a temporary runs file."""
    data = json.loads(path.read_text())
    data["runs"] = [r for r in data["runs"]
                    if (r.get("implementation") or {}).get("float8", "none") != "none"]
    out = Path(tempfile.mkdtemp(prefix="meshloom-fp8-runs-")) / "runs.json"
    out.write_text(json.dumps(data))
    return out


def validation_shapes(gpu: str, fp8: bool = False) -> list[list[int]]:
    """(m, n, k) of every GEMM priced from `gpu`'s table while the rows run on it are
    searched (the chosen layouts' and every candidate's); with `fp8`, of every GEMM priced
    in fp8 while the Float8 rows on it are."""
    table = kernel_table.for_gpu(gpu)
    if table is None:
        raise SystemExit(f"validation_shapes: no committed kernel table for {gpu!r}")
    if fp8 and not table.fp8_ratio:
        raise SystemExit(f"validation_shapes: the {gpu} table has no fp8 rows, so no row on "
                         "it is priced in fp8")
    table._memo.clear()  # the table memoises every shape it answers: that is the list
    if fp8:
        planner_validation.published_rows(float8_runs())
    else:
        planner_validation.meshloom_h100_rows()
        planner_validation.published_rows()
    return asked_shapes(table._memo, fp8)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="h100",
                   help="the kernel table's GPU, or several comma-separated for the union of "
                        "their lists (default h100)")
    p.add_argument("--fp8", action="store_true",
                   help="the shapes priced in fp8 (the Float8 rows' linears) instead")
    args = p.parse_args(argv)
    shapes = {tuple(s) for gpu in args.gpu.split(",") if gpu.strip()
              for s in validation_shapes(gpu.strip(), args.fp8)}
    print(json.dumps(sorted(list(s) for s in shapes)))


if __name__ == "__main__":
    main()
