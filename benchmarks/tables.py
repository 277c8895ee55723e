"""The tables of benchmarks/README.md, rendered from the committed result files.

Each table sits in the README between `<!-- table:NAME -->` and `<!-- /table:NAME -->`; `apply`
replaces what is between the markers, so the numbers there always come from the JSON files (a
test checks that the committed README equals what this module renders from them). A table ends
with a line naming its file(s), the commit, torch version, date and load average of the run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
MIB = 2**20


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


def _pair(v: dict, other: str) -> str:
    """Median ratio to `other`, and in brackets the median of the step-by-step ratios."""
    r, paired = v[f"ratio_to_{other}"], v.get(f"paired_ratio_to_{other}")
    return "-" if r is None else f"{r:.3f} ({_x(paired)})"


def _mib(b: float) -> str:
    return f"{b / MIB:.1f}"


def _row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(head: list[str], rows: list[list]) -> list[str]:
    return [_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows)]


def _source(results: Path, names: list[str]) -> str:
    """Which files a table comes from, and what they were measured with."""
    links = ", ".join(f"[`{results.name}/{n}.json`](results/{results.name}/{n}.json)"
                      for n in names)
    metas = [json.loads((results / f"{n}.json").read_text())["meta"] for n in names]
    m = metas[0]
    loads = [x["load_average_1min"] for x in metas]
    lo, hi = min(x["min"] for x in loads), max(x["max"] for x in loads)
    commits = sorted({x["commit"] for x in metas})
    dates = sorted({x["date"][:10] for x in metas})
    return (f"Source: {links} (commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}, "
            f"torch {m['torch']}, {m['cpu_model']} x {m['cores']} cores, {', '.join(dates)}; "
            f"load average {lo:.1f} to {hi:.1f} during the run{'s' if len(names) > 1 else ''}).")


def planner_file(results: Path) -> Path:
    """The planner's checks need no hardware: one file beside the machines' folders."""
    return results.parent / "planner" / "validation.json"


def _load(results: Path, name: str) -> dict:
    return json.loads((results / f"{name}.json").read_text())


def ddp_vs_torch(results: Path) -> list[str]:
    rows = []
    names = ["ddp_vs_torch_demo", "ddp_vs_torch_small"]
    for n in names:
        r = _load(results, n)
        c = r["config"]
        rows.append([f"{c['preset']} ({c['params'] / 1e6:.2f}M)", c["steps"],
                     _ms(r["ours"]["median_s"]), _ms(r["torch"]["median_s"]), _x(r["ratio"]),
                     _x(r["paired_ratio_median"]), f"{r['ours_faster_fraction']:.0%}",
                     "identical" if r["check"]["max_abs_diff"] == 0 else
                     f"max diff {r['check']['max_abs_diff']:.1g}"])
    head = ["model", "steps", "ours median", "torch median", "ratio (medians)", "paired median",
            "ours faster", "final params"]
    return [*_table(head, rows), "", _source(results, names)]


def dp_vs_ddp(results: Path) -> list[str]:
    rows = []
    names = ["dp_vs_ddp_demo", "dp_vs_ddp_small", "dp_vs_ddp_tiny"]
    for n in names:
        r = _load(results, n)
        c, v, m = r["config"], r["variants"], r["comm"]
        rows.append([f"{c['preset']} ({c['params'] / 1e6:.2f}M)", c["steps"],
                     _ms(v["dp"]["median_s"]), _ms(v["ddp"]["median_s"]),
                     _ms(v["single"]["median_s"]),
                     _pair(v["dp"], "ddp"), _pair(v["single"], "ddp"), _pair(v["dp"], "single"),
                     f"{_mib(m['dp']['bytes_per_step'])} / {_mib(m['ddp']['bytes_per_step'])} "
                     f"({m['dp']['bytes_per_step'] / m['ddp']['bytes_per_step']:.2f}x)"])
    head = ["model", "timed steps", "dp", "ddp", "single", "dp / ddp (paired)",
            "single / ddp (paired)", "dp / single (paired)", "MiB per step dp / ddp"]
    return [*_table(head, rows), "", _source(results, names)]


def _per_variant(results: Path, names: list[str], cells: Callable[[dict], list]) -> list[list]:
    """A row per variant of each file: model, variant, timed steps, median step, then cells(v)."""
    rows = []
    for n in names:
        r = _load(results, n)
        c = r["config"]
        rows += [[f"{c['preset']} ({c['params'] / 1e6:.2f}M)", name, c["steps"],
                  _ms(v["median_s"]), *cells(v)] for name, v in r["variants"].items()]
    return rows


def _comm(v: dict) -> str:
    return "n/a" if not v["comm"] else _mib(v["comm"]["bytes_per_step"])


def zero_vs_fsdp2(results: Path) -> list[str]:
    names = ["zero_vs_fsdp2_small", "zero_vs_fsdp2_demo"]
    rows = _per_variant(results, names, lambda v: [
        _pair(v, "fsdp2"), _pair(v, "ddp"),
        f"{v['memory_bytes']['after_step']['total'] / MIB:.2f}",
        f"{v['memory_bytes']['step_peak'] / MIB:.2f}", _comm(v)])
    head = ["model", "variant", "timed steps", "median step", "vs FSDP2 (paired)",
            "vs our DDP (paired)",
            "state MiB", "in-step peak MiB", "comm MiB/step"]
    return [*_table(head, rows), "", _source(results, names)]


def zero3_accumulation(results: Path) -> list[str]:
    names = ["zero3_accumulation_demo"]
    r = _load(results, names[0])
    c = r["config"]
    base = {"zero3_once": "zero3", "fsdp2_once": "fsdp2", "zero3": "fsdp2"}
    rows = []
    for name, v in r["variants"].items():
        b = base.get(name)
        ratio = f"{_x(v.get(f'paired_ratio_to_{b}'))} vs {b}" if b else "-"
        rows.append([f"{c['preset']} ({c['params'] / 1e6:.2f}M)", name, c["micro_batches"],
                     c["steps"], _ms(v["median_s"]), ratio,
                     f"{v['memory_bytes']['state'] / MIB:.2f}",
                     f"{v['memory_bytes']['step_peak'] / MIB:.2f}", _comm(v)])
    head = ["model", "variant", "micro-batches", "timed steps", "median step",
            "paired ratio", "state MiB", "in-step peak MiB", "comm MiB/step"]
    return [*_table(head, rows), "", _source(results, names)]


def tp_vs_dtensor(results: Path) -> list[str]:
    names = ["tp_vs_dtensor_demo", "tp_vs_dtensor_small"]
    rows = _per_variant(results, names, lambda v: [
        _x(v["ratio_to_dtensor"]), _x(v["paired_ratio_to_dtensor"]),
        _x(v["ratio_to_dtensor_sp"]), _comm(v), sum(v["collectives_per_step"].values())])
    head = ["model", "variant", "timed steps", "median step", "vs dtensor_tp", "paired",
            "vs dtensor_tp_sp", "comm MiB/step", "collectives/step"]
    return [*_table(head, rows), "", _source(results, names)]


def pp_vs_torch(results: Path) -> list[str]:
    r = _load(results, "pp_vs_torch_demo")
    rows = []
    for name, v in r["variants"].items():
        b, lists = v["bubble"], v["lists"]
        kind = ("meshloom's" if name.startswith("meshloom") else
                "torch's loop" if lists["source"] != "torch's pipeline_order" else
                "torch's, as meshloom's" if lists["same_as_meshloom"] else
                "torch's, not meshloom's")
        rows.append([name, kind,
                     _ms(v["median_s"]), _x(v["ratio_to_torch"]),
                     _x(v["paired_ratio_to_torch"]), f"{b['measured_median']:.3f}",
                     f"{b['predicted_unit_cost']:.3f}", f"{b['predicted_measured_costs']:.3f}",
                     f"{v['comm']['bytes_per_step'] / MIB:.2f}"])
    c = r["config"]
    head = ["variant", "action lists", "median step", "vs torch", "paired", "measured bubble",
            "simulated (unit costs)", "simulated (measured costs)", "MiB sent/step"]
    return [f"{c['preset']} ({c['params'] / 1e6:.2f}M), pp = {c['pp']} (interleaved: "
            f"{c['virtual_stages']} stages per rank), {c['microbatches']} micro-batches of "
            f"{c['batch']} x {c['seq']} tokens, {c['steps']} timed steps:", "",
            *_table(head, rows), "", _source(results, ["pp_vs_torch_demo"])]


def pp_schedules(results: Path) -> list[str]:
    r = _load(results, "pp_schedules")
    c = r["config"]
    rows = [[name + (f", v = {x['virtual_stages']}" if x["virtual_stages"] > 1 else ""),
             f"{x['measured_bubble']:.1%}", f"{x['predicted_bubble_measured_costs']:.1%}",
             f"{x['predicted_bubble_unit_costs']:.1%}", f"{x['makespan_ms']:.0f} ms",
             f"{x['bubble_median']:.1%}"]
            for name, x in r["runs"].items()]
    head = ["schedule", "measured bubble", "predicted (measured costs)", "unit costs",
            "makespan", f"median bubble, {c['steps']} steps"]
    return [f"{c['preset']}, pp = {c['pp']}, {c['microbatches']} micro-batches of "
            f"{c['micro_batch']} x {c['seq']} tokens, the last of {c['steps']} steps:", "",
            *_table(head, rows), "", _source(results, ["pp_schedules"])]


def cp_memory(results: Path) -> list[str]:
    r = _load(results, "cp_memory")
    rows = [[cp, v["tokens_per_rank"], _ms(v["median_s"]), f"{v['time_ratio']:.2f}",
             f"{_mib(v['peak_bytes'])} MiB", f"{_mib(v['state_bytes'])} MiB",
             f"{_mib(v['rise_bytes'])} MiB", f"{v['peak_ratio']:.2f}"]
            for cp, v in r["runs"].items()]
    head = ["cp", "tokens/rank", "median step", "vs cp=1", "peak/rank", "state", "rise",
            "peak vs cp=1"]
    ch = r["check"]
    return [*_table(head, rows), "",
            f"First-step loss agrees at every cp: {ch['ok']} (max relative difference "
            f"{ch['max_rel_diff']:.1g}).", _source(results, ["cp_memory"])]


def moe_ep(results: Path) -> list[str]:
    r = _load(results, "moe_ep")
    c, a2a = r["config"], r["comm"]["all_to_all"]
    rows = [[name if name == "ep1" else f"ep{c['ep']}", len(v["times_s"]), _ms(v["median_s"]),
             f"{v['ratio_to_ep1']:.3f} ({v['paired_ratio_to_ep1']:.3f})",
             _mib(max(v["expert_param_bytes_per_rank"])),
             _mib(a2a["ep1_per_step" if name == "ep1" else "measured_per_step"])]
            for name, v in r["variants"].items()]
    head = ["variant", "timed steps", "median step", "vs ep1 (paired)", "expert MiB/rank",
            "all-to-all MiB/step"]
    ch = r["check"]
    return [f"One MoE layer: dim {c['dim']}, {c['experts']} experts of width {c['hidden']}, "
            f"top {c['top_k']}, dropless, {c['tokens_per_rank']} tokens per rank, {c['nproc']} "
            f"ranks x {c['threads_per_rank']} thread(s), forward + backward:", "",
            *_table(head, rows), "",
            f"All-to-all bytes per step over the ep group: measured {a2a['measured_per_step']}, "
            f"formula 4 x A x dim x 4 = {a2a['formula_per_step']} (A = "
            f"{r['comm']['assignments_per_step']} assignments): "
            f"{'equal' if a2a['equal'] else 'not equal'} at every timed step. ep{c['ep']} agrees "
            f"with ep1 (outputs, input, router and expert gradients): {ch['ok']} (max relative "
            f"difference {max(ch['max_rel_diff'].values()):.1g}).",
            _source(results, ["moe_ep"])]


def _tp_generate(results: Path, name: str) -> list[str]:
    r = _load(results, name)
    rows = [[tp, f"{v['prefill_tokens_per_s']:.0f}", f"{v['paired_prefill_speedup']:.2f}",
             f"{v['decode_tokens_per_s']:.1f}", f"{v['paired_decode_speedup']:.2f}",
             f"{v['decode_ms_per_step']:.1f}", f"{sum(v['collectives_per_token'].values()):.0f}",
             "-" if v["allreduce_latency_us"] is None or tp == "1"
             else f"{v['allreduce_latency_us'] / 1e3:.2f} ms",
             f"{v['collective_share']:.0%}"]
            for tp, v in r["runs"].items()]
    c = r["config"]
    head = ["tp", "prefill tok/s", "paired", "decode tok/s", "paired", "ms/token",
            "collectives/token", "one all-reduce", "in collectives"]
    return [f"{c['preset']} ({c['params'] / 1e6:.2f}M), prompt {c['prompt_len']}, "
            f"{c['new_tokens']} new tokens, {c['repeats']} rounds; greedy tokens identical at "
            f"every tp: {r['check']['ok']}.", "", *_table(head, rows), "",
            _source(results, [name])]


def tp_generate(results: Path) -> list[str]:
    return _tp_generate(results, "tp_generate")


def tp_generate_long_prompt(results: Path) -> list[str]:
    return _tp_generate(results, "tp_generate_long_prompt")


def gpt2_vs_transformers(results: Path) -> list[str]:
    r = _load(results, "gpt2_vs_transformers")
    c, ours, theirs = r["config"], r["runs"]["ours"], r["runs"]["transformers"]
    shape = f"{c['layers']} x dim {c['dim']}, vocab {c['vocab']}, {c['batch']} x {c['seq']}"
    rows = [[shape, c["threads"], len(ours["times_s"]), _ms(ours["median_s"]),
             _ms(theirs["median_s"]),
             f"{r['ratio_ours_to_transformers']:.3f} "
             f"({r['paired_ratio_ours_to_transformers']:.3f})",
             f"{r['cpu_ratio_ours_to_transformers']:.3f} "
             f"({r['paired_cpu_ratio_ours_to_transformers']:.3f})"]]
    head = ["model", "threads", "timed steps", "ours (median)", "transformers (median)",
            "ours / transformers, wall (paired)", "CPU time (paired)"]
    ch = r["check"]
    return [*_table(head, rows), "",
            f"Same logits: {ch['ok']} (max difference {ch['max_abs_logit_diff']:.1g}, "
            f"gradients {ch['max_abs_grad_diff']:.1g}).",
            _source(results, ["gpt2_vs_transformers"])]


def planner_validation(results: Path) -> list[str]:
    r = json.loads(planner_file(results).read_text())
    rows = [[name, x["rows"], f"{x['mean_abs_error']:.1%}", f"{x['max_abs_error']:.1%}",
             "yes" if x["all_fit"] else "no"] for name, x in r["summary"].items()]
    head = ["set", "runs", "mean abs error", "max abs error", "all predicted to fit"]
    return [*_table(head, rows), "",
            "Predicted vs measured or published throughput (tokens/s per GPU), each run on its "
            "own layout and implementation; kernel rates from `src/meshloom/plan/kernels/`, "
            "nothing fitted to these runs. Per-run rows: "
            "[docs/plan-validation.md](../docs/plan-validation.md). Source: "
            "[`planner/validation.json`](results/planner/validation.json) (commit "
            f"{r['config']['git'].get('commit')})."]


TABLES: dict[str, Callable[[Path], list[str]]] = {
    f.__name__: f for f in (ddp_vs_torch, dp_vs_ddp, zero_vs_fsdp2, zero3_accumulation,
                            tp_vs_dtensor, pp_vs_torch,
                            pp_schedules, cp_memory, moe_ep, tp_generate, tp_generate_long_prompt,
                            gpt2_vs_transformers, planner_validation)}


def readme_results(text: str) -> Path:
    """The results/<machine>/ folder the README's tables come from (its first link to one)."""
    m = re.search(r"\]\(results/(?!planner/)([^/)]+)/", text)
    if not m:
        raise ValueError("README links no results/<machine>/ folder")
    return HERE / "results" / m.group(1)


def render(results: Path) -> dict[str, str]:
    """Every table's markdown, from the result files in `results` (results/<machine>/)."""
    return {name: "\n".join(f(results)) for name, f in TABLES.items()}


def apply(text: str, tables: dict[str, str]) -> str:
    """`text` with each marked table replaced; a marker pair missing from `text` is an error."""
    for name, body in tables.items():
        pattern = re.compile(rf"(<!-- table:{name} -->\n)(?:.*?\n)?(<!-- /table:{name} -->)",
                             re.S)
        if not pattern.search(text):
            raise ValueError(f"README has no <!-- table:{name} --> ... <!-- /table:{name} -->")
        text = pattern.sub(lambda m, b=body: m.group(1) + b + "\n" + m.group(2), text)
    return text
