"""Kernel tables (src/meshloom/plan/kernels/<gpu>.json) are data the planner trusts, so every file
there must keep the schema and every published number must stay traceable: each GEMM/attention row
names a source, each source gives a url and the figure as quoted, and no rate exceeds what the
GPU's datasheet allows. Read with plain `json` so a broken file cannot hide behind a loader."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from conftest import ROOT

import meshloom.plan
from meshloom.plan.hardware import GPUS

KERNELS = Path(meshloom.plan.__file__).parent / "kernels"
TABLES = sorted(KERNELS.glob("*.json"))

TOP_KEYS = ("gpu", "device", "dtype", "kind", "provenance", "gemm", "attention", "hbm_gbps",
            "launch_us")
SOURCE_KEYS = ("title", "url", "where", "quote")
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _text(value: object) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _check_source(problems: list[str], where: str, row: dict, table: dict) -> None:
    """Published rows must point at a source that exists; measured rows need none."""
    if table.get("kind") != "published":
        return
    if row.get("source") not in table.get("sources", {}):
        problems.append(f"{where}: source {row.get('source')!r} is not in sources")


def _check_rate(problems: list[str], where: str, row: dict, peak: float) -> None:
    tflops = row.get("tflops")
    if not _number(tflops) or not 0 < tflops < peak:
        problems.append(f"{where}: tflops {tflops!r} not in (0, {peak}) (dense bf16 peak)")


def _check_scalar(problems: list[str], name: str, table: dict, upper: float | None) -> None:
    """hbm_gbps / launch_us: null, or {value, what, source}; value below `upper` if given."""
    entry = table[name]
    if entry is None:
        return
    if not isinstance(entry, dict):
        problems.append(f"{name}: must be null or an object")
        return
    value = entry.get("value")
    if not _number(value) or value <= 0 or (upper is not None and value >= upper):
        problems.append(f"{name}: value {value!r} not in (0, {upper})")
    if not _text(entry.get("what")):
        problems.append(f"{name}: 'what' must say what was measured")
    _check_source(problems, name, entry, table)


def check_table(table: object, stem: str) -> list[str]:
    """Every schema violation in one kernel table, as one line each (empty list = valid). A
    table with `compute_from` is checked with the GEMM and attention rows (and their sources)
    of the committed table it names, which must not take them from a third."""
    if not isinstance(table, dict):
        return ["top level must be an object"]
    if "at_power_limit" in table and "compute_from" not in table:
        return ["at_power_limit without compute_from"]
    if "compute_from" in table:
        if "gemm" in table or "attention" in table:
            return ["compute_from and its own gemm or attention rows"]
        base_path = KERNELS / f"{table['compute_from']}.json"
        if not base_path.exists():
            return [f"compute_from {table['compute_from']!r} is not a committed table"]
        base = json.loads(base_path.read_text())
        if "compute_from" in base:
            return [f"compute_from {table['compute_from']!r} takes its compute from a third"]
        if "gemm_fp8" in table:
            return ["compute_from and its own gemm_fp8 rows"]
        table = {**table, "gemm": base["gemm"], "attention": base["attention"],
                 "gemm_fp8": base.get("gemm_fp8", []),
                 "sources": {**base.get("sources", {}), **table.get("sources", {})}}
    missing = [key for key in TOP_KEYS if key not in table]
    if missing:
        return [f"missing keys: {', '.join(missing)}"]
    problems: list[str] = []
    gpu = GPUS.get(table["gpu"])
    if gpu is None or table["gpu"] != stem:
        problems.append(f"gpu {table['gpu']!r} must be a preset equal to the file name {stem!r}")
        return problems
    if not _text(table["device"]):
        problems.append("device must name the GPU measured")
    if table["dtype"] != "bf16":
        problems.append(f"dtype {table['dtype']!r} must be 'bf16'")
    if table["kind"] not in ("measured", "published"):
        problems.append(f"kind {table['kind']!r} must be 'measured' or 'published'")
    if not table["provenance"] or not isinstance(table["provenance"], (dict, str)):
        problems.append("provenance must be a non-empty object or note")
    if table["kind"] == "published":
        sources = table.get("sources")
        if not isinstance(sources, dict) or not sources:
            problems.append("published table needs a non-empty sources map")
        else:
            for key, source in sources.items():
                if not isinstance(source, dict):
                    problems.append(f"sources[{key}] must be an object")
                    continue
                if source.get("kind") == "measured":  # meshloom's own, committed beside it
                    if not _text(source.get("title")) or not _text(source.get("where")):
                        problems.append(f"sources[{key}] lacks title or where")
                    if not (ROOT / str(source.get("path", "")).strip()).is_file():
                        problems.append(f"sources[{key}] path names no committed file")
                    continue
                for field in SOURCE_KEYS:
                    if not _text(source.get(field)):
                        problems.append(f"sources[{key}] lacks {field}")
                if not str(source.get("url", "")).startswith(("https://", "http://")):
                    problems.append(f"sources[{key}] url must be http(s)")
    for name in ("gemm", "attention"):
        if not isinstance(table[name], list):
            problems.append(f"{name} must be a list")
    if problems:
        return problems
    for i, row in enumerate(table["gemm"]):
        where = f"gemm[{i}]"
        if not all(_positive_int(row.get(dim)) for dim in "mnk"):
            problems.append(f"{where}: m, n, k must be positive integers")
        _check_rate(problems, where, row, gpu.peak_tflops)
        _check_source(problems, where, row, table)
    for i, row in enumerate(table["attention"]):
        where = f"attention[{i}]"
        if not all(_positive_int(row.get(dim)) for dim in ("seq", "head_dim", "batch", "heads")):
            problems.append(f"{where}: seq, head_dim, batch, heads must be positive integers")
        if not isinstance(row.get("causal"), bool):
            problems.append(f"{where}: causal must be true or false")
        if row.get("direction") not in DIRECTIONS:
            problems.append(f"{where}: direction {row.get('direction')!r} not in {DIRECTIONS}")
        _check_rate(problems, where, row, gpu.peak_tflops)
        _check_source(problems, where, row, table)
    fp8_rows = table.get("gemm_fp8", [])
    if fp8_rows and gpu.generation != "hopper":
        problems.append(f"gemm_fp8: {table['gpu']} has no fp8 tensor cores")
    for i, row in enumerate(fp8_rows if isinstance(fp8_rows, list) else [None]):
        where = f"gemm_fp8[{i}]"
        if not isinstance(row, dict):
            problems.append(f"{where}: must be an object")
            continue
        if not all(_positive_int(row.get(dim)) for dim in "mnk"):
            problems.append(f"{where}: m, n, k must be positive integers")
        # Hopper's dense fp8 peak is twice its bf16 peak; the 16-bit rate is the bf16 one's.
        _check_rate(problems, where, row, 2 * gpu.peak_tflops)
        _check_rate(problems, f"{where} bf16", {"tflops": row.get("bf16_tflops")},
                    gpu.peak_tflops)
        _check_source(problems, where, row, table)
        _check_source(problems, f"{where} bf16", {"source": row.get("bf16_source")}, table)
    _check_power_limit(problems, table, gpu.peak_tflops)
    _check_scalar(problems, "hbm_gbps", table, gpu.hbm_gbps)
    _check_scalar(problems, "launch_us", table, None)
    return problems


def _check_power_limit(problems: list[str], table: dict, peak: float) -> None:
    """`at_power_limit`: the watts, whether attention is scaled, and GEMM rows measured on
    the GPU at that limit, each cited like any other row."""
    limit = table.get("at_power_limit")
    if limit is None:
        return
    if not isinstance(limit, dict) or not isinstance(limit.get("gemm"), list) or \
            not limit["gemm"]:
        problems.append("at_power_limit: an object with a non-empty gemm list")
        return
    if not _number(limit.get("watts")) or not limit["watts"] > 0:
        problems.append(f"at_power_limit: watts {limit.get('watts')!r} must be positive")
    if not isinstance(limit.get("attention", True), bool) or not _text(limit.get("what")):
        problems.append("at_power_limit: attention must be a bool and 'what' must say what "
                        "the rows are")
    for i, row in enumerate(limit["gemm"]):
        where = f"at_power_limit.gemm[{i}]"
        if not all(_positive_int(row.get(dim)) for dim in "mnk"):
            problems.append(f"{where}: m, n, k must be positive integers")
        _check_rate(problems, where, row, peak)
        _check_source(problems, where, row, table)


def test_kernel_tables_exist():
    assert TABLES, f"no kernel tables in {KERNELS}"


@pytest.mark.parametrize("path", TABLES, ids=[p.name for p in TABLES])
def test_kernel_table_schema(path):
    table = json.loads(path.read_text())
    assert check_table(table, path.stem) == []


def _valid_published() -> dict:
    return {
        "gpu": "h100", "device": "NVIDIA H100 80GB HBM3 (SXM5)", "dtype": "bf16",
        "kind": "published", "provenance": {"note": "test fixture"},
        "sources": {"s": {"title": "t", "url": "https://example.org/x", "where": "Table 1",
                          "quote": "700 TFLOPS"}},
        "gemm": [{"m": 8192, "n": 8192, "k": 8192, "tflops": 700.0, "source": "s"}],
        "attention": [{"seq": 8192, "head_dim": 128, "causal": True, "direction": "fwd",
                       "tflops": 500.0, "batch": 2, "heads": 16, "source": "s"}],
        "gemm_fp8": [{"m": 8192, "n": 8192, "k": 8192, "tflops": 1400.0, "bf16_tflops": 700.0,
                      "source": "s", "bf16_source": "s"}],
        "hbm_gbps": {"value": 2900.0, "what": "copy", "source": "s"},
        "launch_us": None,
    }


_DELETE = object()


def _set(path: str, value: object):
    def apply(table: dict) -> None:
        *parents, last = path.split(".")
        node = table
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return apply


BREAKS = {
    "row source missing from sources": _set("gemm.0.source", "nowhere"),
    "row without source": _set("gemm.0.source", _DELETE),
    "gemm above the dense peak": _set("gemm.0.tflops", 1979.0),
    "gemm rate zero": _set("gemm.0.tflops", 0.0),
    "gemm shape not an integer": _set("gemm.0.k", 8192.5),
    "attention above the dense peak": _set("attention.0.tflops", 990.0),
    "attention direction unknown": _set("attention.0.direction", "forward"),
    "attention causal not a bool": _set("attention.0.causal", "yes"),
    "source without quote": _set("sources.s.quote", ""),
    "source without url": _set("sources.s.url", _DELETE),
    "bandwidth above the datasheet": _set("hbm_gbps.value", 3350.0),
    "bandwidth source missing": _set("hbm_gbps.source", "nowhere"),
    "fp8 table": _set("dtype", "fp8"),
    "fp8 gemm above the fp8 peak": _set("gemm_fp8.0.tflops", 1979.0),
    "fp8 gemm's 16-bit rate above the bf16 peak": _set("gemm_fp8.0.bf16_tflops", 989.0),
    "fp8 gemm without its 16-bit source": _set("gemm_fp8.0.bf16_source", _DELETE),
    "fp8 gemm source missing from sources": _set("gemm_fp8.0.source", "nowhere"),
    "fp8 gemm shape not an integer": _set("gemm_fp8.0.m", "8192"),
    "gpu not a preset": _set("gpu", "h100-pcie"),
    "published without sources": _set("sources", {}),
    "launch overhead negative": _set("launch_us", {"value": -1.0, "what": "gap", "source": "s"}),
    "required key missing": _set("attention", _DELETE),
    "measured source naming no committed file": _set("sources.s", {
        "kind": "measured", "title": "t", "where": "w", "path": "benchmarks/measured/none.json"}),
    "measured source without where": _set("sources.s", {
        "kind": "measured", "title": "t", "path": "pyproject.toml"}),
}


def test_checker_accepts_valid_fixture():
    assert check_table(_valid_published(), "h100") == []
    own = _valid_published()  # a published table may cite a measurement committed here
    own["sources"]["s"] = {"kind": "measured", "title": "t", "where": "w",
                           "path": "benchmarks/measured/h100-2026-11-26/h100-kernels.json"}
    assert check_table(own, "h100") == []
    measured = _valid_published()
    measured["kind"] = "measured"
    del measured["sources"]
    for row in measured["gemm"] + measured["attention"]:
        del row["source"]
    del measured["hbm_gbps"]["source"]
    assert check_table(measured, "h100") == []


@pytest.mark.parametrize("name", list(BREAKS))
def test_checker_rejects_broken_table(name):
    table = copy.deepcopy(_valid_published())
    BREAKS[name](table)
    assert check_table(table, "h100"), f"{name} was not caught"


def _valid_borrowing() -> dict:
    return {
        "gpu": "h100-96gb", "device": "H100 96GB at 500 W", "dtype": "bf16",
        "kind": "published", "provenance": {"note": "test fixture"}, "compute_from": "h100",
        "sources": {"p": {"title": "t", "url": "https://example.org/p", "where": "PR",
                          "quote": "585 TFLOPS"}},
        "at_power_limit": {"watts": 500, "what": "bf16 GEMMs at 500 W", "attention": True,
                           "gemm": [{"m": 8192, "n": 8192, "k": 8192, "tflops": 585.0,
                                     "source": "p"}]},
        "hbm_gbps": {"value": 2000.0, "what": "copy", "source": "p"},
        "launch_us": None,
    }


POWER_BREAKS = {
    "power limit without compute_from": _set("compute_from", _DELETE),
    "power limit row source missing": _set("at_power_limit.gemm.0.source", "nowhere"),
    "power limit row above the peak": _set("at_power_limit.gemm.0.tflops", 990.0),
    "power limit row shape not an integer": _set("at_power_limit.gemm.0.m", 8192.0),
    "power limit without rows": _set("at_power_limit.gemm", []),
    "power limit watts zero": _set("at_power_limit.watts", 0),
    "power limit attention not a bool": _set("at_power_limit.attention", "yes"),
    "power limit without what": _set("at_power_limit.what", _DELETE),
}


def test_checker_accepts_a_valid_power_limit():
    assert check_table(_valid_borrowing(), "h100-96gb") == []


@pytest.mark.parametrize("name", list(POWER_BREAKS))
def test_checker_rejects_a_broken_power_limit(name):
    table = _valid_borrowing()
    POWER_BREAKS[name](table)
    assert check_table(table, "h100-96gb"), f"{name} was not caught"


def test_h200_measurement_supports_taking_the_h100_compute():
    """h200.json takes its GEMM and attention rows from h100.json (`compute_from`). The H200
    measured on 2026-11-28 with the H100 measurement's flags says why, shape by shape: the
    figures its provenance quotes are these, recomputed from the two committed files."""
    import statistics

    h100 = json.loads((ROOT / "benchmarks/measured/h100-2026-11-26/h100-kernels.json").read_text())
    h200 = json.loads((ROOT / "benchmarks/measured/h200-2026-11-28/h200-kernels.json").read_text())
    gemm = {(r["m"], r["n"], r["k"]): r["tflops"] for r in h100["gemm"]}
    ratios = [(r["tflops"] / gemm[s], 2 * math.prod(s)) for r in h200["gemm"]
              if (s := (r["m"], r["n"], r["k"])) in gemm]

    def key(r: dict) -> tuple:
        return r["seq"], r["head_dim"], r["causal"], r["direction"], r.get("kernel", "fa2")

    att = {key(r): r["tflops"] for r in h100["attention"]}
    by_kernel: dict[str, list[float]] = {}
    for r in h200["attention"]:
        if key(r) in att:
            by_kernel.setdefault(key(r)[4], []).append(r["tflops"] / att[key(r)])
    note = json.loads((KERNELS / "h200.json").read_text())["provenance"]["measured_check"]
    big = [x for x, flops in ratios if flops > 1e12]
    thin = [x for x, flops in ratios if flops < 1e10]
    copy_ratio = h200["hbm_gbps"]["value"] / h100["hbm_gbps"]["value"]
    assert (len(h200["gemm"]), len(ratios), len(big), len(thin)) == (592, 555, 242, 27)
    quoted = {"GEMMs median": statistics.median(x for x, _ in ratios),
              "above 1 TFLOP;": statistics.median(big), "0.01 TFLOP": statistics.median(thin),
              "FlashAttention-2 median": statistics.median(by_kernel["fa2"]),
              "cuDNN attention": statistics.median(by_kernel["cudnn"])}
    for words, value in quoted.items():
        digits = 2 if words == "0.01 TFLOP" else 3
        assert f"{value:.{digits}f}" in note, (words, value)
    assert f"{copy_ratio:.2f}x" in note and all(0.97 < quoted[w] < 1.03 for w in (
        "GEMMs median", "FlashAttention-2 median", "cuDNN attention"))
