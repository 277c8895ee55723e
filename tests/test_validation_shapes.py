"""benchmarks/validation_shapes.py lists the GEMMs the validation asks a kernel table for, the
list a lent GPU measures (`meshloom bench kernels --shapes`); with --fp8, the Float8 rows'
fp8 GEMMs (`gpu_check.sh fp8`). A table's memo also keeps fp8 ratios and attention rates under
keys of their own, which the lists must leave out."""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest
from conftest import ROOT

from meshloom.commands import main as meshloom_main
from meshloom.plan.models import PRESETS
from meshloom.plan.step_kernels import block_gemms

sys.path.insert(0, str(ROOT / "benchmarks"))
import validation_shapes as vs  # noqa: E402


def test_the_lists_keep_only_their_own_keys():
    memo = {(4096, 1024, 16384): 650.0, ("fp8", 512, 4096, 98304): 1.5,
            ("attention", 8192, 128, True, "fwd", "fa2"): 400.0, (128, 256, 64): 90.0}
    assert vs.asked_shapes(memo) == [[128, 256, 64], [4096, 1024, 16384]]
    assert vs.asked_shapes(memo, fp8=True) == [[512, 4096, 98304]]


@pytest.fixture(scope="module")
def fp8_shapes() -> list[list[int]]:
    return vs.validation_shapes("h100-96gb", fp8=True)


def test_the_float8_rows_fp8_gemms_are_listed(fp8_shapes):
    """Each linear's three GEMMs of the 8B under FSDP 8 x TP 8 at 12 sequences of 8192 tokens
    a rank (torchtitan's async-TP Float8 rows), the narrow per-rank shapes among them."""
    assert fp8_shapes == sorted(fp8_shapes) and all(
        len(s) == 3 and all(isinstance(x, int) and x > 0 for x in s) for s in fp8_shapes)
    tokens = 12 * 8192
    for g in block_gemms(PRESETS["llama3-8b"], tokens, 8):
        for shape in ([g.m, g.n, g.k], [g.m, g.k, g.n], [g.k, g.n, g.m]):
            assert shape in fp8_shapes, (g.name, shape)
    assert [98304, 128, 4096] in fp8_shapes  # wk: 1024 key columns over 8 ranks


def test_a_table_without_fp8_rows_lists_none_and_says_why():
    with pytest.raises(SystemExit) as err:
        vs.validation_shapes("a100-80g", fp8=True)
    assert "no fp8 rows" in str(err.value) and "\n" not in str(err.value)


def test_several_gpus_give_the_union(capsys, fp8_shapes):
    vs.main(["--gpu", "h100-96gb,h200", "--fp8"])
    union = json.loads(capsys.readouterr().out)
    h200 = vs.validation_shapes("h200", fp8=True)
    assert {tuple(s) for s in union} == {tuple(s) for s in fp8_shapes + h200}
    assert union == sorted(union)


def test_gpu_check_fp8_phase_runs_the_bench_it_names(tmp_path, capsys):
    """The phase's `bench kernels` arguments, run on CPU with a small shapes file and bf16
    only (a CPU has no fp8): the table it would write holds the listed shapes."""
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    phase = script[script.index('if [ "$phase" = fp8 ]'):]
    phase = phase[:phase.index("exit 0")]
    assert 'validation_shapes.py --gpu h100-96gb,h200 --fp8 > "$OUT/fp8_shapes.json"' in phase
    line = re.search(r"meshloom bench kernels (.*?)\"\$@\"", phase.replace("\\\n", " "), re.S)
    words = shlex.split(line.group(1).replace("$OUT", str(tmp_path)))
    assert "--fp8" in words and words[words.index("--shapes") + 1] == str(
        tmp_path / "fp8_shapes.json")
    (tmp_path / "fp8_shapes.json").write_text("[[48, 40, 24], [8, 16, 32]]")
    assert meshloom_main(["bench", "kernels", *words, "--no-fp8", "--reps", "1",
                          "--gpu-name", "test"]) == 0
    raw = json.loads((tmp_path / "fp8_kernels.json").read_text())
    assert {(48, 40, 24), (8, 16, 32)} <= {(g["m"], g["n"], g["k"]) for g in raw["gemm"]}
    assert {(a["seq"], a["head_dim"]) for a in raw["attention"]} == {(512, 64)}
