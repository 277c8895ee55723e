"""Where the config rules live: config.py is a leaf, each strategy owns its rules, and the
planner's search asks the very rules `meshloom train` checks before launch."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from conftest import ROOT

from meshloom.config import ConfigError, load_config
from meshloom.parallel.pipeline_schedule import compute_lists
from meshloom.plan.hardware import make_cluster
from meshloom.plan.layout import Layout, config_toml
from meshloom.plan.models import from_dims
from meshloom.plan.search import check_layout
from meshloom.validation import validate

CONFIG_PY = ROOT / "src" / "meshloom" / "config.py"


def test_config_py_imports_nothing_from_meshloom():
    """Every import in config.py, at any depth (a function's lazy import too)."""
    tree = ast.parse(CONFIG_PY.read_text())
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append("." * node.level + (node.module or ""))
    ours = [name for name in imported if name.split(".")[0] == "meshloom" or name.startswith(".")]
    assert not ours, f"config.py imports {ours}"
    assert "tomllib" in imported  # the walk does see the imports


def test_loading_a_config_needs_no_torch():
    code = ("import sys; from meshloom.config import load_config; "
            f"load_config({str(ROOT / 'configs' / 'tiny.toml')!r}, ['train.steps=3']); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('meshloom.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "['meshloom.config']", out


def test_tomli_stands_in_for_tomllib_before_python_3_11():
    """With no tomllib (Python 3.10), config.py and ps/config.py parse with tomli; the
    package declares tomli for exactly those Pythons."""
    code = ("import sys, tomllib; sys.modules['tomli'] = tomllib; sys.modules['tomllib'] = None; "
            "from meshloom import config; from meshloom.ps import config as ps; "
            "assert config.tomllib is ps.tomllib is sys.modules['tomli']; "
            f"print(config.load_config({str(ROOT / 'configs' / 'tiny.toml')!r}, "
            "['train.lr=1e-3']).train.lr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "0.001", out.stderr
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.10"' in pyproject
    assert "\"tomli>=1.1; python_version < '3.11'\"" in pyproject


# A small Llama: 4 layers, 4 heads, 2 KV heads, MLP 192; `tied` shares the embedding table.
SHAPE = from_dims("llama", 64, 4, 4, 257, kv_heads=2)
TIED = from_dims("llama", 64, 4, 4, 257, kv_heads=2, tied=True)

# (layout, model, seq, global batch, the message both must give; None = valid)
AGREE = [
    (Layout(tp=2, pp=2, dp=2, micro_batch=2, zero=1, schedule="interleaved_1f1b", v=2, sp=True),
     SHAPE, 64, 16, None),
    (Layout(pp=2, dp=1, micro_batch=2, schedule="interleaved_1f1b", v=2), SHAPE, 64, 6,
     "parallel.pp_schedule=interleaved_1f1b needs the micro-batch count (3) to be a multiple "
     "of parallel.pp=2"),
    (Layout(pp=2, dp=1, micro_batch=2, schedule="interleaved_zb", v=2), SHAPE, 64, 6,
     "parallel.pp_schedule=interleaved_zb needs the micro-batch count (3) to be a multiple "
     "of parallel.pp=2"),
    (Layout(pp=2, dp=1, micro_batch=1, schedule="interleaved_zb", v=2), SHAPE, 64, 4, None),
    (Layout(pp=2, dp=1, micro_batch=1, schedule="1f1b", v=2), SHAPE, 64, 4,
     "parallel.pp_virtual_stages=2 needs parallel.pp_schedule=interleaved_1f1b or interleaved_zb "
     "(not 1f1b)"),
    (Layout(pp=4, dp=1, micro_batch=1, schedule="interleaved_1f1b", v=2), SHAPE, 64, 8,
     "parallel.pp=4 x parallel.pp_virtual_stages=2 = 8 stages exceeds model.n_layers=4 (a stage "
     "needs at least one layer)"),
    (Layout(pp=2, dp=2, micro_batch=1, zero=2), TIED, 64, 8,
     "tied embeddings across pipeline stages need parallel.zero_stage <= 1 (got 2): the two "
     "copies' whole gradients are summed between the first and the last stage"),
    (Layout(tp=4, dp=1, micro_batch=1), SHAPE, 64, 4,
     "model.n_kv_heads=2 must be divisible by parallel.tp=4 (fewer KV heads than tp ranks is not "
     "supported: lower parallel.tp or raise model.n_kv_heads)"),
    (Layout(tp=2, dp=1, micro_batch=1, sp=True), SHAPE, 63, 4,
     "data.seq_len=63 must be divisible by parallel.tp=2 with parallel.sequence_parallel (the "
     "sequence is split over tp)"),
    (Layout(cp=2, dp=1, micro_batch=1), SHAPE, 62, 4,
     "data.seq_len=62 must be divisible by 2 x parallel.cp = 4"),
    (Layout(dp=1, micro_batch=1, zero=1), SHAPE, 64, 4,
     "parallel.zero_stage=1 shards over parallel.dp_shard, which is 1"),
]


@pytest.mark.parametrize("lay,shape,seq,batch,message", AGREE,
                         ids=[a[0].short() + f" seq{a[2]}" for a in AGREE])
def test_search_and_validate_agree(lay, shape, seq, batch, message, tmp_path):
    """The planner's verdict on a layout is the one `meshloom train` gives the config the
    planner writes for it (--write-config), message for message."""
    planned = check_layout(shape, lay, make_cluster("h100", lay.gpus), seq, batch)
    path = tmp_path / "plan.toml"
    path.write_text(config_toml(lay, shape, seq, batch, "fp32"))
    try:
        validate(load_config(path), lay.gpus, check_data=False)
        checked = None
    except ConfigError as e:
        checked = str(e)
    assert (planned, checked) == (message, message)


def test_the_schedule_builder_refuses_with_the_same_rule():
    """Interleaving's micro-batch rule is written once: building the schedule refuses with the
    message validation gives."""
    with pytest.raises(ValueError) as e:
        compute_lists("interleaved_1f1b", 2, 3, 2)
    assert str(e.value) == AGREE[1][-1]
