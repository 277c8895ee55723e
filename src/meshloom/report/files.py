"""What a run folder holds, read for `meshloom report`: rank 0's metrics.jsonl, each rank's
memory/rank{R}.jsonl, summary.json and the pipeline timelines, checked as they are read (a bad
file is a `ReportError`: one line naming it)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from meshloom.parallel.pipeline_schedule import Action

KEYS = ("rank", "pp_rank", "pp", "schedule", "virtual_stages", "microbatches", "coords", "spans")


class ReportError(ValueError):
    """Bad input for the report (one line, for the command's error message)."""


def load_pipeline(run_dir: str | os.PathLike) -> list[dict]:
    """The timeline files of one pipeline (other mesh coordinates all 0), in pp-rank order."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReportError(f"{run_dir} does not exist")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder (pass a run folder, RUN_DIR)")
    files = sorted((run_dir / "pipeline").glob("timeline_rank*.json"))
    if not files:
        raise ReportError(f"{run_dir} holds no pipeline timelines (pipeline/timeline_rank*.json):"
                          " it was not trained with parallel.pp > 1, or has not finished")
    ours = []
    for f in files:
        try:
            data = json.loads(f.read_text())
            missing = [k for k in KEYS if k not in data]
            if missing:
                raise KeyError(missing[0])
            coords, pp_rank = data["coords"], int(data["pp_rank"])
            for key in ("pp", "virtual_stages", "microbatches"):
                data[key] = int(data[key])
            others = [int(c) for axis, c in coords.items() if axis != "pp"]
            data["spans"] = sorted(((float(s), float(e), Action(str(k), int(st), int(mb)))
                                    for s, e, k, st, mb in data["spans"]),
                                   key=lambda span: span[:2])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            what = f"no key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise ReportError(f"{f} is not a pipeline timeline ({what})") from None
        if not any(others):
            ours.append((pp_rank, f, data))
    if not ours:
        raise ReportError(f"{run_dir / 'pipeline'} holds no timeline of the first pipeline "
                          "(the ranks whose coordinates other than pp are all 0)")
    ours.sort(key=lambda t: t[0])
    first = ours[0][2]
    pp = first["pp"]
    for _, f, data in ours:
        for key in ("pp", "schedule", "virtual_stages", "microbatches"):
            if data[key] != first[key]:
                raise ReportError(f"{f} says {key}={data[key]!r}, {ours[0][1].name} says "
                                  f"{first[key]!r}: timelines of different runs?")
    have = [r for r, _, _ in ours]
    if have != list(range(pp)):
        raise ReportError(f"{run_dir / 'pipeline'}: the first pipeline needs one timeline per pp "
                          f"rank 0..{pp - 1}, found pp ranks {', '.join(map(str, have))}")
    return [data for _, _, data in ours]


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines log in step order. A last line without its newline is a
    write in progress (the run is live) and is left out; a resumed run logs the steps after its
    checkpoint again, and the later record of a step wins."""
    try:
        lines = path.read_text().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    by_step: dict[int, dict] = {}
    for n, line in enumerate(lines[:-1], 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ReportError(f"{path} line {n} is not JSON") from None
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise ReportError(f"{path} line {n} has no integer \"step\"")
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def _number(record: dict, key: str, path: Path) -> float | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{path}: step {record['step']}: {key} is {value!r}, not a number")
    return float(value)


def series(records: list[dict], key: str, path: Path) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold `key`."""
    points = [(r["step"], _number(r, key, path)) for r in records]
    points = [(s, v) for s, v in points if v is not None]
    return [s for s, _ in points], [v for _, v in points]


def comm_series(records: list[dict], path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Bytes per mesh axis per logged step (an axis a step did not use: 0 that step)."""
    steps, per_step = [], []
    for r in records:
        comm = r.get("comm_bytes") or {}
        if not isinstance(comm, dict):
            raise ReportError(f"{path}: step {r['step']}: comm_bytes is not an object")
        steps.append(r["step"])
        per_step.append({a: _number({"step": r["step"], f"comm_bytes.{a}": b},
                                    f"comm_bytes.{a}", path) or 0.0 for a, b in comm.items()})
    axes = sorted({a for comm in per_step for a in comm})
    return {a: (steps, [c.get(a, 0.0) for c in per_step]) for a in axes}


def mfu_per_token_per_s(records: list[dict]) -> float | None:
    """MFU / tokens_per_s, the same in every step of a run (fixed FLOPs per token and peak);
    None where the run did not know its peak FLOP/s."""
    ratios = [r["mfu"] / r["tokens_per_s"] for r in records
              if r.get("mfu") and r.get("tokens_per_s")]
    return statistics.median(ratios) if ratios else None


def memory_series(run_dir: Path) -> dict[int, dict[str, tuple[list[int], list[float]]]]:
    """Each rank's peak memory (and CUDA reserved peak) per logged step, from the per-rank
    files `memory/rank{R}.jsonl`; {} for a run from before they were written."""
    out = {}
    for path in (run_dir / "memory").glob("rank*.jsonl"):
        try:
            rank = int(path.stem.removeprefix("rank"))
        except ValueError:
            continue  # not one of ours
        records = read_jsonl(path)
        out[rank] = {"peak": series(records, "peak_mem_bytes", path)}
        reserved = series(records, "peak_mem_reserved_bytes", path)
        if reserved[0]:
            out[rank]["reserved"] = reserved
    return dict(sorted(out.items()))


def read_summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    if not path.exists():
        return {}
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(summary, dict):
        raise ReportError(f"{path} does not hold a JSON object")
    return summary
