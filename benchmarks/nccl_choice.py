"""NCCL's algorithm and protocol for the collectives docs/plan.md quotes, as the planner prices
them (plan/nccl.py), written as a result file (one command, no hardware needed):

    python benchmarks/nccl_choice.py

Each case is one call: its pair, its start and its seconds, beside the Simple ring's; and, for
an all-reduce over the 8 H100s of a node, the sizes at which NCCL's model switches protocol.
tests/test_plan_nccl.py checks that the committed file is what the code prices now.
"""

from __future__ import annotations

import sys
from pathlib import Path

from meshloom.plan.hardware import make_cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import parser, provenance, write_result  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "planner" / "nccl_choice.json"
# (name, GPU, GPUs in the cluster, op, bytes, group size, stride)
CASES = (
    ("all_reduce 1 KB, 8 H100s of a node", "h100", 8, "all_reduce", 1e3, 8, 1),
    ("all_reduce 8 MB, 8 H100s of a node", "h100", 8, "all_reduce", 8e6, 8, 1),
    ("all_reduce 1 GB, 8 H100s of a node", "h100", 8, "all_reduce", 1e9, 8, 1),
    ("all_reduce 1 MB, 64 H100 nodes, one rank each", "h100", 512, "all_reduce", 1e6, 64, 8),
    ("reduce_scatter 25 MiB, 32 H100s in 4 nodes", "h100", 64, "reduce_scatter", 25 * 2**20,
     32, 1),
)


def _us(x: float) -> float:
    return round(1e6 * x, 2)


def cases() -> list[dict]:
    out = []
    for name, gpu, n, op, nbytes, size, stride in CASES:
        cl = make_cluster(gpu, n)
        auto, simple = (cl.collective(op, nbytes, size, stride, p) for p in ("auto", "simple"))
        out.append({"case": name, "pair": auto.name, "start_us": _us(auto.start),
                    "seconds_us": _us(auto.seconds), "simple_start_us": _us(simple.start),
                    "simple_seconds_us": _us(simple.seconds)})
    return out


def switches(lo: float = 1e2, hi: float = 1e10, steps: int = 4000) -> list[dict]:
    """Where an all-reduce over the 8 H100s of a node changes pair, on a log grid of sizes
    (each size the first of the grid at which the new pair runs)."""
    cl, out, last = make_cluster("h100", 8), [], None
    for i in range(steps + 1):
        nbytes = lo * (hi / lo) ** (i / steps)
        c = cl.collective("all_reduce", nbytes, 8, 1)
        if c.name != last:
            out.append({"from_bytes": round(nbytes, -3 if nbytes > 1e4 else 0), "pair": c.name,
                        "start_us": _us(c.start)})
            last = c.name
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    result = {"cases": cases(), "h100_node_all_reduce_switches": switches(),
              "config": provenance()}
    return write_result(result, args.out, _print)


def _print(result: dict) -> None:
    for c in result["cases"]:
        print(f"{c['case']:<48} {c['pair']:<12} start {c['start_us']:8.1f} us, "
              f"{c['seconds_us']:9.1f} us in all (Simple ring: {c['simple_seconds_us']:9.1f})")
    for s in result["h100_node_all_reduce_switches"]:
        print(f"from {s['from_bytes']:>14,.0f} B: {s['pair']} (start {s['start_us']} us)")


if __name__ == "__main__":
    main()
