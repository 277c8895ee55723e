"""The planner examples docs/plan.md quotes (benchmarks/planner_examples.py) are committed result
files that the code still reproduces, and the docs quote those files (DESIGN principle 7)."""

from __future__ import annotations

import json
import math
import re
import shlex

import pytest
from conftest import load_benchmark

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _examples():
    return load_benchmark("planner_examples")


@pytest.fixture(scope="module")
def live():
    """Every example planned now, by the code under test, and the worked example's text."""
    pe = _examples()
    return {name: pe.plan_json(name) for name in pe.EXAMPLES}, pe.worked_text()


def _committed(name: str) -> dict:
    return json.loads((_examples().OUT / f"{name}.json").read_text())


def _same(old, new, where: str) -> None:
    """Equal structure and values; floats to 1e-9 (the planner is plain Python arithmetic, but
    a libm may round exp/log differently in the last place)."""
    if isinstance(old, dict):
        assert isinstance(new, dict) and old.keys() == new.keys(), where
        for k in old:
            _same(old[k], new[k], f"{where}.{k}")
    elif isinstance(old, list):
        assert isinstance(new, list) and len(old) == len(new), where
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(old, float) and not isinstance(new, bool):
        assert isinstance(new, (int, float)) and math.isclose(old, new, rel_tol=1e-9), where
    else:
        assert old == new, where


def _same_text(old: str, new: str) -> None:
    """The same text, its numbers allowed one unit in their last printed place."""
    assert _NUMBER.sub("#", old) == _NUMBER.sub("#", new)
    for a, b in zip(_NUMBER.findall(old), _NUMBER.findall(new), strict=True):
        places = len(a.partition(".")[2])
        assert abs(float(a.replace(",", "")) - float(b.replace(",", ""))) <= 1.01 * 10 ** -places, \
            (a, b)


def test_every_example_file_is_what_the_code_plans(live):
    files, _ = live
    assert len(files) == 28
    for name, new in files.items():
        _same(_committed(name), new, name)


def test_worked_example_text_and_its_docs_block(live):
    pe = _examples()
    _, text = live
    committed = (pe.OUT / f"{pe.WORKED}.txt").read_text()
    _same_text(committed, text)
    assert committed.startswith(f"$ meshloom plan {pe.EXAMPLES[pe.WORKED]} --explain\n")
    page = pe.DOC.read_text()
    block = page[page.index(pe.BEGIN):page.index(pe.END) + len(pe.END)]
    assert block == pe.render(committed)


def test_worked_example_prose_quotes_the_files():
    """Each figure the prose quotes from a variant (compile, TP overlap, no recompute, ZeRO-1)
    is the committed file's, so a regenerated file with a new figure fails until the prose
    follows."""
    pe = _examples()
    files = {name: _committed(name) for name in pe.EXAMPLES if name.startswith(pe.WORKED)}
    page = pe.DOC.read_text()
    prose = page[page.index(pe.END):].partition("\n## ")[0]
    for key, figure in pe.figures(files).items():
        assert figure in prose, (key, figure)
    for name in files:  # and names every file it quotes from
        if name != pe.WORKED:
            assert f"results/planner/{name}.json" in prose, name


def test_docs_moe_commands_are_the_examples():
    """The commands docs/plan-moe.md lists for its MoE files are those the script runs (parsed
    by meshloom's own parser, so spelling and order do not matter)."""
    from meshloom.commands import build_parser
    pe = _examples()
    page = pe.MOE_DOC.read_text()
    start = page.index("```bash", page.index("`python benchmarks/planner_examples.py`, which runs"))
    script = page[start + len("```bash"):page.index("```", start + 3)].replace("\\\n", " ")
    env, listed = {}, {}
    for line in filter(None, (s.strip() for s in script.splitlines())):
        if re.fullmatch(r"""[A-Z]+=("[^"]*"|\S+)""", line):
            key, _, value = line.partition("=")
            env[key] = value.strip('"')
            continue
        for key, value in env.items():
            line = line.replace(f"${key}", value)
        command, _, target = line.partition(">")
        listed[target.strip().rpartition("/")[2].removesuffix(".json")] = shlex.split(command)
    want = {k: v for k, v in pe.EXAMPLES.items() if k.startswith("moe_")}
    assert listed.keys() == want.keys()
    parser = build_parser()
    for name, argv in want.items():
        assert listed[name][:2] == ["meshloom", "plan"], name
        assert parser.parse_args(listed[name][1:]) == parser.parse_args(
            ["plan", *shlex.split(argv), "--json"]), name


def test_gpt2_fsdp_plan_file_is_what_the_code_plans():
    """benchmarks/results/planner/gpt2_fsdp.json (docs/gpt2_fsdp.md): each row's command,
    rerun now, gives the row's fit, memory and speed."""
    gp = load_benchmark("gpt2_fsdp_plan")
    committed = json.loads((_examples().OUT / "gpt2_fsdp.json").read_text())
    assert len(committed["rows"]) == 64
    for row in committed["rows"]:
        argv = shlex.split(row["command"])
        assert argv[0] == "meshloom"
        c = gp.run_plan(argv[1:])["candidates"][0]
        mem = c["memory_per_gpu_bytes"]
        assert c["fits"] == row["fits"], row["command"]
        assert abs(mem["total"] / 1e9 - row["memory_gb"]) <= 0.0051, row["command"]
        assert abs(mem["activations"] / 1e9 - row["activations_gb"]) <= 0.0051, row["command"]
        assert abs(c["tokens_per_s_per_gpu"] - row["tokens_per_s_per_gpu"]) <= 0.51, \
            row["command"]


def test_moe_prose_quotes_its_pinned_layouts():
    """The two layouts the MoE section compares with the searches' picks: their step, speed
    and memory as the prose gives them, from their files."""
    page = _examples().MOE_DOC.read_text()
    pp4 = _committed("moe_mixtral_8x7b_64xh100_pp4")["candidates"][0]
    mem = pp4["memory_per_gpu_bytes"]
    assert not pp4["fits"]
    assert (f"{pp4['step_time_s']:.2f} s, needs {mem['total'] / 1e9:.1f} GB: its "
            f"{mem['activations'] / 1e9:.0f} GB of\n  activations do not fit beside "
            f"{mem['params'] / 1e9:.1f} GB") in page
    z3 = _committed("moe_mixtral_8x22b_128xh100_zero3")["candidates"][0]
    assert z3["fits"]
    assert f"({z3['step_time_s']:.1f} s, {z3['tflops_per_gpu']:.0f} TFLOP/s," in page
